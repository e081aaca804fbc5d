"""What security costs: a route grant's verification per open, the session-secret check per
frame, and decode speed over a 2-stage route with mutual TLS and grants against plaintext.

The two checks are timed in-process over many calls. The routes are ``dgr worker`` processes on
127.0.0.1 (one engine thread each), a fresh pool per configuration, rounds interleaved (plain,
secure, plain, ...); each round runs one session and takes its decode tokens per second after
the prefill. Fixture evidence on this machine: both workers and the client share its cores.

    python -m benchmarks.security [--fixture tiny-llama] [--rounds 3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.fixtures import ensure_fixture, lookup
from dgr_engine.options import EngineOptions
from dgr_engine.reference import split_points
from dgr_engine.security.grants import Grant, GrantIssuer, GrantVerifier, issue
from dgr_engine.security.tls import ClientTls
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.processes import dgr_command
from dgr_engine.tooling.throwaway_ca import local_pki
from dgr_engine.worker.lifecycle.grant_gate import GrantGate
from dgr_session import EvidenceClass, FailurePolicy, SessionManager, SessionState


def time_checks(n: int = 2000) -> dict[str, float]:
    """Microseconds per grant verification and per session-secret check."""
    key = Ed25519PrivateKey.generate()
    verifier = GrantVerifier({"k": key.public_key()})
    expires = time.time() + 600
    tokens = [
        issue(Grant(f"s{i}", 1, "e", 0, 4, "ab" * 32, "lane", expires, "k"), key) for i in range(n)
    ]
    began = time.perf_counter()
    for i, token in enumerate(tokens):
        verifier.verify(
            token,
            session_id=f"s{i}",
            epoch=1,
            endpoint="e",
            layers=(0, 4),
            model_sha256="ab" * 32,
            lane_id="lane",
        )
    verify_us = (time.perf_counter() - began) / n * 1e6
    gate = GrantGate(verifier)
    secret = gate.opened("s", 1)
    began = time.perf_counter()
    for _ in range(n * 10):
        gate.check("s", 1, secret)
    check_us = (time.perf_counter() - began) / (n * 10) * 1e6
    return {"grant_verify_us": verify_us, "secret_check_us": check_us}


async def one_round(
    path: Path,
    layout: list[tuple[int, int]],
    options: EngineOptions,
    prompt: list[int],
    tokens: int,
    secure: tuple[list[str], GrantIssuer, ClientTls] | None,
) -> tuple[float, list[int]]:
    args, grants, tls = secure if secure is not None else ([], None, None)
    provider = LoopbackRouteProvider(
        path, layout, options=options, worker_args=args, grants=grants, client_tls=tls
    )
    stamps: list[float] = []
    async with provider, GrpcStageTransport(timeout=30.0, tls=tls) as transport:
        manager = SessionManager(
            transport,
            provider,
            policy=FailurePolicy(step_deadline=30.0),
            required_evidence=EvidenceClass.FIXTURE,
        )
        handle = manager.start(
            prompt, max_new_tokens=tokens, on_token=lambda _t: stamps.append(time.perf_counter())
        )
        result = await handle.wait()
        await manager.aclose()
    if result.state is not SessionState.DONE:
        raise RuntimeError(f"session failed: {result.error}")
    steps = np.diff(stamps[1:])  # decode steps (the first token closes the prefill)
    return 1 / float(np.median(steps)), list(result.tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", default="tiny-llama")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=None, help="write security.json here")
    args = parser.parse_args(argv)
    checks = time_checks()
    print(f"grant verification per open: {checks['grant_verify_us']:.1f} us (Ed25519)")
    print(f"session-secret check per frame: {checks['secret_check_us']:.2f} us")
    options = EngineOptions(max_sessions=4)
    subprocess.run(  # dark lanes are unroutable: certify the fixture lane (or reuse its record)
        [dgr_command(), "certify", "--fixture", args.fixture, "--reuse", *options.worker_argv()],
        check=True,
        timeout=1800,
        stdout=subprocess.DEVNULL,
    )
    spec = lookup(args.fixture)
    path = ensure_fixture(args.fixture)
    layout = split_points(spec.n_layer, 2)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, spec.n_vocab, size=16)]
    speeds: dict[str, list[float]] = {"plaintext": [], "mutual TLS + grants": []}
    outputs: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="dgr-security-bench-") as keys:
        pki = local_pki(Path(keys))
        grants = GrantIssuer(Ed25519PrivateKey.generate(), "bench")
        secure = ([*pki.worker_args(), *grants.worker_args(keys)], grants, pki.client_tls())
        for _ in range(args.rounds):
            for name, setting in (("plaintext", None), ("mutual TLS + grants", secure)):
                tps, tokens = asyncio.run(
                    one_round(path, layout, options, prompt, args.tokens, setting)
                )
                speeds[name].append(tps)
                outputs[name] = tokens
    plain = statistics.median(speeds["plaintext"])
    guarded = statistics.median(speeds["mutual TLS + grants"])
    print(
        f"{path.name}: 2 stages {layout}, {args.tokens} tokens, {args.rounds} interleaved rounds "
        "(fixture evidence; workers and client share this machine's cores)"
    )
    print(f"{'route':<22} {'decode tok/s (median)':>22} {'rounds':>30}")
    for name, values in speeds.items():
        rounds = " ".join(f"{v:.1f}" for v in values)
        print(f"{name:<22} {statistics.median(values):>22.1f} {rounds:>30}")
    same = outputs["plaintext"] == outputs["mutual TLS + grants"]
    print(f"secure / plaintext decode: {guarded / plain:.3f}; same tokens: {same}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {**checks, "speeds": speeds, "ratio": guarded / plain}
        (args.out / "security.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
