"""Which certification, if any, a worker's exact lane holds.

A worker reads the records of an evidence directory under the lock, keeps the certification
records whose lane id is exactly its own and whose correctness requirements all passed, and
advertises the best of them (highest class, then latest). Anything else leaves it dark, with
the reason logged: no directory, refused files (each named with its field), or records whose
lane differs (the differing parts named).
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from dgr_engine.certification.errors import EvidenceError
from dgr_engine.certification.gates import CORRECTNESS
from dgr_engine.certification.lane import LaneKey
from dgr_engine.certification.lock import Lock, load_lock
from dgr_engine.certification.record import RecordKind, Verdict, load_evidence, record_json
from dgr_session.identity import EvidenceClass


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
    for record, path in zip(loaded.records, loaded.paths, strict=True):
        if record.kind is not RecordKind.CERTIFICATION:
            continue
        if record.lane_id != lane.lane_id:
            parts = ", ".join(lane.differences(record.lane))
            reasons.append(
                f"record {record.record_id[:12]} is of another lane (differs in {parts})"
            )
            continue
        failed = [
            rid
            for rid in CORRECTNESS
            if (req := record.requirement(rid)) is None or req.verdict is not Verdict.PASS
        ]
        if failed:
            reasons.append(f"record {record.record_id[:12]} did not pass {', '.join(failed)}")
            continue
        key = (record.evidence_class.rank, record.started_at)
        if best is None or key > (best.evidence_class.rank, best.started_at):
            best, best_path = record, path
    if best is None or best_path is None:
        if not loaded.records and not loaded.refused:
            reasons.append(f"no records in {evidence_dir}")
        return LaneLookup(None, tuple(reasons))
    cert = Certification(best.evidence_class, best.record_id, best_path, record_json(best))
    return LaneLookup(cert, (f"certified by record {best.record_id[:12]}", *reasons))
