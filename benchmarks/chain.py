"""Decode speed of relayed and chained routes against the round-trip time of each link.

For 2 and 4 stages of a fixture (``dgr worker`` processes on 127.0.0.1), and for each RTT per
link, one session per mode and round, the modes interleaved: **relay** (``GrpcStageTransport``:
the client sends each stage its input and gets each stage's output back) and **chain**
(``ChainStageTransport``: the client sends the first stage's frame, each stage sends its output
straight to the next, the last stage's output comes back on the client's output stream), and
**ring** (``ChainStageTransport(ring=True)``: besides, the last stage sends each next decode
frame, its greedy token, to the first stage itself; the client only checks). A
link with RTT > 0 is the userspace WAN proxy of ``dgr_engine.tooling.delay_proxy`` in front
of every stage (half the RTT each way), so client-to-stage and stage-to-stage hops cross one
each; RTT 0 is plain loopback, no proxy. Tokens are checked against the whole model in every run.

    python -m benchmarks.chain [--fixture mid-llama] [--rtts 0,10,30] [--stages 2 4]

Targets (issue 15, part 3): at 30 ms and 4 stages chain >= 1.8 x relay; on loopback
chain >= relay. Saves ``benchmarks/out/chain.json``. Where a target is missed it prints where a
decode token's time goes (``docs/chain.md`` has the latency arithmetic).

Fixture evidence on this machine: every worker, proxy and the client share its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from dgr_engine.client.chained import ChainRecord, ChainStageTransport
from dgr_engine.client.relay import ForwardRecord, GrpcStageTransport
from dgr_engine.fixtures import ensure_fixture, lookup
from dgr_engine.options import EngineOptions
from dgr_engine.reference import split_points, whole_model_reference
from dgr_engine.tooling.delay_proxy import Link, ProxiedRoutes
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.processes import dgr_command
from dgr_session import EvidenceClass, FailurePolicy, SessionManager, SessionState
from dgr_session.transport import RouteProvider

ROOT = Path(__file__).resolve().parent.parent
MODES = ("relay", "chain", "ring")


@attrs.frozen
class Run:
    """One session's decode."""

    mode: str
    stages: int
    rtt_ms: float
    decode_tps: float
    """Decode tokens per second: 1 / the median time between accepted tokens."""
    exact: bool
    ms_per_token: float
    engine_ms: float
    """Per decode token: the engines' time (what the workers report), all stages."""
    worker_ms: float
    """Per decode token: the workers' handlers around their engines (checks, reply, the
    frame to the next stage), all stages."""
    transit_ms: float
    """Per decode token: the network (the proxies' delay) and gRPC, all hops: the client's
    wait for the stages minus the handlers."""
    client_ms: float
    """Per decode token: the rest (session manager, transport, sampling)."""


@attrs.frozen
class Cell:
    stages: int
    rtt_ms: float
    relay_tps: float
    chain_tps: float
    ring_tps: float
    exact: bool

    @property
    def ratio(self) -> float:
        return self.chain_tps / self.relay_tps

    @property
    def ring_ratio(self) -> float:
        return self.ring_tps / self.relay_tps


async def one_session(
    provider: RouteProvider, mode: str, prompt: list[int], tokens: int, tag: str
) -> tuple[list[int], list[float], list[tuple[int, int, int]]]:
    """Runs one session; returns its tokens, the times they were accepted and, per decode
    step after the first token, (client wait, handlers, engines) in µs."""
    stamps: list[float] = []
    relay: list[ForwardRecord] = []
    chained: list[ChainRecord] = []
    transport: GrpcStageTransport
    if mode in ("chain", "ring"):
        transport = ChainStageTransport(
            timeout=30.0, close_timeout=1.0, chain_observer=chained.append, ring=mode == "ring"
        )
    else:
        transport = GrpcStageTransport(timeout=30.0, close_timeout=1.0, observer=relay.append)
    policy = FailurePolicy(step_deadline=30.0, session_deadline=600.0)
    async with transport:
        manager = SessionManager(
            transport, provider, policy=policy, required_evidence=EvidenceClass.FIXTURE
        )
        handle = manager.start(
            prompt,
            max_new_tokens=tokens,
            session_id=f"{tag}-{mode}",
            on_token=lambda _t: stamps.append(time.perf_counter()),
        )
        result = await handle.wait()
        await manager.aclose()
    if result.state is not SessionState.DONE:
        raise RuntimeError(f"{tag} {mode}: session ended {result.state}: {result.error}")
    parts: list[tuple[int, int, int]] = []
    if mode in ("chain", "ring"):
        for c in chained:
            if c.step >= 1 and c.rows == 1:
                parts.append((c.rtt_us, sum(c.handler_us), sum(c.compute_us)))
    else:
        by_step: dict[int, list[ForwardRecord]] = {}
        for r in relay:
            if r.step >= 1 and len(r.positions) == 1:
                by_step.setdefault(r.step, []).append(r)
        for records in by_step.values():
            parts.append(
                (
                    sum(r.rtt_us for r in records),
                    sum(r.handler_us for r in records),
                    sum(r.compute_us for r in records),
                )
            )
    return list(result.tokens), stamps, parts


