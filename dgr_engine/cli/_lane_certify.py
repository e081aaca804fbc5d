"""Certify a lane, or reuse a passing record of exactly it: what ``dgr certify``, ``dgr demo``
and a command run with ``--certify`` on the operator's own model share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dgr_engine.options import EngineOptions
from dgr_engine.tooling.peer_build import PeerUse

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from dgr_engine.certification.lock import Lock


def _print(text: str) -> None:
    print(text, flush=True)


async def certify_or_reuse(
    model: Path,
    options: EngineOptions,
    lock: Lock,
    evidence: Path,
    reuse: bool,
    *,
    key: Ed25519PrivateKey | None = None,
    rpc: PeerUse = PeerUse.AUTO,
    say: Callable[[str], None] = _print,
) -> int:
    """Reuse a matching passing record (with ``reuse``) or certify, signing with ``key``
    (default: the fixture certifier) and running llama.cpp RPC as ``rpc`` says; ``say`` the
    progress and the outcome (default: on standard output). 0 when every correctness
    requirement passed, else 1."""
    from dgr_engine.certification.gates import CORRECTNESS
    from dgr_engine.certification.record import Verdict
    from dgr_engine.certify.runner import certify

    if reuse:
        found = await asyncio.to_thread(matching_record, model, options, lock, evidence)
        if found is not None:
            say(f"reusing record {found} (same lane, same lock)")
            return 0

    began = time.perf_counter()
    argv = ["dgr", "certify", "--model", str(model), "--rpc", rpc.value, *options.worker_argv()]
    if key is not None:
        argv += ["--sign-key", "KEY"]  # the command, not where the operator keeps the key
    result = await certify(
        model,
        options=options,
        lock=lock,
        evidence_dir=evidence,
        command=argv,
        progress=say,
        key=key,
        rpc=rpc,
    )
    record = result.record
    say(
        f"record {result.path} ({record.evidence_class.value} evidence), "
        f"{time.perf_counter() - began:.1f} s"
    )
    if record.signature is not None:
        signer = lock.certifier(record.signature.key_id)
        name = f" ({signer.name})" if signer is not None else ""
        say(f"signed by key {record.signature.key_id}{name}")
    failed = []
    for req in record.requirements:
        say(f"  {req.verdict.value:<12} {req.id}: {req.detail}")
        if req.id in CORRECTNESS and req.verdict is not Verdict.PASS:
            failed.append(req.id)
    return 1 if failed else 0


def matching_record(model: Path, options: EngineOptions, lock: Lock, evidence: Path) -> str | None:
    """Path of a passing record of exactly the lane ``model`` + ``options`` has here."""
    from dgr_engine.certification.registry import find_certification
    from dgr_engine.certify.runner import lane_of

    lane = lane_of(model, options)
    found = find_certification(lane, evidence, lock=lock)
    if found.certification is None:
        return None
    return str(found.certification.path)
