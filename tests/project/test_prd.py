"""Keep prd.json honest: schema, vocabularies, evidence that exists and is of the right class,
and records that back exactly what each story claims.

``validate`` returns every problem it finds; the repo's prd.json must have none, and each rule is
also shown to fire on a deliberately broken copy. A story's ``records`` are evidence records
(``dgr certify`` and the like) loaded under the repo's lock: a done story needs at least one,
each must be admitted (schema, id, lock, time) and of at least the story's class, and a gate
story's verdict must be what the gate evaluator returns from them at the story's class.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from dgr_engine.certification.errors import EvidenceError
from dgr_engine.certification.gates import evaluate
from dgr_engine.certification.lock import Lock, load_lock
from dgr_engine.certification.record import EvidenceRecord, load_record
from dgr_session.identity import EvidenceClass

REPO_ROOT = Path(__file__).resolve().parents[2]
PRD_PATH = REPO_ROOT / "prd.json"
LOCK_PATH = REPO_ROOT / "certification" / "lock.json"

STATUSES = frozenset({"planned", "in-progress", "done", "blocked"})
EVIDENCE_CLASSES = frozenset({"fixture", "real-model", "real-hardware", "release"})
GATE_VERDICTS: dict[str, list[str]] = {
    "DGR-020": ["go", "optimize baseline", "stop"],
    "DGR-054": ["alpha", "optimize measured bottleneck", "stop"],
    "DGR-070": ["beta", "targeted optimization", "stop/rollback"],
}
SEED_STORIES = frozenset({"DGR-017", "DGR-019", "DGR-020", "DGR-027", "DGR-054", "DGR-070"})
PROJECT_STORIES = frozenset(f"DGR-P00{i}" for i in range(1, 6))
# Gates decide on measured real results: they can never be satisfied by fixture evidence.
GATE_MIN_CLASS = {"DGR-020": "real-model", "DGR-054": "real-model", "DGR-070": "real-hardware"}
CLASS_RANK = {"fixture": 0, "real-model": 1, "real-hardware": 2, "release": 3}
PINNED_LLAMA_CPP = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"

TOP_KEYS = {"schema_version": int, "notes": str, "stories": list}
REQUIRED_KEYS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "title": str,
    "status": str,
    "evidence_class_required": str,
    "evidence": list,
    "verdict": (str, type(None)),
    "records": list,
    "notes": str,
}
OPTIONAL_KEYS: dict[str, type | tuple[type, ...]] = {"verdicts": list, "depends_on": list}
ID_PATTERN = re.compile(r"^DGR-(P\d{3}|\d{3})$")


def _check_evidence_path(sid: str, cls: str, status: str, path: Any, root: Path) -> list[str]:
    if not isinstance(path, str) or not path:
        return [f"{sid}: evidence entry {path!r} is not a non-empty string"]
    rel = Path(path)
    if rel.is_absolute() or ".." in rel.parts:
        return [f"{sid}: evidence path {path!r} must be relative to the repo root, no '..'"]
    errors = []
    if not (root / rel).is_file():
        errors.append(f"{sid}: evidence path {path!r} does not exist")
    classes = {c.value for c in EvidenceClass if c.satisfies(EvidenceClass(cls))}
    if (
        cls != "fixture"
        and status == "done"
        and (rel.parts[:1] != ("evidence",) or len(rel.parts) < 2 or rel.parts[1] not in classes)
    ):
        errors.append(
            f"{sid}: {cls} evidence must live under evidence/<{cls} or above>/, got {path!r} "
            "(fixture evidence never stands in for it)"
        )
    return errors


def _load_records(
    sid: str, paths: list[Any], root: Path, lock: Lock
) -> tuple[list[EvidenceRecord], list[str]]:
    records, errors = [], []
    for path in paths:
        if not isinstance(path, str) or Path(path).parts[:1] != ("evidence",):
            errors.append(f"{sid}: record {path!r} must be a path under evidence/")
            continue
        try:
            records.append(load_record(root / path, lock))
        except EvidenceError as exc:
            errors.append(f"{sid}: record {path} refused: {exc}")
    return records, errors


def _check_records(story: dict[str, Any], root: Path, lock: Lock) -> list[str]:
    """The story claims no more than its records show."""
    sid, cls, status = story["id"], story["evidence_class_required"], story["status"]
    if status == "done" and not story["records"]:
        return [f"{sid}: done without a record"]
    records, errors = _load_records(sid, story["records"], root, lock)
    required = EvidenceClass(cls)
    for path, record in zip(story["records"], records, strict=False):
        if not record.evidence_class.satisfies(required):
            errors.append(
                f"{sid}: record {path} is {record.evidence_class.value} evidence; it cannot "
                f"back a {cls} claim"
            )
    if sid in GATE_VERDICTS and story["verdict"] is not None and not errors:
        result = evaluate(sid, records, lock, required)
        if result.verdict != story["verdict"]:
            errors.append(
                f"{sid}: claims {story['verdict']!r}; its records give {result.line}: the story "
                "claims more than its records show"
            )
    return errors


def _check_story(story: Any, root: Path) -> list[str]:
    if not isinstance(story, dict):
        return [f"story {story!r} is not an object"]
    sid = str(story.get("id", "<no id>"))
    errors = []
    for key, typ in REQUIRED_KEYS.items():
        if key not in story:
            errors.append(f"{sid}: missing key {key!r}")
        elif not isinstance(story[key], typ):
            errors.append(f"{sid}: {key!r} has the wrong type")
    for key in story.keys() - REQUIRED_KEYS.keys() - OPTIONAL_KEYS.keys():
        errors.append(f"{sid}: unknown key {key!r}")
    for key, typ in OPTIONAL_KEYS.items():
        if key in story and not isinstance(story[key], typ):
            errors.append(f"{sid}: {key!r} has the wrong type")
    if errors:
        return errors

    status, cls, evidence = story["status"], story["evidence_class_required"], story["evidence"]
    if not ID_PATTERN.match(sid):
        errors.append(f"{sid}: id does not match {ID_PATTERN.pattern}")
    if not story["title"].strip():
        errors.append(f"{sid}: empty title")
    if status not in STATUSES:
        errors.append(f"{sid}: status {status!r} not in {sorted(STATUSES)}")
    if cls not in EVIDENCE_CLASSES:
        errors.append(f"{sid}: evidence class {cls!r} not in {sorted(EVIDENCE_CLASSES)}")
        return errors
    if status == "done" and not evidence:
        errors.append(f"{sid}: done without evidence")
    if len(set(map(str, evidence))) != len(evidence):
        errors.append(f"{sid}: duplicated evidence paths")
    for path in evidence:
        errors += _check_evidence_path(sid, cls, status, path, root)

    verdict = story["verdict"]
    if sid in GATE_VERDICTS:
        if story.get("verdicts") != GATE_VERDICTS[sid]:
            errors.append(f"{sid}: verdicts must be exactly {GATE_VERDICTS[sid]}")
        if verdict is not None and verdict not in GATE_VERDICTS[sid]:
            errors.append(f"{sid}: verdict {verdict!r} not in {GATE_VERDICTS[sid]}")
        if (verdict is not None) != (status == "done"):
            errors.append(f"{sid}: a gate has a verdict exactly when it is done")
        if CLASS_RANK[cls] < CLASS_RANK[GATE_MIN_CLASS[sid]]:
            errors.append(f"{sid}: needs at least {GATE_MIN_CLASS[sid]} evidence, not {cls}")
    else:
        if "verdicts" in story:
            errors.append(f"{sid}: only gate stories have verdicts")
        if verdict is not None:
            errors.append(f"{sid}: only gate stories have a verdict")
    return errors


def validate(prd: Any, root: Path = REPO_ROOT) -> list[str]:
    """Every rule violation in a parsed prd.json (empty list: valid)."""
    if not isinstance(prd, dict):
        return ["prd.json is not an object"]
    errors = []
    for key, typ in TOP_KEYS.items():
        if not isinstance(prd.get(key), typ):
            errors.append(f"top-level {key!r} missing or of the wrong type")
    for key in prd.keys() - TOP_KEYS.keys():
        errors.append(f"unknown top-level key {key!r}")
    if errors:
        return errors

    stories = prd["stories"]
    lock = load_lock(LOCK_PATH)
    schema_broken = False
    for story in stories:
        story_errors = _check_story(story, root)
        errors += story_errors
        schema_ok = isinstance(story, dict) and not any(
            "key" in e or "wrong type" in e or "not an object" in e for e in story_errors
        )
        schema_broken |= not schema_ok
        if schema_ok and story["evidence_class_required"] in EVIDENCE_CLASSES:
            errors += _check_records(story, root, lock)
    if schema_broken:
        return errors

    by_id: dict[str, dict[str, Any]] = {}
    for story in stories:
        if story["id"] in by_id:
            errors.append(f"{story['id']}: duplicated id")
        by_id[story["id"]] = story
    missing = (SEED_STORIES | PROJECT_STORIES) - by_id.keys()
    if missing:
        errors.append(f"missing stories: {sorted(missing)}")
    for sid, story in by_id.items():
        for dep in story.get("depends_on", []):
            if dep not in by_id:
                errors.append(f"{sid}: depends on unknown story {dep!r}")
            elif story["status"] == "done" and by_id[dep]["status"] != "done":
                errors.append(f"{sid}: done before its dependency {dep} is done")
    if "DGR-027" in by_id and PINNED_LLAMA_CPP not in by_id["DGR-027"]["notes"]:
        errors.append(f"DGR-027: notes must name the pinned commit {PINNED_LLAMA_CPP}")
    return errors


# --- the repository's prd.json -----------------------------------------------------------------


@pytest.fixture()
def prd() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(PRD_PATH.read_text())
    return data


def story(prd: dict[str, Any], sid: str) -> dict[str, Any]:
    found: dict[str, Any] = next(s for s in prd["stories"] if s["id"] == sid)
    return found


def test_repo_prd_is_valid(prd: dict[str, Any]) -> None:
    assert validate(prd) == []


def test_repo_prd_gate_stories(prd: dict[str, Any]) -> None:
    for sid, verdicts in GATE_VERDICTS.items():
        assert story(prd, sid)["verdicts"] == verdicts
    assert story(prd, "DGR-020")["evidence_class_required"] in {"real-model", "real-hardware"}
    assert story(prd, "DGR-070")["evidence_class_required"] in {"real-hardware", "release"}


def test_repo_prd_claims_no_runtime_completion(prd: dict[str, Any]) -> None:
    # The seed: no runtime implementation story has completion credit yet. DGR-017 is complete
    # upstream, but nothing in this repo evidences it.
    assert story(prd, "DGR-017")["status"] != "done"
    for sid in SEED_STORIES - {"DGR-017"}:
        assert story(prd, sid)["status"] != "done", sid


# --- each rule fires on a broken copy ----------------------------------------------------------


def broken(prd: dict[str, Any], sid: str, **changes: Any) -> dict[str, Any]:
    bad = copy.deepcopy(prd)
    story(bad, sid).update(changes)
    return bad


def assert_rejected(prd: dict[str, Any], fragment: str, root: Path = REPO_ROOT) -> None:
    errors = validate(prd, root)
    assert any(fragment in e for e in errors), errors


def test_rejects_done_without_evidence(prd: dict[str, Any]) -> None:
    assert_rejected(broken(prd, "DGR-P003", status="done", evidence=[]), "done without evidence")


def test_rejects_missing_evidence_path(prd: dict[str, Any]) -> None:
    bad = broken(prd, "DGR-P002", status="done", evidence=["tests/no_such_file.py"])
    assert_rejected(bad, "does not exist")


def test_rejects_escaping_evidence_path(prd: dict[str, Any]) -> None:
    assert_rejected(broken(prd, "DGR-P002", evidence=["../etc/passwd"]), "relative")
    assert_rejected(broken(prd, "DGR-P002", evidence=["/etc/passwd"]), "relative")


def test_rejects_unknown_status_and_class(prd: dict[str, Any]) -> None:
    assert_rejected(broken(prd, "DGR-P001", status="finished"), "status")
    assert_rejected(broken(prd, "DGR-P001", evidence_class_required="unit"), "evidence class")


def test_rejects_duplicate_ids(prd: dict[str, Any]) -> None:
    bad = copy.deepcopy(prd)
    bad["stories"].append(copy.deepcopy(story(bad, "DGR-P001")))
    assert_rejected(bad, "duplicated id")


def test_rejects_missing_seed_story(prd: dict[str, Any]) -> None:
    bad = copy.deepcopy(prd)
    bad["stories"] = [s for s in bad["stories"] if s["id"] != "DGR-019"]
    assert_rejected(bad, "missing stories")


def test_rejects_schema_problems(prd: dict[str, Any]) -> None:
    bad = copy.deepcopy(prd)
    del story(bad, "DGR-P004")["notes"]
    assert_rejected(bad, "missing key 'notes'")
    assert_rejected(broken(prd, "DGR-P004", evidence="tests/"), "'evidence' has the wrong type")
    assert_rejected(broken(prd, "DGR-P004", owner="me"), "unknown key 'owner'")
    assert_rejected(broken(prd, "DGR-P004", id="P4"), "id does not match")
    assert validate([]) == ["prd.json is not an object"]


def test_rejects_wrong_gate_vocabulary(prd: dict[str, Any]) -> None:
    assert_rejected(broken(prd, "DGR-020", verdicts=["go", "stop"]), "verdicts must be exactly")
    assert_rejected(broken(prd, "DGR-054", verdict="ship it"), "not in")
    assert_rejected(broken(prd, "DGR-P002", verdicts=["go"]), "only gate stories")
    assert_rejected(broken(prd, "DGR-P002", verdict="go"), "only gate stories")


def test_rejects_verdict_without_done_and_done_without_verdict(prd: dict[str, Any]) -> None:
    assert_rejected(broken(prd, "DGR-020", verdict="go"), "exactly when it is done")


def test_rejects_gate_with_fixture_class(prd: dict[str, Any]) -> None:
    assert_rejected(broken(prd, "DGR-054", evidence_class_required="fixture"), "at least")


def test_fixture_evidence_never_stands_in_for_real_model(prd: dict[str, Any]) -> None:
    # tests/models/test_fixtures.py exists, but it is fixture evidence: a real-model story
    # can't use it.
    bad = broken(prd, "DGR-019", status="done", evidence=["tests/models/test_fixtures.py"])
    assert_rejected(bad, "must live under evidence/<real-model or above>/")


def test_evidence_of_the_right_class_is_accepted(prd: dict[str, Any], tmp_path: Path) -> None:
    # Same story, evidence in the class folder of a scratch root: accepted. In another class's
    # folder: rejected.
    root = tmp_path
    (root / "evidence" / "real-model").mkdir(parents=True)
    (root / "evidence" / "real-model" / "lock.json").write_text("{}")
    (root / "evidence" / "fixture").mkdir()
    (root / "evidence" / "fixture" / "lock.json").write_text("{}")
    for s in prd["stories"]:  # keep the rest of the file valid under the scratch root
        s["evidence"], s["records"] = [], []
        if s["status"] == "done" and not s.get("verdicts"):
            s["status"] = "in-progress"
    good = broken(prd, "DGR-019", status="done", evidence=["evidence/real-model/lock.json"])
    # the path is accepted; being done still needs a real-model record, which no one has
    assert validate(good, root) == ["DGR-019: done without a record"]
    bad = broken(prd, "DGR-019", status="done", evidence=["evidence/fixture/lock.json"])
    assert_rejected(bad, "must live under evidence/<real-model or above>/", root)
    (root / "evidence" / "real-hardware").mkdir()
    (root / "evidence" / "real-hardware" / "lock.json").write_text("{}")
    higher = broken(prd, "DGR-019", status="done", evidence=["evidence/real-hardware/lock.json"])
    assert validate(higher, root) == ["DGR-019: done without a record"]  # a higher class: fine
    lower = broken(prd, "DGR-054", status="done", evidence=["evidence/real-model/lock.json"])
    assert any("must live under" in e for e in validate(lower, root))


def test_rejects_done_before_dependency(prd: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "evidence" / "real-model").mkdir(parents=True)
    (tmp_path / "evidence" / "real-model" / "r.json").write_text("{}")
    for s in prd["stories"]:
        s["evidence"], s["records"] = [], []
        if s["status"] == "done" and not s.get("verdicts"):
            s["status"] = "in-progress"
    bad = broken(
        prd, "DGR-020", status="done", verdict="go", evidence=["evidence/real-model/r.json"]
    )
    assert_rejected(bad, "done before its dependency DGR-019", tmp_path)
    assert_rejected(broken(prd, "DGR-070", depends_on=["DGR-999"]), "unknown story")


def test_rejects_lost_llama_cpp_pin(prd: dict[str, Any]) -> None:
    assert_rejected(broken(prd, "DGR-027", notes="pinned somewhere"), "pinned commit")


# --- the records behind each story --------------------------------------------------------------


def records_of(prd: dict[str, Any], sid: str) -> list[str]:
    found: list[str] = story(prd, sid)["records"]
    return found


def test_done_stories_name_admitted_records(prd: dict[str, Any]) -> None:
    lock = load_lock(LOCK_PATH)
    for s in prd["stories"]:
        if s["status"] == "done":
            assert s["records"], s["id"]
            for path in s["records"]:
                record = load_record(REPO_ROOT / path, lock)
                assert record.evidence_class.satisfies(EvidenceClass(s["evidence_class_required"]))
    families = {load_record(REPO_ROOT / p, lock).family for p in records_of(prd, "DGR-P005")}
    assert families == {"v4"}  # the V4 story is backed by a V4 record


def test_rejects_done_without_a_record(prd: dict[str, Any]) -> None:
    assert_rejected(broken(prd, "DGR-P002", records=[]), "DGR-P002: done without a record")


def test_rejects_a_real_model_claim_backed_by_fixture_evidence(prd: dict[str, Any]) -> None:
    fixture = records_of(prd, "DGR-P002")
    bad = broken(prd, "DGR-P002", evidence_class_required="real-model", records=fixture)
    assert_rejected(bad, "is fixture evidence; it cannot back a real-model claim")
    gate = broken(prd, "DGR-054", status="done", verdict="alpha", records=fixture)
    assert_rejected(gate, "is fixture evidence; it cannot back a real-hardware claim")


def test_rejects_records_that_do_not_load(prd: dict[str, Any], tmp_path: Path) -> None:
    assert_rejected(
        broken(prd, "DGR-P002", records=["tests/project/test_prd.py"]),
        "must be a path under evidence/",
    )
    assert_rejected(broken(prd, "DGR-P002", records=["evidence/fixture/x/y.json"]), "refused")
    source = REPO_ROOT / records_of(prd, "DGR-P002")[0]
    target = tmp_path / source.relative_to(REPO_ROOT)
    target.parent.mkdir(parents=True)
    target.write_text(source.read_text().replace('"pass"', '"fail"', 1))  # edited after the fact
    for s in prd["stories"]:  # only DGR-P002 keeps a record, in the scratch root
        s["evidence"], s["records"] = [], []
        if s["status"] == "done":
            s["status"] = "in-progress"
    bad = broken(prd, "DGR-P002", records=[str(target.relative_to(tmp_path))])
    assert_rejected(bad, "record_id: is not the hash of the record's content", tmp_path)


def test_a_gate_story_claims_no_more_than_its_records_give(prd: dict[str, Any]) -> None:
    lock = load_lock(LOCK_PATH)
    fixture = records_of(prd, "DGR-P003")  # the dense and the V4 fixture records
    claim = {
        "id": "DGR-054",
        "evidence_class_required": "fixture",
        "status": "done",
        "verdict": "alpha",
        "records": fixture,
    }
    errors = _check_records(claim, REPO_ROOT, lock)
    assert len(errors) == 1 and "claims 'alpha'; its records give DGR-054: " in errors[0], errors
    assert "at fixture class" in errors[0] and "claims more than its records show" in errors[0]
    honest = evaluate("DGR-054", [load_record(REPO_ROOT / p, lock) for p in fixture], lock)
    assert honest.verdict == "stop"  # at the story's own class, real-hardware: no records
