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
Beside decode, each mode's **time to first token**: from ``SessionManager.start`` to the first
accepted token (the route's opens, the prompt's prefill through every stage and its first
greedy token), the median over the measured sessions.

    python -m benchmarks.chain [--fixture mid-llama | --model NAME|PATH] [--rtts 0,10,30]
        [--stages 2 4] [--lock FILE --evidence DIR --sign-key FILE]

``--model`` takes a real model (a catalog name of ``dgr models list``, fetched when needed, or a
GGUF file); its lane is certified (or its record reused) under ``--lock``, which must declare it
(``benchmarks/model_arg.py``).

Beside them, **llama.cpp RPC** with the same split (``llama-bench`` over ``ggml-rpc-server``
processes, the peers built from the same workspace: ``benchmarks/peers.py``), its servers behind
a proxy of the same link each, decoding as many steps after a prompt as long: what a user who
spreads the model with RPC instead gets over the same WAN (``--no-rpc`` leaves it out). RPC asks
each server for its result before the next one starts; a ring sends each frame one way.

Targets (issue 15, part 3): at 30 ms and 4 stages chain >= 1.8 x relay; on loopback
chain >= relay. Saves ``benchmarks/out/chain.json``. Where a target is missed it prints where a
decode token's time goes (``docs/chain.md`` has the latency arithmetic).

Fixture (or, with ``--model``, real-model) figures on this machine: every worker, proxy and the
client share its cores, and other work on the machine runs concurrently.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from benchmarks.model_arg import BenchModelError, add_model_arguments, resolve
from dgr_engine.certify.scenarios import RpcSide
from dgr_engine.client.chained import ChainRecord, ChainStageTransport
from dgr_engine.client.relay import ForwardRecord, GrpcStageTransport
from dgr_engine.options import EngineOptions
from dgr_engine.reference import split_points, whole_model_reference
from dgr_engine.tooling import peer_build
from dgr_engine.tooling.delay_proxy import Link, ProxiedRoutes, WanProxy
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.rpc_peer import Endpoint, RpcEndpoint, RpcServer, rpc_servers
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
    ttft_ms: float = 0.0
    """Time to first token: from ``SessionManager.start`` to the first accepted token (the
    stages' opens, the prefill through every stage, its greedy token), median of the sessions."""


@attrs.frozen
class Cell:
    stages: int
    rtt_ms: float
    relay_tps: float
    chain_tps: float
    ring_tps: float
    exact: bool
    relay_ttft_ms: float = 0.0
    chain_ttft_ms: float = 0.0
    ring_ttft_ms: float = 0.0
    rpc_tps: float | None = None
    """llama.cpp RPC with the same split behind the same links (``None``: not run)."""

    @property
    def ring_vs_rpc(self) -> float | None:
        return None if self.rpc_tps is None else self.ring_tps / self.rpc_tps

    @property
    def ratio(self) -> float:
        return self.chain_tps / self.relay_tps

    @property
    def ring_ratio(self) -> float:
        return self.ring_tps / self.relay_tps


