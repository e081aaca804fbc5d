"""Which certification, if any, a worker's exact lane holds.

A worker reads the records of an evidence directory under the lock, keeps the certification
records whose lane id is exactly its own and whose correctness requirements all passed, and
advertises the best of them (highest class, then latest). Anything else leaves it dark, with
the reason logged: no directory, refused files (each named with its field), or records whose
lane differs (the differing parts named). For each class above the one it holds (every class
when dark) it also finds the nearest passing record of another lane, which its advert carries
so that a client refusing the lane can say which parts differ (``Lane.nearest``).
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from dgr_engine.certification.errors import EvidenceError
from dgr_engine.certification.gates import CORRECTNESS
from dgr_engine.certification.lane import LaneKey
from dgr_engine.certification.lock import Lock, load_lock
from dgr_engine.certification.record import (
    EvidenceRecord,
    RecordKind,
    Verdict,
    load_evidence,
    record_json,
)
from dgr_session.identity import EvidenceClass, LaneDifference, NearestRecord


@attrs.frozen
class Certification:
    """What a certified lane advertises."""

    evidence_class: EvidenceClass
    record_id: str
    path: Path
    """The record's file."""
    record_text: str = ""
    """The signed record (its JSON), what the advert carries for clients to check."""


@attrs.frozen
class LaneLookup:
    """The outcome of a lookup: the certification (``None``: dark) and why."""

    certification: Certification | None
    reasons: tuple[str, ...]
    nearest: tuple[NearestRecord, ...] = ()
    """Per evidence class above the certification's (every class when dark), lowest first:
    the passing certification record of another lane that differs in the fewest parts (then
    the newest)."""


def lane_differences(lane: LaneKey, recorded: LaneKey) -> tuple[LaneDifference, ...]:
    """The parts in which ``lane`` differs from ``recorded``, with both values as text."""
    mine, theirs = attrs.asdict(lane), attrs.asdict(recorded)
    return tuple(
        LaneDifference(name, _text(mine[name]), _text(theirs[name]))
        for name in lane.differences(recorded)
    )


def _text(value: object) -> str:
    return ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def find_certification(
    lane: LaneKey,
    evidence_dir: str | os.PathLike[str] | None,
    *,
    lock: Lock | None = None,
) -> LaneLookup:
    """The certification of ``lane`` in ``evidence_dir`` under ``lock`` (default: the repo's
    lock). Never raises for bad evidence: a refused file is a reason, and the lane stays dark."""
    if evidence_dir is None:
        return LaneLookup(None, ("no evidence directory given",))
    try:
        lock = lock if lock is not None else load_lock()
    except EvidenceError as exc:
        return LaneLookup(None, (f"no usable lock: {exc}",))
    loaded = load_evidence(evidence_dir, lock)
    reasons = [f"refused {exc}" for exc in loaded.refused]
    best = None
    best_path = None
    # per class, the nearest passing record of another lane: (differences, its start, record)
    nearest: dict[EvidenceClass, tuple[tuple[LaneDifference, ...], EvidenceRecord]] = {}
    for record, path in zip(loaded.records, loaded.paths, strict=True):
        if record.kind is not RecordKind.CERTIFICATION:
            continue
        failed = [
            rid
            for rid in CORRECTNESS
            if (req := record.requirement(rid)) is None or req.verdict is not Verdict.PASS
        ]
        if record.lane_id != lane.lane_id:
            differences = lane_differences(lane, record.lane)
            parts = ", ".join(d.part for d in differences)
            reasons.append(
                f"record {record.record_id[:12]} is of another lane (differs in {parts})"
            )
            near = nearest.get(record.evidence_class)
            if not failed and (near is None or _nearer(differences, record, *near)):
                nearest[record.evidence_class] = (differences, record)
            continue
        if failed:
            reasons.append(f"record {record.record_id[:12]} did not pass {', '.join(failed)}")
            continue
        key = (record.evidence_class.rank, record.started_at)
        if best is None or key > (best.evidence_class.rank, best.started_at):
            best, best_path = record, path
    above = -1 if best is None else best.evidence_class.rank
    near_records = tuple(
        NearestRecord(record.record_id, evidence, differences)
        for evidence, (differences, record) in sorted(
            nearest.items(), key=lambda item: item[0].rank
        )
        if evidence.rank > above
    )
    if best is None or best_path is None:
        if not loaded.records and not loaded.refused:
            reasons.append(f"no records in {evidence_dir}")
        return LaneLookup(None, tuple(reasons), near_records)
    cert = Certification(best.evidence_class, best.record_id, best_path, record_json(best))
    reasons.insert(0, f"certified by record {best.record_id[:12]}")
    return LaneLookup(cert, tuple(reasons), near_records)


def _nearer(
    differences: tuple[LaneDifference, ...],
    record: EvidenceRecord,
    than_differences: tuple[LaneDifference, ...],
    than: EvidenceRecord,
) -> bool:
    """Fewer differing parts, or as many and newer."""
    if len(differences) != len(than_differences):
        return len(differences) < len(than_differences)
    return record.started_at > than.started_at
