"""A client checks a worker's certification itself, against its own lock.

A worker's advert says ``certified``, the evidence class and the record id, and carries the
signed record (``Certification.record``). :class:`LockVerifier` is the
:data:`dgr_session.route.CertificationVerifier` that route validation calls for every certified
stage: it parses the record, admits it under the *client's* lock exactly as the loader would
(the lock it was made under, the facts re-derived, a release claim re-checked, the signature
by a key the lock trusts for the record's class), and checks that it is a passing
certification of the lane the stage advertises (lane id, record id, class, and every part of
the lane the advert states: model, recipe, build, hardware). Anything else is a reason, and
the stage is dark for this client (``UnverifiedCertification``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from dgr_engine.certification.errors import EvidenceError
from dgr_engine.certification.gates import CORRECTNESS
from dgr_engine.certification.lock import Lock, load_lock
from dgr_engine.certification.record import (
    EvidenceRecord,
    RecordKind,
    Verdict,
    admit_record,
    parse_record,
)
from dgr_engine.certification.release import CHECKOUT
from dgr_session.route import StageSpec

MAX_RECORD_CHARS = 1 << 20
"""A certification record is a few KiB; an advert's record above this is refused unread."""
_CACHE_LIMIT = 1024


def _mismatches(record: EvidenceRecord, stage: StageSpec) -> list[str]:
    lane, key = stage.lane, record.lane
    identity, recipe = stage.identity, stage.recipe
    pairs = {
        "lane id": (key.lane_id, lane.lane_id),
        "record id": (record.record_id, lane.record_id),
        "evidence class": (record.evidence_class, lane.evidence),
        "model": (key.model_sha256, identity.content_hash.hex()),
        "arch": (key.arch, identity.arch),
        "n_layer": (key.n_layer, identity.n_layer),
        "quant types": (tuple(key.quant_types), tuple(recipe.quant_types)),
        "context": (key.context_per_session, recipe.context),
        "kv type": (key.kv_type, recipe.kv_type),
        "flash attention": (key.flash_attn, recipe.flash_attn),
        "backend": (key.backend, lane.backend),
        "llama.cpp commit": (key.llama_cpp_commit, lane.llama_cpp_commit),
        "patch stack": (key.patch_stack_sha256, lane.patch_stack_hash.hex()),
        "family patch": (key.family_patch_sha256, lane.family_patch_hash.hex()),
        "dgr version": (key.dgr_version, lane.dgr_version),
        "hardware": (key.hardware, lane.hardware),
    }
    return [name for name, (held, told) in pairs.items() if held != told]


def check_stage(stage: StageSpec, lock: Lock, *, checkout: Path | None = CHECKOUT) -> str | None:
    """``None`` when ``stage``'s advertised certification verifies under ``lock``, else why
    not (one line)."""
    text = stage.lane.record
    if not text:
        return "the advert carries no signed record to check it against"
    if len(text) > MAX_RECORD_CHARS:
        return f"the advert's record is {len(text)} characters, more than any record"
    where = Path("advert")
    try:
        record = admit_record(parse_record(text, path=where), lock, path=where, checkout=checkout)
    except EvidenceError as exc:
        return str(exc)
    if record.kind is not RecordKind.CERTIFICATION:
        kind = record.kind.value
        return f"record {record.record_id[:12]} is a {kind} record, not a certification"
    failed = [
        rid
        for rid in CORRECTNESS
        if (req := record.requirement(rid)) is None or req.verdict is not Verdict.PASS
    ]
    if failed:
        return f"record {record.record_id[:12]} did not pass {', '.join(failed)}"
    differs = _mismatches(record, stage)
    if differs:
        return (
            f"record {record.record_id[:12]} is not of the lane advertised (differs in "
            f"{', '.join(differs)})"
        )
    return None


class LockVerifier:
    """:data:`dgr_session.route.CertificationVerifier` against the client's lock: ``lock``, or
    the one at ``lock_path``, else the default lock (``$DGR_LOCK``, else the checkout's),
    loaded on first use. Answers are remembered per advertised certification (bounded), so
    route validation checks each signature once. Thread-safe."""

    def __init__(
        self,
        lock: Lock | None = None,
        *,
        lock_path: str | os.PathLike[str] | None = None,
        checkout: Path | None = CHECKOUT,
    ) -> None:
        self._lock = lock
        self._lock_path = lock_path
        self._lock_error: str | None = None
        self._checkout = checkout
        self._answers: dict[tuple[object, ...], str | None] = {}
        self._mutex = threading.Lock()

    def lock(self) -> Lock | None:
        """The client's lock (``None`` when it cannot be loaded: every stage is refused)."""
        with self._mutex:
            if self._lock is None and self._lock_error is None:
                try:
                    self._lock = load_lock(self._lock_path)
                except EvidenceError as exc:
                    self._lock_error = str(exc)
            return self._lock

    def __call__(self, stage: StageSpec) -> str | None:
        lock = self.lock()
        if lock is None:
            return f"the client has no usable lock: {self._lock_error}"
        lane = stage.lane
        key = (
            lane.record,
            lane.record_id,
            lane.lane_id,
            lane.evidence,
            lane.backend,
            lane.llama_cpp_commit,
            lane.patch_stack_hash,
            lane.family_patch_hash,
            lane.dgr_version,
            lane.hardware,
            stage.identity,
            stage.recipe,
        )
        with self._mutex:
            if key in self._answers:
                return self._answers[key]
        answer = check_stage(stage, lock, checkout=self._checkout)
        with self._mutex:
            if len(self._answers) >= _CACHE_LIMIT:
                self._answers.clear()
            self._answers[key] = answer
        return answer
