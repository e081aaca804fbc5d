"""Evidence records: one typed, schema-checked file per certification (or baseline) run.

A record states its lane, the lock it was made under, the facts its evidence class derives
from, the exact command, dgr's git commit, the machine, its start and end, every figure with
its unit, and the verdict of each locked requirement. Its id is the SHA-256 of its canonical
content, so an edited record no longer matches its id; and since anybody can recompute an id,
a certifier signs it (:mod:`~dgr_engine.certification.signing`): the loader admits a record
only when its signature verifies under a key the lock trusts for the record's class. Records
live at ``evidence/<class>/<lane-id>/<record-id>.json``; the loader refuses a file whose place,
id, class, lane id or signature disagrees with its content, and never half-loads one.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine.certification import release, signing
from dgr_engine.certification.classify import EvidenceFacts, derive_facts
from dgr_engine.certification.errors import EvidenceError, EvidenceInvalid
from dgr_engine.certification.lane import LaneKey, canonical_sha256
from dgr_engine.certification.lock import Lock, format_time, parse_time
from dgr_session.identity import EvidenceClass

RECORD_SCHEMA = "dgr.evidence/1"
EVIDENCE_DIR_ENV = "DGR_EVIDENCE_DIR"
_CHECKOUT = Path(__file__).resolve().parents[2]


def default_evidence_dir() -> Path:
    """``$DGR_EVIDENCE_DIR``; else ``evidence/`` of the source checkout dgr runs from; else,
    for an installed dgr, ``$XDG_CACHE_HOME/dgr/evidence`` (default ``~/.cache/dgr``)."""
    env = os.environ.get(EVIDENCE_DIR_ENV)
    if env:
        return Path(env)
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "dgr_engine").is_dir():
        return _CHECKOUT / "evidence"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "dgr" / "evidence"


class RecordKind(enum.StrEnum):
    """What a record is evidence of."""

    CERTIFICATION = "certification"
    """``dgr certify``: a lane's parity, execution, isolation, failure, resources, speed."""
    BASELINE = "baseline"
    """DGR-020: safetensors against whole-model llama.cpp, no sharding."""
    MTP = "mtp"
    """DGR-070: the MTP ownership contract, implementation and benchmark."""


class Verdict(enum.StrEnum):
    """The verdict of one locked requirement."""

    PASS = "pass"
    FAIL = "fail"
    NOT_MEASURED = "not-measured"


@attrs.frozen
class Figure:
    """One measured figure."""

    name: str
    value: float
    unit: str
    scenario: str = ""


@attrs.frozen
class Requirement:
    """The verdict of one locked requirement, with what it rests on."""

    id: str
    verdict: Verdict
    detail: str


