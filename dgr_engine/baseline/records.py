"""The DGR-020 baseline record, whichever baseline made it (safetensors or a quantized GGUF):
its lane from the GGUF's identity, the facts its evidence class derives from, the lock's
admission and the certifier's signature."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine.certification.classify import derive_facts
from dgr_engine.certification.lock import Lock
from dgr_engine.certification.record import (
    EvidenceRecord,
    Figure,
    RecordKind,
    Requirement,
    write_record,
)
from dgr_engine.certification.release import release_state
from dgr_engine.certify.runner import git_commit, machine_facts, signing_key_for
from dgr_engine.worker.reporting.identity import BuildIdentity


def baseline_record_for(
    build: BuildIdentity,
    *,
    arch: str,
    n_layer: int,
    context: int,
    figures: Sequence[Figure],
    requirements: Sequence[Requirement],
    lock: Lock,
    started: dt.datetime,
    command: Sequence[str],
    kind: RecordKind = RecordKind.BASELINE,
) -> EvidenceRecord:
    """A baseline record (or another ``kind`` made of one run on ``build``'s lane: DGR-070's
    MTP record) on ``build``'s lane (``context``: tokens per session the run used).
    Raises :class:`~dgr_engine.certification.errors.UnclassifiableModel` for a GGUF that is
    neither a dgr fixture nor a real model the lock names, and ``LockMismatch`` when the lock
    declares no comparable lane for it."""
    lane = build.lane_key(arch=arch, n_layer=n_layer, context_per_session=context)
    commit, _clean = git_commit()
    released = release_state(lane.dgr_version).is_release
    facts = derive_facts(lane, fixture_mark=build.fixture_mark, lock=lock, release_build=released)
    comparable = lock.require_comparable_lane(
        facts.evidence_class, lane.backend, arch, facts.real_model
    )
    return EvidenceRecord(
        kind=kind,
        lane=lane,
        lock_sha256=lock.sha256,
        facts=facts,
        family=comparable.family,
        command=tuple(command),
        dgr_commit=commit,
        machine=machine_facts(lane.hardware),
        started_at=started,
        ended_at=dt.datetime.now(dt.UTC),
        figures=tuple(figures),
        requirements=tuple(requirements),
    )


def write_admitted(
    make: Callable[[], EvidenceRecord],
    *,
    lock: Lock,
    evidence_dir: str | os.PathLike[str],
    started: dt.datetime,
    key: Ed25519PrivateKey | None = None,
) -> tuple[EvidenceRecord, Path]:
    """The record ``make()`` builds, once the lock is committed and admits a run started at
    ``started``, written signed by ``key`` (default: the fixture certifier, fixture evidence
    only); returns it and its path."""
    lock.require_committed()
    lock.admit(lock.sha256, started, path=None)
    record = make()
    key = signing_key_for(lock, record.evidence_class, key)
    return record, write_record(record, evidence_dir, key=key)