async def one_session(
    provider: RouteProvider,
    mode: str,
    prompt: list[int],
    tokens: int,
    tag: str,
    data_path: str = "auto",
) -> tuple[list[int], list[float], list[tuple[int, int, int]]]:
    """Runs one session; returns its tokens, the times they were accepted (the first entry:
    the time the session was started) and, per decode step after the first token, (client
    wait, handlers, engines) in µs. ``data_path``: the chained frames' (``grpc`` behind the
    WAN proxy, which fronts gRPC only: the frame link is dialled at the port a stage
    advertises, past the proxy, and would skip the delay)."""
    stamps: list[float] = []
    relay: list[ForwardRecord] = []
    chained: list[ChainRecord] = []
    transport: GrpcStageTransport
    if mode in ("chain", "ring"):
        transport = ChainStageTransport(
            timeout=30.0,
            close_timeout=1.0,
            chain_observer=chained.append,
            ring=mode == "ring",
            data_path=data_path,
        )
    else:
        transport = GrpcStageTransport(timeout=30.0, close_timeout=1.0, observer=relay.append)
    policy = FailurePolicy(step_deadline=30.0, session_deadline=600.0)
    async with transport:
        manager = SessionManager(
            transport, provider, policy=policy, required_evidence=EvidenceClass.FIXTURE
        )
        stamps.append(time.perf_counter())
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
    # stamps[0]: the session's start; stamps[1]: its first token (the prefill's)
    gaps = [g for stamps, _, _ in sessions for g in np.diff(stamps[2:]).tolist()]
    per_token = statistics.median(gaps)
    ttft = statistics.median(stamps[1] - stamps[0] for stamps, _, _ in sessions)
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
        ttft_ms=ttft * 1000,
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
    rpc: RpcSide | None = None,
) -> tuple[list[Run], dict[tuple[int, float], float]]:
    """Every mode's runs, and with ``rpc`` llama.cpp RPC's decode tok/s by (stages, RTT)."""
    runs: list[Run] = []
    rpc_tps: dict[tuple[int, float], float] = {}
    for n in stages:
        pool = LoopbackRouteProvider(path, split_points(n_layer, n), options=options)
        await pool.start()
        servers: AbstractContextManager[list[RpcServer]] = (
            rpc_servers(rpc.server, n - 1, options.n_threads) if rpc else nullcontext([])
        )
        try:
            with servers as started:
                for rtt in rtts:
                    got = await _cell(pool, n, rtt, prompt, tokens, rounds, want, started, rpc)
                    runs.extend(got[0])
                    if got[1] is not None:
                        rpc_tps[(n, rtt)] = got[1]
        finally:
            await pool.aclose()
    return runs, rpc_tps