def _tuple(values: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(values)


def _to_second(value: dt.datetime) -> dt.datetime:
    """UTC, whole seconds: what the file keeps, so a loaded record equals the one written."""
    return value.astimezone(dt.UTC).replace(microsecond=0)


@attrs.frozen
class EvidenceRecord:
    """One record. Its evidence class is a property of its facts: there is no way to state
    one."""

    kind: RecordKind
    lane: LaneKey
    lock_sha256: str
    facts: EvidenceFacts
    family: str
    """``"dense"`` or ``"v4"``."""
    command: tuple[str, ...] = attrs.field(converter=_tuple)
    dgr_commit: str
    """dgr's git commit (``+dirty`` when the tree had changes; ``unknown`` outside git)."""
    machine: Mapping[str, str] = attrs.field(converter=lambda m: dict(sorted(m.items())))
    started_at: dt.datetime = attrs.field(converter=_to_second)
    ended_at: dt.datetime = attrs.field(converter=_to_second)
    figures: tuple[Figure, ...] = attrs.field(converter=_tuple)
    requirements: tuple[Requirement, ...] = attrs.field(converter=_tuple)
    mtp: str = "off"
    signature: signing.RecordSignature | None = attrs.field(default=None, eq=False)
    """The certifier's signature of :attr:`record_id` (not part of the content; ``None``:
    unsigned, which no loader admits). An edited record keeps the old signature, which no
    longer verifies."""

    @property
    def evidence_class(self) -> EvidenceClass:
        return self.facts.evidence_class

    @property
    def lane_id(self) -> str:
        return self.lane.lane_id

    def body(self) -> dict[str, Any]:
        """The canonical content (what the id is the hash of)."""
        return {
            "schema": RECORD_SCHEMA,
            "kind": self.kind.value,
            "lane": self.lane.canonical(),
            "lock_sha256": self.lock_sha256,
            "facts": attrs.asdict(self.facts),
            "family": self.family,
            "command": list(self.command),
            "dgr_commit": self.dgr_commit,
            "machine": dict(self.machine),
            "started_at": format_time(self.started_at),
            "ended_at": format_time(self.ended_at),
            "figures": [attrs.asdict(f) for f in self.figures],
            "requirements": [
                {"id": r.id, "verdict": r.verdict.value, "detail": r.detail}
                for r in self.requirements
            ],
            "mtp": self.mtp,
        }

    @property
    def record_id(self) -> str:
        return canonical_sha256(self.body())

    def requirement(self, rid: str) -> Requirement | None:
        return next((r for r in self.requirements if r.id == rid), None)

    def figure(self, name: str) -> Figure | None:
        return next((f for f in self.figures if f.name == name), None)


def signed(record: EvidenceRecord, key: Ed25519PrivateKey) -> EvidenceRecord:
    """``record`` signed by ``key`` (any earlier signature replaced)."""
    return attrs.evolve(record, signature=signing.sign(record.record_id, key))


def record_json(record: EvidenceRecord) -> str:
    """The file's text: the body plus the derived id, class and lane id (checked on load) and
    the signature."""
    data = record.body()
    data["record_id"] = record.record_id
    data["evidence_class"] = record.evidence_class.value
    data["lane_id"] = record.lane_id
    sig = record.signature
    data["signature"] = None if sig is None else {"key_id": sig.key_id, "value": sig.value}
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def record_path(evidence_dir: Path, record: EvidenceRecord) -> Path:
    """``evidence_dir/<class>/<lane-id>/<record-id>.json``."""
    return evidence_dir / record.evidence_class.value / record.lane_id / f"{record.record_id}.json"


def write_record(
    record: EvidenceRecord,
    evidence_dir: str | os.PathLike[str],
    *,
    key: Ed25519PrivateKey | None = None,
) -> Path:
    """Write ``record`` under ``evidence_dir`` atomically (a reader never sees half a file),
    signed by ``key`` when given; otherwise with the signature it carries (none, or one that
    no longer verifies if the record was edited after signing: the loader refuses both)."""
    if key is not None:
        record = signed(record, key)
    target = record_path(Path(evidence_dir), record)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".record.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(record_json(record))
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


class _Fields:
    def __init__(self, path: Path) -> None:
        self.path = path

    def bad(self, field: str, why: str) -> EvidenceInvalid:
        return EvidenceInvalid(f"{field}: {why}", path=self.path, field=field)

    def get(self, data: Mapping[str, Any], field: str, kind: type | tuple[type, ...]) -> Any:
        if field not in data:
            raise self.bad(field, "missing")
        value = data[field]
        if isinstance(value, bool) and kind is not bool:
            raise self.bad(field, f"wrong type {type(value).__name__}")
        if not isinstance(value, kind):
            raise self.bad(field, f"wrong type {type(value).__name__}")
        return value


_TOP_FIELDS = {
    "schema",
    "kind",
    "lane",
    "lock_sha256",
    "facts",
    "family",
    "command",
    "dgr_commit",
    "machine",
    "started_at",
    "ended_at",
    "figures",
    "requirements",
    "mtp",
    "record_id",
    "evidence_class",
    "lane_id",
    "signature",
}


def _facts(f: _Fields, data: Mapping[str, Any]) -> EvidenceFacts:
    raw = f.get(data, "facts", dict)
    for name in raw.keys() - {"fixture_mark", "real_model", "hardware_lane", "release_build"}:
        raise f.bad(f"facts.{name}", "unknown field")
    optional = (str, type(None))
    return EvidenceFacts(
        fixture_mark=f.get(raw, "fixture_mark", optional),
        real_model=f.get(raw, "real_model", optional),
        hardware_lane=f.get(raw, "hardware_lane", optional),
        release_build=f.get(raw, "release_build", bool),
    )


def _signature(f: _Fields, data: Mapping[str, Any]) -> signing.RecordSignature | None:
    raw = data.get("signature")
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"key_id", "value"}:
        raise f.bad("signature", "needs exactly key_id and value (or null)")
    if not all(isinstance(raw[k], str) for k in ("key_id", "value")):
        raise f.bad("signature", "key_id and value must be strings")
    return signing.RecordSignature(key_id=raw["key_id"], value=raw["value"])