def summarize(
    mode: str,
    stages: int,
    rtt_ms: float,
    sessions: list[tuple[list[float], list[tuple[int, int, int]], bool]],
) -> Run:
    gaps = [g for stamps, _, _ in sessions for g in np.diff(stamps[1:]).tolist()]
    per_token = statistics.median(gaps)
    parts = [p for _, ps, _ in sessions for p in ps]
    wait = statistics.median(p[0] for p in parts) / 1000
    handler = statistics.median(p[1] for p in parts) / 1000
    engine = statistics.median(p[2] for p in parts) / 1000
    return Run(
        mode=mode,
        stages=stages,
        rtt_ms=rtt_ms,
        decode_tps=1 / per_token,
        exact=all(exact for _, _, exact in sessions),
        ms_per_token=per_token * 1000,
        engine_ms=engine,
        worker_ms=handler - engine,
        transit_ms=wait - handler,
        client_ms=per_token * 1000 - wait,
    )


async def measure(
    path: Path,
    n_layer: int,
    stages: list[int],
    rtts: list[float],
    prompt: list[int],
    tokens: int,
    rounds: int,
    want: list[int],
    options: EngineOptions,
) -> list[Run]:
    runs: list[Run] = []
    for n in stages:
        pool = LoopbackRouteProvider(path, split_points(n_layer, n), options=options)
        await pool.start()
        try:
            for rtt in rtts:
                provider: RouteProvider = pool
                routes = None
                if rtt > 0:
                    routes = ProxiedRoutes(pool, Link(rtt=rtt / 1000, seed=1))
                    provider = routes
                seen: dict[str, list[tuple[list[float], list[tuple[int, int, int]], bool]]] = {
                    m: [] for m in MODES
                }
                try:
                    for r in range(rounds + 1):  # round 0 warms the workers and proxies up
                        order = MODES if r % 2 == 0 else MODES[::-1]
                        for mode in order:
                            got, stamps, parts = await one_session(
                                provider, mode, prompt, tokens, f"s{n}-r{rtt:g}-{r}"
                            )
                            if r:
                                seen[mode].append((stamps, parts, got == want))
                finally:
                    if routes is not None:
                        await routes.aclose()
                for mode in MODES:
                    run = summarize(mode, n, rtt, seen[mode])
                    runs.append(run)
                    print(
                        f"  {n} stages, {rtt:>4g} ms: {mode:<5} {run.decode_tps:7.1f} tok/s "
                        f"({run.ms_per_token:.1f} ms/token, exact {run.exact})",
                        flush=True,
                    )
        finally:
            await pool.aclose()
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fixture", default="mid-llama")
    parser.add_argument("--rtts", default="0,10,30", help="RTT per link, ms, comma-separated")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=24, help="tokens per session")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per cell")
    parser.add_argument("--threads", type=int, default=1, help="engine threads per worker")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args(argv)
    path = ensure_fixture(args.fixture)
    spec = lookup(args.fixture)
    ctx = 1 << (args.prompt + args.tokens + 2).bit_length()
    options = EngineOptions(
        n_threads=args.threads, n_ctx_per_session=max(ctx, 64), n_batch=64, max_sessions=2
    )
    certify = attrs.evolve(options, max_sessions=8)  # the isolation scenario's sessions
    subprocess.run(  # dark lanes are unroutable: certify the lane (or reuse its record)
        [dgr_command(), "certify", "--fixture", args.fixture, "--reuse", *certify.worker_argv()],
        check=True,
        timeout=1800,
        stdout=subprocess.DEVNULL,
    )
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(0, spec.n_vocab, size=args.prompt)]
    ((want, _),) = whole_model_reference(path, [prompt], args.tokens, options)
    rtts = [float(r) for r in args.rtts.split(",")]
    print(
        f"{path.name}: {spec.n_layer} layers, stages {args.stages}, RTT per link {rtts} ms "
        f"(0: loopback, no proxy), {args.tokens} tokens, {args.rounds} rounds; "
        f"{os.cpu_count()} cores shared by every worker, proxy and the client"
    )
    runs = asyncio.run(
        measure(
            path, spec.n_layer, args.stages, rtts, prompt, args.tokens, args.rounds, want, options
        )
    )
    by = {(r.mode, r.stages, r.rtt_ms): r for r in runs}
    cells = [
        Cell(
            n,
            rtt,
            by[("relay", n, rtt)].decode_tps,
            by[("chain", n, rtt)].decode_tps,
            by[("ring", n, rtt)].decode_tps,
            all(by[(m, n, rtt)].exact for m in MODES),
        )
        for n in args.stages
        for rtt in rtts
    ]
    print()
    head = f"{'stages':>6} {'RTT ms':>6} {'relay tok/s':>11} {'chain tok/s':>11}"
    print(f"{head} {'chain/relay':>11} {'ring tok/s':>10} {'ring/relay':>10} exact")
    for c in cells:
        print(
            f"{c.stages:>6} {c.rtt_ms:>6g} {c.relay_tps:>11.1f} {c.chain_tps:>11.1f} "
            f"{c.ratio:>11.2f} {c.ring_tps:>10.1f} {c.ring_ratio:>10.2f} {c.exact}"
        )
    targets: list[dict[str, Any]] = []

    def add_target(c: Cell, mode: str, target: float) -> None:
        where = f"at {c.rtt_ms:g} ms" if c.rtt_ms else "loopback"
        value = c.ring_ratio if mode == "ring" else c.ratio
        targets.append(
            {
                "name": f"{where}, {c.stages} stages: {mode} / relay",
                "stages": c.stages,
                "rtt_ms": c.rtt_ms,
                "mode": mode,
                "value": value,
                "target": target,
                "met": value >= target,
            }
        )

    wan = next((c for c in cells if c.stages == 4 and c.rtt_ms == 30), None)
    if wan is not None:
        add_target(wan, "chain", 1.8)
        add_target(wan, "ring", 1.8)
    for c in cells:
        if c.rtt_ms == 0:
            add_target(c, "chain", 1.0)
            add_target(c, "ring", 1.0)
    print()
    for t in targets:
        verdict = "met" if t["met"] else "MISSED"
        print(f"target {t['name']} >= {t['target']:g}: {t['value']:.2f} {verdict}")
    missed = [t for t in targets if not t["met"]]
    if missed:
        print()
        print("where a decode token's time goes (ms, medians; transit: network + gRPC, all hops)")
        print(
            f"{'mode':<6} {'stages':>6} {'RTT':>4} {'token':>7} {'engines':>8} {'workers':>8} "
            f"{'transit':>8} {'client':>7}"
        )
        for r in runs:
            print(
                f"{r.mode:<6} {r.stages:>6} {r.rtt_ms:>4g} {r.ms_per_token:>7.2f} "
                f"{r.engine_ms:>8.2f} {r.worker_ms:>8.2f} {r.transit_ms:>8.2f} {r.client_ms:>7.2f}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "fixture": args.fixture,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "runs": [attrs.asdict(r) for r in runs],
        "cells": [{**attrs.asdict(c), "ratio": c.ratio, "ring_ratio": c.ring_ratio} for c in cells],
        "targets": targets,
    }
    (args.out / "chain.json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if all(c.exact for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