async def _cell(
    pool: LoopbackRouteProvider,
    n: int,
    rtt: float,
    prompt: list[int],
    tokens: int,
    rounds: int,
    want: list[int],
    servers: Sequence[RpcEndpoint],
    rpc: RpcSide | None,
) -> tuple[list[Run], float | None]:
    """One (stages, RTT) cell: every mode's run, and RPC's median decode tok/s behind a proxy
    of the same link in front of each of its servers (``None`` without ``rpc``)."""
    runs: list[Run] = []
    proxies: list[WanProxy] = []
    rpc_rounds: list[float] = []
    provider: RouteProvider = pool
    routes = None
    seen: dict[str, list[tuple[list[float], list[tuple[int, int, int]], bool]]] = {
        m: [] for m in MODES
    }
    try:
        if rtt > 0:
            routes = ProxiedRoutes(pool, Link(rtt=rtt / 1000, seed=1))
            provider = routes
            for server in servers:
                link = Link(rtt=rtt / 1000, seed=1)
                proxies.append(await WanProxy.start(server.endpoint, link))
        targets: Sequence[RpcEndpoint] = [Endpoint(p.address) for p in proxies] or servers
        for r in range(rounds + 1):  # round 0 warms the workers and proxies up
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                got, stamps, parts = await one_session(
                    provider,
                    mode,
                    prompt,
                    tokens,
                    f"s{n}-r{rtt:g}-{r}",
                    "grpc" if rtt > 0 else "auto",
                )
                if r:
                    seen[mode].append((stamps, parts, got == want))
            if r and rpc is not None:  # llama-bench warms up inside each run
                tps, differs = await rpc.decode_tps(targets, tokens - 1, len(prompt))
                if differs is not None:  # not the same settings: no comparison
                    raise RuntimeError(f"llama.cpp RPC ran with other settings: {differs}")
                rpc_rounds.append(tps)
    finally:
        if routes is not None:
            await routes.aclose()
        for proxy in proxies:
            await proxy.aclose()
    for mode in MODES:
        run = summarize(mode, n, rtt, seen[mode])
        runs.append(run)
        print(
            f"  {n} stages, {rtt:>4g} ms: {mode:<5} {run.decode_tps:7.1f} tok/s "
            f"({run.ms_per_token:.1f} ms/token, first token {run.ttft_ms:.0f} ms, "
            f"exact {run.exact})",
            flush=True,
        )
    rpc_median = statistics.median(rpc_rounds) if rpc_rounds else None
    if rpc_median is not None:
        print(f"  {n} stages, {rtt:>4g} ms: rpc   {rpc_median:7.1f} tok/s", flush=True)
    return runs, rpc_median


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_model_arguments(parser, default_fixture="mid-llama")
    parser.add_argument("--rtts", default="0,10,30", help="RTT per link, ms, comma-separated")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=24, help="tokens per session")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds per cell")
    parser.add_argument("--threads", type=int, default=1, help="engine threads per worker")
    parser.add_argument(
        "--no-rpc",
        dest="rpc",
        action="store_false",
        help="leave out llama.cpp RPC with the same split behind the same links",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args(argv)
    try:
        model = resolve(args, notice=lambda m: print(m, flush=True))
    except BenchModelError as exc:
        print(f"benchmarks.chain: {exc}", file=sys.stderr)
        return 2
    model.export_trust()  # the workers and this client judge the lane by the same lock
    path = model.path
    ctx = 1 << (args.prompt + args.tokens + 2).bit_length()
    options = EngineOptions(
        n_threads=args.threads, n_ctx_per_session=max(ctx, 64), n_batch=64, max_sessions=2
    )
    certify = attrs.evolve(options, max_sessions=8)  # the isolation scenario's sessions
    print(f"certifying the lane of {model.label} (or reusing its record)", flush=True)
    try:  # dark lanes are unroutable
        model.require_certified(certify)
    except BenchModelError as exc:
        print(f"benchmarks.chain: {exc}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(0, model.n_vocab, size=args.prompt)]
    ((want, _),) = whole_model_reference(path, [prompt], args.tokens, options)
    rtts = [float(r) for r in args.rtts.split(",")]
    print(
        f"{path.name}: {model.n_layer} layers, stages {args.stages}, RTT per link {rtts} ms "
        f"(0: loopback, no proxy), {args.tokens} tokens, {args.rounds} rounds; "
        f"{model.evidence_note(os.cpu_count())}",
        flush=True,
    )
    rpc = None
    if args.rpc:
        prefix = peer_build.ensure_peers(log=lambda m: print(m, flush=True))
        rpc = RpcSide.of(prefix, path, options, model.n_layer)
    runs, rpc_tps = asyncio.run(
        measure(
            path,
            model.n_layer,
            args.stages,
            rtts,
            prompt,
            args.tokens,
            args.rounds,
            want,
            options,
            rpc,
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
            by[("relay", n, rtt)].ttft_ms,
            by[("chain", n, rtt)].ttft_ms,
            by[("ring", n, rtt)].ttft_ms,
            rpc_tps.get((n, rtt)),
        )
        for n in args.stages
        for rtt in rtts
    ]
    print()
    head = f"{'stages':>6} {'RTT ms':>6} {'relay tok/s':>11} {'chain tok/s':>11}"
    print(
        f"{head} {'chain/relay':>11} {'ring tok/s':>10} {'ring/relay':>10} "
        f"{'TTFT ms relay/chain/ring':>24} exact {'rpc tok/s':>9} {'ring/rpc':>8}"
    )
    for c in cells:
        ttft = f"{c.relay_ttft_ms:.0f}/{c.chain_ttft_ms:.0f}/{c.ring_ttft_ms:.0f}"
        rpc_cells = (
            f"{c.rpc_tps:>9.1f} {c.ring_vs_rpc:>8.2f}"
            if c.rpc_tps is not None and c.ring_vs_rpc is not None
            else f"{'-':>9} {'-':>8}"
        )
        print(
            f"{c.stages:>6} {c.rtt_ms:>6g} {c.relay_tps:>11.1f} {c.chain_tps:>11.1f} "
            f"{c.ratio:>11.2f} {c.ring_tps:>10.1f} {c.ring_ratio:>10.2f} {ttft:>24} {c.exact!s:>5} "
            f"{rpc_cells}"
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
        "fixture": model.label if model.is_fixture else None,
        "model": model.label,
        "model_kind": model.kind,
        "evidence": model.evidence_note(os.cpu_count()),
        "tokens": args.tokens,
        "rounds": args.rounds,
        "runs": [attrs.asdict(r) for r in runs],
        "cells": [
            {
                **attrs.asdict(c),
                "ratio": c.ratio,
                "ring_ratio": c.ring_ratio,
                "ring_vs_rpc": c.ring_vs_rpc,
            }
            for c in cells
        ],
        "targets": targets,
    }
    (args.out / "chain.json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if all(c.exact for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