def _figures(f: _Fields, data: Mapping[str, Any]) -> list[Figure]:
    out = []
    for i, item in enumerate(f.get(data, "figures", list)):
        if not isinstance(item, dict) or set(item) != {"name", "value", "unit", "scenario"}:
            raise f.bad(f"figures[{i}]", "needs exactly name, value, unit, scenario")
        value = item["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise f.bad(f"figures[{i}].value", f"not a number: {value!r}")
        if not all(isinstance(item[k], str) for k in ("name", "unit", "scenario")):
            raise f.bad(f"figures[{i}]", "name, unit and scenario must be strings")
        out.append(Figure(item["name"], float(value), item["unit"], item["scenario"]))
    return out


def _requirements(f: _Fields, data: Mapping[str, Any]) -> list[Requirement]:
    out = []
    known = {v.value for v in Verdict}
    for i, item in enumerate(f.get(data, "requirements", list)):
        if not isinstance(item, dict) or set(item) != {"id", "verdict", "detail"}:
            raise f.bad(f"requirements[{i}]", "needs exactly id, verdict, detail")
        if item["verdict"] not in known:
            raise f.bad(f"requirements[{i}].verdict", f"unknown verdict {item['verdict']!r}")
        if not isinstance(item["id"], str) or not isinstance(item["detail"], str):
            raise f.bad(f"requirements[{i}]", "id and detail must be strings")
        out.append(Requirement(item["id"], Verdict(item["verdict"]), item["detail"]))
    return out


def parse_record(text: str, *, path: Path) -> EvidenceRecord:
    """The record in ``text``; :class:`EvidenceInvalid` naming ``path`` and the field."""
    f = _Fields(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EvidenceInvalid(
            f"not JSON ({exc.msg} at line {exc.lineno}): truncated or corrupt", path=path
        ) from None
    if not isinstance(data, dict):
        raise EvidenceInvalid("not a JSON object", path=path)
    schema = f.get(data, "schema", str)
    if schema != RECORD_SCHEMA:
        raise f.bad("schema", f"unknown record schema {schema!r} (this dgr reads {RECORD_SCHEMA})")
    for name in sorted(data.keys() - _TOP_FIELDS):
        raise f.bad(name, "unknown field")
    kind_text = f.get(data, "kind", str)
    if kind_text not in {k.value for k in RecordKind}:
        raise f.bad("kind", f"unknown record kind {kind_text!r}")
    command = f.get(data, "command", list)
    machine = f.get(data, "machine", dict)
    if not all(isinstance(a, str) for a in command):
        raise f.bad("command", "must be a list of strings")
    if not all(isinstance(v, str) for v in machine.values()):
        raise f.bad("machine", "values must be strings")
    try:
        lane = LaneKey.from_canonical(f.get(data, "lane", dict))
    except EvidenceInvalid as exc:
        raise EvidenceInvalid(str(exc), path=path, field=exc.field) from None
    record = EvidenceRecord(
        kind=RecordKind(kind_text),
        lane=lane,
        lock_sha256=f.get(data, "lock_sha256", str),
        facts=_facts(f, data),
        family=f.get(data, "family", str),
        command=command,
        dgr_commit=f.get(data, "dgr_commit", str),
        machine=machine,
        started_at=parse_time(data.get("started_at"), field="started_at", path=path),
        ended_at=parse_time(data.get("ended_at"), field="ended_at", path=path),
        figures=_figures(f, data),
        requirements=_requirements(f, data),
        mtp=f.get(data, "mtp", str),
        signature=_signature(f, data),
    )
    if record.ended_at < record.started_at:
        raise f.bad("ended_at", "before started_at")
    if f.get(data, "record_id", str) != record.record_id:
        raise f.bad(
            "record_id", "is not the hash of the record's content: edited after it was made"
        )
    if f.get(data, "lane_id", str) != record.lane_id:
        raise f.bad("lane_id", "is not the hash of the record's lane")
    try:
        derived = record.evidence_class.value
    except EvidenceError as exc:
        raise f.bad("facts", str(exc)) from None
    claimed = f.get(data, "evidence_class", str)
    if claimed != derived:
        raise f.bad("evidence_class", f"claims {claimed!r}, its facts derive {derived!r}")
    return record


def admit_record(
    record: EvidenceRecord,
    lock: Lock,
    *,
    path: Path | None,
    checkout: Path | None = release.CHECKOUT,
) -> EvidenceRecord:
    """Admit a parsed record under ``lock``: the lock it was made under, the lock's facts
    re-derived (not trusted), a release claim re-checked against ``checkout``'s tags
    (:func:`~dgr_engine.certification.release.check_release_claim`), and its signature by a
    key the lock trusts for its class. What the loader and a client checking a worker's
    advert (:mod:`~dgr_engine.certification.verify`) both run; any refusal is an
    :class:`EvidenceError`."""
    _admit_facts(record, lock, path=path)
    _admit_signature(record, lock, path=path, checkout=checkout)
    return record


def _admit_facts(record: EvidenceRecord, lock: Lock, *, path: Path | None) -> None:
    file = path
    lock.admit(record.lock_sha256, record.started_at, path=file)
    derived = derive_facts(
        record.lane,
        fixture_mark=record.facts.fixture_mark,
        lock=lock,
        release_build=record.facts.release_build,
    )
    if (derived.real_model, derived.hardware_lane) != (
        record.facts.real_model,
        record.facts.hardware_lane,
    ):
        raise EvidenceInvalid(
            f"facts: claim real model {record.facts.real_model!r} / hardware lane "
            f"{record.facts.hardware_lane!r}; the lock gives {derived.real_model!r} / "
            f"{derived.hardware_lane!r}",
            path=file,
            field="facts",
        )


def _admit_signature(
    record: EvidenceRecord, lock: Lock, *, path: Path | None, checkout: Path | None
) -> None:
    if record.facts.release_build:
        release.check_release_claim(
            record.dgr_commit, record.lane.dgr_version, path=path, checkout=checkout
        )
    lock.check_signature(record.record_id, record.signature, record.evidence_class, path=path)


def load_record(
    path: str | os.PathLike[str], lock: Lock, *, checkout: Path | None = release.CHECKOUT
) -> EvidenceRecord:
    """Read, check and admit one record file under ``lock``: schema, fields, id, class derived
    from its facts, place in the evidence tree, then :func:`admit_record` (lock, facts,
    release claim, signature). Any refusal is an :class:`EvidenceError` naming the file."""
    file = Path(path)
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise EvidenceInvalid(f"cannot read: {exc}", path=file) from None
    record = parse_record(text, path=file)
    _admit_facts(record, lock, path=file)
    if (
        file.name != f"{record.record_id}.json"
        or file.parent.name != record.lane_id
        or (file.parent.parent.name != record.evidence_class.value)
    ):
        raise EvidenceInvalid(
            f"path: a {record.evidence_class.value} record of lane {record.lane_id[:12]} belongs "
            f"at {record.evidence_class.value}/{record.lane_id}/{record.record_id}.json",
            path=file,
            field="path",
        )
    _admit_signature(record, lock, path=file, checkout=checkout)
    return record


@attrs.frozen
class Loaded:
    """What an evidence directory holds under a lock."""

    records: tuple[EvidenceRecord, ...]
    paths: tuple[Path, ...]
    refused: tuple[EvidenceError, ...]


def load_evidence(evidence_dir: str | os.PathLike[str], lock: Lock) -> Loaded:
    """Every ``*.json`` under ``evidence_dir`` (sorted), loaded or refused (never half)."""
    root = Path(evidence_dir)
    records, paths, refused = [], [], []
    files = sorted(root.glob("*/*/*.json")) if root.is_dir() else []
    for file in files:
        try:
            records.append(load_record(file, lock))
            paths.append(file)
        except EvidenceError as exc:
            refused.append(exc)
    return Loaded(tuple(records), tuple(paths), tuple(refused))
