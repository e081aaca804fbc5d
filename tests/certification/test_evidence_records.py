"""Evidence records: classes derived from facts, strict loading, the worker's lookup.

Every bad file is refused with an error naming the file and the field, and a directory with a
bad file still yields its good records (nothing is half-loaded).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from dgr_engine.certification.classify import derive_facts, is_release_version
from dgr_engine.certification.errors import (
    EvidenceError,
    EvidenceInvalid,
    LockMismatch,
    UnclassifiableModel,
)
from dgr_engine.certification.lane import canonical_sha256
from dgr_engine.certification.record import load_evidence, load_record, record_json
from dgr_engine.certification.registry import find_certification, lane_differences
from dgr_session.identity import EvidenceClass, LaneDifference
from tests.harness import EvidenceKit

MODEL = "cd" * 32


def real_model_lock(kit: EvidenceKit, *, hardware: bool = False) -> Any:
    lane = kit.lane()

    def edit(data: dict[str, Any]) -> None:
        data["real_models"][0]["content_sha256"] = [MODEL]
        if hardware:
            data["hardware_lanes"] = [
                {
                    "name": "epyc-cpu",
                    "hardware": lane.hardware,
                    "llama_cpp_commit": lane.llama_cpp_commit,
                    "patch_stack_sha256": lane.patch_stack_sha256,
                    "backend": lane.backend,
                }
            ]

    return kit.edit_lock(edit)


def test_a_record_round_trips_and_lives_where_its_class_and_lane_say(kit: EvidenceKit) -> None:
    record = kit.record()
    path = kit.write(record)
    assert path.relative_to(kit.root / "evidence").parts == (
        "fixture",
        record.lane_id,
        f"{record.record_id}.json",
    )
    assert load_record(path, kit.lock) == record
    assert record.record_id == canonical_sha256(record.body())


# --- the class comes from facts ----------------------------------------------------------------


def test_the_fixture_mark_makes_fixture_evidence_whatever_the_lock_says(kit: EvidenceKit) -> None:
    lock = real_model_lock(kit, hardware=True)
    facts = derive_facts(kit.lane(), fixture_mark="dgr-fixtures/2 x", lock=lock, release_build=True)
    assert facts.evidence_class is EvidenceClass.FIXTURE


def test_an_unmarked_model_the_lock_does_not_name_has_no_class(kit: EvidenceKit) -> None:
    facts = derive_facts(kit.lane(), fixture_mark=None, lock=kit.lock, release_build=True)
    with pytest.raises(UnclassifiableModel, match="no evidence class can be derived"):
        _ = facts.evidence_class


def test_real_model_real_hardware_and_release_come_from_the_lock(kit: EvidenceKit) -> None:
    lane = kit.lane()
    lock = real_model_lock(kit)
    facts = derive_facts(lane, fixture_mark=None, lock=lock, release_build=True)
    assert (facts.real_model, facts.evidence_class) == ("deepseek-v4", EvidenceClass.REAL_MODEL)
    lock = real_model_lock(kit, hardware=True)
    facts = derive_facts(lane, fixture_mark=None, lock=lock, release_build=False)
    assert facts.evidence_class is EvidenceClass.REAL_HARDWARE
    assert (
        derive_facts(lane, fixture_mark=None, lock=lock, release_build=True).evidence_class
        is EvidenceClass.RELEASE
    )  # 0.1.0 from a release build (its tag, nothing but its commit in the tree)
    other_cpu = attrs.evolve(lane, hardware="x86_64 | Other | avx")
    assert (
        derive_facts(other_cpu, fixture_mark=None, lock=lock, release_build=True).evidence_class
        is EvidenceClass.REAL_MODEL
    )  # not the hardware the lock names
    dev = attrs.evolve(lane, dgr_version="0.1.0+source")
    assert (
        derive_facts(dev, fixture_mark=None, lock=lock, release_build=True).evidence_class
        is EvidenceClass.REAL_HARDWARE
    )


def test_a_record_says_why_it_is_real_model_and_not_real_hardware(kit: EvidenceKit) -> None:
    from dgr_engine.certify.runner import evidence_class_reason

    lock = real_model_lock(kit, hardware=True)
    other_cpu = attrs.evolve(kit.lane(), hardware="x86_64 | Other | avx")
    facts = derive_facts(other_cpu, fixture_mark=None, lock=lock, release_build=False)
    reason = evidence_class_reason(facts, other_cpu)
    assert reason.startswith("real-model: the lock's real model deepseek-v4, but no hardware")
    assert "x86_64 | Other | avx" in reason and "dgr lock declare-hardware" in reason
    here = derive_facts(kit.lane(), fixture_mark=None, lock=lock, release_build=False)
    assert evidence_class_reason(here, kit.lane()).startswith("real-hardware: ")
    marked = derive_facts(kit.lane(), fixture_mark="m", lock=lock, release_build=False)
    assert evidence_class_reason(marked, kit.lane()).startswith("fixture: a generated fixture")


@pytest.mark.parametrize(
    ("version", "release"),
    [("0.1.0", True), ("2.3", True), ("0.1.0+source", False), ("0.2.0.dev1", False)]
    + [("1.0rc1", False), ("garbage", False)],
)
def test_release_versions(version: str, release: bool) -> None:
    assert is_release_version(version) is release


def test_a_fixture_record_can_never_pass_as_real_model(kit: EvidenceKit) -> None:
    # rewrite a fixture record's claimed class and recompute its id: the facts still say fixture
    record = kit.record()
    data = json.loads(record_json(record))
    data["evidence_class"] = "real-model"
    path = kit.root / "evidence" / "real-model" / record.lane_id / f"{record.record_id}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    with pytest.raises(EvidenceInvalid) as refused:
        load_record(path, kit.lock)
    assert refused.value.field == "evidence_class" and "its facts derive 'fixture'" in str(
        refused.value
    )
    assert not record.evidence_class.satisfies(EvidenceClass.REAL_MODEL)


# --- bad files ---------------------------------------------------------------------------------


def _edit(key: str, value: Any) -> Any:
    def edit(d: dict[str, Any]) -> None:
        d[key] = value

    return edit


def _rehash(d: dict[str, Any]) -> None:
    derived = ("record_id", "evidence_class", "lane_id", "signature")
    body = {k: v for k, v in d.items() if k not in derived}
    d["record_id"] = canonical_sha256(body)


def _then_rehash(**changes: Any) -> Any:
    def edit(d: dict[str, Any]) -> None:
        for key, value in changes.items():
            if key == "lane":
                d["lane"].update(value)
            else:
                d[key] = value
        _rehash(d)

    return edit


def _claims_a_real_model(d: dict[str, Any]) -> None:
    d["facts"]["fixture_mark"] = None
    d["facts"]["real_model"] = "deepseek-v4"
    d["evidence_class"] = "real-model"
    _rehash(d)


BAD: list[tuple[str, Any, str]] = [
    ("a list", lambda d: d.clear(), ""),
    ("unknown schema", _edit("schema", "dgr.evidence/9"), "schema"),
    ("unknown field", _edit("colour", "blue"), "colour"),
    ("missing field", lambda d: d.pop("command"), "command"),
    ("unknown kind", _edit("kind", "vibes"), "kind"),
    ("string figure", lambda d: d["figures"][0].update(value="fast"), "figures[0].value"),
    (
        "unknown verdict",
        lambda d: d["requirements"][0].update(verdict="meh"),
        "requirements[0].verdict",
    ),
    ("edited figure", lambda d: d["figures"][0].update(value=0.99), "record_id"),
    ("edited lane", _then_rehash(lane={"kv_type": "q8_0"}), "lane_id"),
    ("time without zone", _edit("started_at", "2026-12-01T15:00:00"), "started_at"),
    (
        "ends before it starts",
        _then_rehash(ended_at="2000-01-01T00:00:00Z"),
        "ended_at",
    ),
    ("facts the lock denies", _claims_a_real_model, "facts"),
]


@pytest.mark.parametrize(("what", "edit", "field"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_record_is_refused_and_the_good_ones_still_load(
    kit: EvidenceKit, what: str, edit: Any, field: str
) -> None:
    good = kit.write(kit.record())
    bad_record = kit.record(family="v4")
    bad = kit.write(bad_record)
    data = json.loads(bad.read_text())
    edit(data)
    bad.write_text(json.dumps(data if data else []))
    with pytest.raises(EvidenceInvalid) as refused:
        load_record(bad, kit.lock)
    assert refused.value.field == field, (what, str(refused.value))
    assert str(bad) in str(refused.value)
    loaded = load_evidence(kit.root / "evidence", kit.lock)
    assert loaded.paths == (good,) and len(loaded.refused) == 1


@pytest.mark.parametrize("cut", [0, 1, 100, -2])
def test_a_truncated_record_is_refused(kit: EvidenceKit, cut: int) -> None:
    path = kit.write(kit.record())
    path.write_text(path.read_text()[:cut])
    with pytest.raises(EvidenceInvalid, match="not JSON .*truncated or corrupt"):
        load_record(path, kit.lock)


def test_a_record_in_another_place_is_refused(kit: EvidenceKit) -> None:
    path = kit.write(kit.record())
    moved = kit.root / "evidence" / "real-model" / path.parent.name / path.name
    moved.parent.mkdir(parents=True)
    path.rename(moved)
    with pytest.raises(EvidenceInvalid) as refused:
        load_record(moved, kit.lock)
    assert refused.value.field == "path"


def test_records_of_another_lock_or_from_before_it_are_refused(kit: EvidenceKit) -> None:
    before = kit.write(kit.record(started_at=kit.lock.locked_at - dt.timedelta(minutes=1)))
    with pytest.raises(LockMismatch) as early:
        load_record(before, kit.lock)
    assert early.value.field == "started_at"
    made = kit.write(kit.record())
    load_record(made, kit.lock)
    # the lock is edited after the record was made: the record no longer counts
    edited = kit.edit_lock(lambda d: d["thresholds"]["recovery"].update(max_seconds=60))
    with pytest.raises(LockMismatch) as other:
        load_record(made, edited)
    assert other.value.field == "lock_sha256" and "the lock changed" in str(other.value)


# --- which record certifies a worker -----------------------------------------------------------


def test_only_a_passing_record_of_exactly_the_lane_certifies_it(kit: EvidenceKit) -> None:
    evidence = kit.root / "evidence"
    lane = kit.lane()
    assert find_certification(lane, None, lock=kit.lock).certification is None
    assert find_certification(lane, evidence, lock=kit.lock).certification is None  # empty
    failed = kit.record(failing=("isolation.sessions",))
    kit.write(failed)
    lookup = find_certification(lane, evidence, lock=kit.lock)
    assert lookup.certification is None
    assert any("did not pass isolation.sessions" in r for r in lookup.reasons)
    slow = kit.record(failing=("speed.decode",))  # speed is for the gate, not for routing
    kit.write(slow)
    lookup = find_certification(lane, evidence, lock=kit.lock)
    assert lookup.certification is not None
    assert (lookup.certification.record_id, lookup.certification.evidence_class) == (
        slow.record_id,
        EvidenceClass.FIXTURE,
    )
    for change in (
        {"kv_type": "f32"},
        {"hardware": "x86_64 | Other | avx"},
        {"dgr_version": "0.2.0"},
    ):
        other = attrs.evolve(lane, **change)
        lookup = find_certification(other, evidence, lock=kit.lock)
        assert lookup.certification is None
        assert any(f"differs in {next(iter(change))}" in r for r in lookup.reasons), lookup


def test_a_bad_file_is_a_reason_not_an_exception(kit: EvidenceKit) -> None:
    evidence = kit.root / "evidence"
    good = kit.record()
    kit.write(good)
    junk = evidence / "fixture" / good.lane_id / ("0" * 64 + ".json")
    junk.write_text("{")
    lookup = find_certification(kit.lane(), evidence, lock=kit.lock)
    assert lookup.certification is not None and lookup.certification.record_id == good.record_id
    assert any(str(junk) in r and "not JSON" in r for r in lookup.reasons)


def test_the_highest_class_wins_over_a_later_lower_one(kit: EvidenceKit) -> None:
    lock = real_model_lock(kit, hardware=True)
    lane = kit.lane()
    real = kit.record(
        facts=derive_facts(lane, fixture_mark=None, lock=lock, release_build=False),
        lock_sha256=lock.sha256,
    )
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30)
    fixture = kit.record(
        lock_sha256=lock.sha256, started_at=later, ended_at=later + dt.timedelta(seconds=1)
    )
    for record in (real, fixture):
        kit.write(record)
    cert = find_certification(lane, kit.root / "evidence", lock=lock).certification
    assert cert is not None and cert.evidence_class is EvidenceClass.REAL_HARDWARE
    assert cert.record_id == real.record_id


def test_evidence_errors_name_their_file(kit: EvidenceKit) -> None:
    err = EvidenceInvalid("x: broken", path=Path("/a/b.json"), field="x")
    assert isinstance(err, EvidenceError) and str(err) == "/a/b.json: x: broken"


def test_a_dark_lane_learns_the_nearest_passing_record_and_every_part_that_differs(
    kit: EvidenceKit,
) -> None:
    lane = kit.lane()
    wide = attrs.evolve(lane, context_per_session=2 * lane.context_per_session)
    one_off = kit.record()  # differs from ``wide`` in the context only
    two_off = kit.record(lane=attrs.evolve(lane, kv_type="f32"))  # context and KV type
    failed = kit.record(  # nearer, but failed: it certifies nothing, so it is not named
        lane=attrs.evolve(wide, flash_attn="off"), failing=("isolation.sessions",)
    )
    for record in (one_off, two_off, failed):
        kit.write(record)
    lookup = find_certification(wide, kit.root / "evidence", lock=kit.lock)
    assert lookup.certification is None
    (near,) = lookup.nearest
    assert (near.record_id, near.evidence) == (one_off.record_id, EvidenceClass.FIXTURE)
    assert near.differences == (
        LaneDifference(
            "context_per_session", str(wide.context_per_session), str(lane.context_per_session)
        ),
    )
    assert lane_differences(wide, two_off.lane) == (
        LaneDifference("kv_type", wide.kv_type, "f32"),
        near.differences[0],
    )


def test_a_certified_lane_learns_only_of_records_of_higher_classes(kit: EvidenceKit) -> None:
    lane = kit.lane()
    kit.write(kit.record())
    kit.write(kit.record(lane=attrs.evolve(lane, kv_type="f32")))  # fixture too: not above
    lookup = find_certification(lane, kit.root / "evidence", lock=kit.lock)
    assert lookup.certification is not None and lookup.nearest == ()
