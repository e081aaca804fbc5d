"""Decode speed and recovery time of a route against the round-trip time of its hops.

Each stage of a 2-stage route of a fixture is reached through a userspace WAN proxy
(``dgr_engine.tooling.delay_proxy``) adding RTT per hop (half each way, 1 ms jitter); for each
RTT a fresh pool of ``dgr worker`` processes runs one session: decode tokens per second (after
the prefill), then the last stage is SIGKILLed at ``--kill-at`` tokens and recovery is timed
from the last token before the kill to the first one after it (detection, new route, re-prefill
of prompt + accepted tokens through the proxies). The whole model's decode speed in-process is
measured in the same run as the reference, and every session's tokens are checked against it.

    python -m benchmarks.wan [--fixture tiny-llama] [--rtts 0,10,30,60] [--tokens 32]

Fixture evidence on this machine: every worker, the proxies and the client share its 2 cores,
so the RTT-free figures are bounded by the machine, not the seam; what the table shows is how
RTT adds up per token (two hops plus the client's relay) and per recovery (one round trip per
re-prefilled forward).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import attrs
import numpy as np

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.engine import ShardEngine
from dgr_engine.fixtures import ensure_fixture, lookup
from dgr_engine.options import EngineOptions
from dgr_engine.reference import InProcessRoute, split_points, whole_model_reference
from dgr_engine.tooling.delay_proxy import Link, ProxiedRoutes
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.processes import dgr_command
from dgr_session import EvidenceClass, FailurePolicy, SessionHandle, SessionManager, SessionState


@attrs.frozen
class WanRun:
    rtt_ms: float
    decode_tps: float
    recovery_s: float
    exact: bool


def whole_model(
    path: Path, prompt: list[int], tokens: int, options: EngineOptions
) -> tuple[list[int], float]:
    """The whole model's greedy tokens (as a route session feeds it) and its decode tokens/s,
    in-process."""
    ((want, _),) = whole_model_reference(path, [prompt], tokens, options)
    with ShardEngine(path, **options.engine_kwargs()) as engine:
        chain = InProcessRoute([engine])
        chain.open(1, 0)
        began = time.perf_counter()
        chain.greedy(1, 0, prompt, tokens - 1, all_prefill_logits=False)
        took = time.perf_counter() - began
    return want, (tokens - 1) / took


async def one_rtt(
    path: Path,
    layout: list[tuple[int, int]],
    prompt: list[int],
    tokens: int,
    kill_at: int,
    rtt_ms: float,
    options: EngineOptions,
) -> tuple[WanRun, list[int]]:
    pool = LoopbackRouteProvider(path, layout, spares=[layout[-1]], options=options)
    await pool.start()
    routes = ProxiedRoutes(pool, Link(rtt=rtt_ms / 1000, jitter=0.001, seed=1))
    stamps: list[float] = []
    handle: list[SessionHandle] = []

    def on_token(_token: int) -> None:
        stamps.append(time.perf_counter())
        if len(stamps) == kill_at:
            route = handle[0].core.route
            assert route is not None
            pool.kill(routes.real(route.stages[-1].endpoint))

    policy = FailurePolicy(step_deadline=10.0, backoff=(0.0,))
    try:
        async with GrpcStageTransport(timeout=10.0, close_timeout=0.5) as transport:
            manager = SessionManager(
                transport, routes, policy=policy, required_evidence=EvidenceClass.FIXTURE
            )
            handle.append(
                manager.start(prompt, max_new_tokens=tokens, session_id="wan", on_token=on_token)
            )
            result = await handle[0].wait()
            await manager.aclose()
    finally:
        await routes.aclose()
        await pool.aclose()
    if result.state is not SessionState.DONE:
        raise RuntimeError(f"session failed at {rtt_ms} ms: {result.error}")
    steady = np.diff(stamps[:kill_at])  # decode steps before the kill
    recovery = stamps[kill_at] - stamps[kill_at - 1]
    run = WanRun(rtt_ms, 1 / float(np.median(steady)), recovery, True)
    return run, list(result.tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixture", default="tiny-llama")
    parser.add_argument("--rtts", default="0,10,30,60", help="RTT per hop, ms, comma-separated")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--kill-at", type=int, default=None, help="default: tokens // 2")
    parser.add_argument("--out", type=Path, default=None, help="write wan.json here")
    args = parser.parse_args()
    kill_at = args.kill_at or args.tokens // 2
    if not 3 <= kill_at < args.tokens:
        parser.error("--kill-at must be in [3, --tokens)")
    path = ensure_fixture(args.fixture)
    spec = lookup(args.fixture)
    options = EngineOptions(max_sessions=4)
    subprocess.run(  # dark lanes are unroutable: certify the fixture lane (or reuse its record)
        [dgr_command(), "certify", "--fixture", args.fixture, "--reuse"],
        check=True,
        timeout=1800,
        stdout=subprocess.DEVNULL,
    )
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, spec.n_vocab, size=16)]
    layout = split_points(spec.n_layer, 2)
    want, whole_tps = whole_model(path, prompt, args.tokens, options)
    print(
        f"{path.name}: 2 stages {layout}, {args.tokens} tokens, last stage killed at token "
        f"{kill_at}; {os.cpu_count()} cores shared by every worker, proxy and the client"
    )
    print(f"whole model in-process: {whole_tps:.1f} tok/s")
    print(f"{'RTT/hop ms':>10} {'decode tok/s':>12} {'vs whole':>8} {'recovery s':>10} exact")
    runs = []
    for rtt in (float(r) for r in args.rtts.split(",")):
        run, tokens = asyncio.run(one_rtt(path, layout, prompt, args.tokens, kill_at, rtt, options))
        run = attrs.evolve(run, exact=tokens == want)
        runs.append(run)
        print(
            f"{rtt:>10.0f} {run.decode_tps:>12.1f} {run.decode_tps / whole_tps:>8.3f} "
            f"{run.recovery_s:>10.2f} {run.exact}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"whole_tps": whole_tps, "runs": [attrs.asdict(r) for r in runs]}
        (args.out / "wan.json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if all(r.exact for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
