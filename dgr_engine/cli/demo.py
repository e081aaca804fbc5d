"""The main job: a local route of shard workers, a stage lost and recovered, whole-model parity.

On one machine: builds the fixture model if missing (a generated GGUF: fixture evidence only);
starts one 'dgr worker' process per stage on 127.0.0.1, plus a spare for the stage it will lose
(--no-spare: a replacement is started on demand instead); runs --sessions concurrent route
sessions over gRPC; SIGKILLs the worker of stage --lose-stage when session 0 has --lose-at
tokens, so every session loses its route mid-decode, gets a new route and re-prefills under a
new epoch; checks every session's tokens against the whole model run in-process with the same
engine options; prints per-stage timings and seam bytes. Ends with PARITY OK (exit 0) or PARITY
FAILED (exit 1), and stops every process it started, also on Ctrl-C or SIGTERM.

The workers serve mutual TLS with a throwaway local CA and open a session only with a route grant
signed by the demo's tracker key (both made in a temporary directory, removed at the end): the
secure path is the one the demo shows.

Dark lanes are unroutable: first the demo certifies the fixture lane on this machine ('dgr
certify', or reuses a passing record of exactly this lane under the lock), its workers load that
record, and its sessions require fixture evidence. Fixture evidence is not real-model or
real-hardware evidence, and the demo says so.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import attrs
import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.record import default_evidence_dir
from dgr_engine.cli._evidence_args import add_evidence_arguments
from dgr_engine.cli._logs import log_to_stderr
from dgr_engine.cli._signals import sigterm_as_interrupt
from dgr_engine.cli.certify import CERTIFY_OPTIONS, certify_or_reuse
from dgr_engine.client.relay import ForwardRecord, GrpcStageTransport
from dgr_engine.fixtures import ensure_fixture, lookup
from dgr_engine.options import EngineOptions
from dgr_engine.reference import split_points, whole_model_greedy
from dgr_engine.security.grants import GrantIssuer
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.throwaway_ca import local_pki
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FailureReport,
    Route,
    SessionManager,
    SessionResult,
)

OPTIONS = EngineOptions(**CERTIFY_OPTIONS)
"""The workers' and the whole-model reference's engine options: those ``dgr certify`` uses by
default, so the lane certified is the lane routed."""
PROMPT_LEN = 12


@attrs.frozen
class DemoOutcome:
    """What the demo measured (returned by :func:`run_demo` for tests)."""

    results: tuple[SessionResult, ...]
    expected: tuple[tuple[int, ...], ...]
    killed: str
    replacement: str | None
    parity: bool


def prompts(n_sessions: int, n_vocab: int, length: int = PROMPT_LEN) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(0, n_vocab, size=length)] for _ in range(n_sessions)]


def _route_text(route: Route, provider: LoopbackRouteProvider) -> str:
    parts = []
    for stage in route.stages:
        role = provider.worker(stage.endpoint).role
        mark = "" if role == "primary" else f" ({role})"
        parts.append(f"{stage.endpoint} [{stage.layer_begin},{stage.layer_end}){mark}")
    return " -> ".join(parts)


def _say(text: str) -> None:
    print(text, flush=True)


async def run_demo(args: argparse.Namespace, providers: list[LoopbackRouteProvider]) -> DemoOutcome:
    """The demo, with a throwaway CA and tracker key in a temporary directory (removed after)."""
    with tempfile.TemporaryDirectory(prefix="dgr-demo-keys-") as keys:
        return await _run_demo(args, providers, Path(keys))


async def _run_demo(
    args: argparse.Namespace, providers: list[LoopbackRouteProvider], keys: Path
) -> DemoOutcome:
    path = ensure_fixture(args.fixture)
    spec = lookup(args.fixture)
    layout = split_points(spec.n_layer, args.stages)
    if not 0 <= args.lose_stage < len(layout):
        raise SystemExit(f"--lose-stage must be in [0, {len(layout)})")
    lost_range = layout[args.lose_stage]
    _say(f"model     {path.name}  ({spec.n_layer} layers; generated fixture: fixture evidence)")
    evidence = args.evidence if args.evidence is not None else default_evidence_dir()
    _say(f"certify   the fixture lane on this machine (records in {evidence})")
    if await certify_or_reuse(path, OPTIONS, load_lock(), evidence, reuse=True) != 0:
        raise SystemExit("the fixture lane did not pass certification: not routing over it")
    _say(
        "lanes     certified with FIXTURE evidence (generated model: not real-model or "
        "real-hardware evidence); sessions require fixture evidence"
    )

    pki = local_pki(keys)
    client_tls = pki.client_tls()
    tracker = GrantIssuer(Ed25519PrivateKey.generate(), "demo-tracker")
    _say(
        "security  mutual TLS (a throwaway local CA) and route grants signed by the demo's "
        "tracker key: a worker opens a session only with its grant"
    )

    names = {f"demo-{i}": i for i in range(args.sessions)}
    first_epoch: dict[str, int] = {}

    def on_assign(sid: str, report: FailureReport | None, route: Route | None) -> None:
        if report is None and route is not None and len(provider.assigned) == 1:
            _say(f"route     {_route_text(route, provider)}")
        if report is not None:
            where = f"stage {report.stage_index} {report.endpoint}"
            detail = report.detail if len(report.detail) < 90 else report.detail[:87] + "..."
            _say(
                f"  session {names[sid]}  epoch {report.epoch}  step {report.step}: {where} "
                f"{report.fault.value} ({detail})"
            )
        if route is not None and report is not None:
            _say(f"  session {names[sid]}  new route: {_route_text(route, provider)}")

    def on_forward(record: ForwardRecord) -> None:
        sid = record.session_id
        if record.layers[0] != 0 or record.positions.start != 0:
            return
        first = first_epoch.setdefault(sid, record.epoch)
        if record.epoch != first:
            _say(
                f"  session {names[sid]}  epoch {record.epoch}: re-prefill from position 0 (cache"
                f" miss, no migration): the prompt and {record.step} accepted tokens in batched"
                f" forwards (first call {len(record.positions)} tokens)"
            )

    provider = LoopbackRouteProvider(
        path,
        layout,
        spares=[] if args.no_spare else [lost_range],
        spawn_on_demand=args.no_spare,
        options=OPTIONS,
        worker_args=["--evidence", str(evidence), *pki.worker_args(), *tracker.worker_args(keys)],
        observer=on_assign,
        grants=tracker,
        client_tls=client_tls,
    )
    providers.append(provider)
    try:
        began = time.perf_counter()
        await provider.start()
        _say(
            f"workers   started in {time.perf_counter() - began:.2f} s (dgr worker, 1 thread each)"
        )
        for worker in provider.workers:
            span, seam = worker.advert.span, worker.advert.seam
            ids = "  +token ids" if (span.needs_token_ids and not span.is_first) else ""
            _say(
                f"          {worker.role:<8} [{worker.layers[0]},{worker.layers[1]})  pid "
                f"{worker.pid:<7} {worker.endpoint}  seam in {seam.bytes_per_token_in} B/token,"
                f" out {seam.bytes_per_token_out} B/token{ids}"
            )
        n_vocab = provider.workers[len(layout) - 1].advert.seam.width_out
        all_prompts = prompts(args.sessions, n_vocab)
        began = time.perf_counter()
        expected = await asyncio.to_thread(
            whole_model_greedy, path, all_prompts, args.steps, OPTIONS
        )
        _say(
            f"reference whole-model greedy, in-process ShardEngine (same options), "
            f"{time.perf_counter() - began:.2f} s"
        )

        killed: list[str] = []

        def on_token(token: int) -> None:
            handle = handles[0]
            if killed or len(handle.tokens) != args.lose_at:
                return
            route = handle.core.route
            assert route is not None
            endpoint = route.stages[args.lose_stage].endpoint
            worker = provider.kill(endpoint)
            killed.append(endpoint)
            _say(
                f"step {args.lose_at:>3}  SIGKILL stage {args.lose_stage} "
                f"[{lost_range[0]},{lost_range[1]}) pid {worker.pid} ({endpoint}) while the "
                "sessions are mid-decode"
            )

        policy = FailurePolicy(step_deadline=10.0, session_deadline=120.0, backoff=(0.0, 0.2))
        secured = GrpcStageTransport(timeout=10.0, observer=on_forward, tls=client_tls)
        async with secured as transport:
            manager = SessionManager(
                transport, provider, policy=policy, required_evidence=EvidenceClass.FIXTURE
            )
            began = time.perf_counter()
            handles = [
                manager.start(
                    prompt,
                    max_new_tokens=args.steps,
                    session_id=sid,
                    on_token=on_token if i == 0 else None,
                )
                for i, (sid, prompt) in enumerate(zip(names, all_prompts, strict=True))
            ]
            _say(
                f"sessions  {args.sessions} concurrent, {PROMPT_LEN}-token prompts, "
                f"{args.steps} new tokens each (SessionManager over gRPC streams)"
            )
            results = [await h.wait() for h in handles]
            elapsed = time.perf_counter() - began
            await manager.aclose()
            stats = transport.stats()

        _say("")
        parity = True
        for i, (result, want) in enumerate(zip(results, expected, strict=True)):
            same = list(result.tokens) == want and result.error is None
            parity &= same
            shown = " ".join(map(str, result.tokens[:12]))
            _say(
                f"session {i}  {result.state.value}  epoch {first_epoch.get(result.session_id)}"
                f" -> {result.epoch}  route changes {result.route_changes}  tokens {shown} ..."
                f"  whole-model equal: {same}"
            )
            if result.error is not None:
                _say(f"          error: {result.error}")
        _say("")
        _say(
            f"{'stage endpoint':<22} {'layers':<7} {'fwd':>4} {'rows':>5} {'engine ms':>9} "
            f"{'rtt ms':>7} {'overhead µs':>11} {'bytes in':>9} {'bytes out':>10}"
        )
        between = 0
        for s in stats.values():
            worker = provider.worker(s.endpoint)
            note = (
                " killed"
                if s.endpoint in killed
                else ("" if worker.role == "primary" else f" {worker.role}")
            )
            per = s.overhead_us / max(1, s.forwards)
            _say(
                f"{s.endpoint:<22} [{s.layers[0]},{s.layers[1]}){'':<2} {s.forwards:>4} "
                f"{s.rows:>5} {s.compute_us / 1000:>9.1f} {s.rtt_us / 1000:>7.1f} {per:>11.0f} "
                f"{s.bytes_sent:>9,} {s.bytes_received:>10,}{note}"
            )
            if s.layers[1] != spec.n_layer:
                between += s.bytes_received
        _say(
            f"boundary bytes between stages: {between:,}; wall {elapsed:.2f} s for "
            f"{args.sessions} x {args.steps} tokens"
        )
        replacement = None
        if killed:
            replacements = [w for w in provider.workers if w.role != "primary"]
            replacement = next(
                (
                    w.endpoint
                    for w in replacements
                    if w.endpoint in stats and w.layers == lost_range
                ),
                None,
            )
        return DemoOutcome(
            results=tuple(results),
            expected=tuple(tuple(e) for e in expected),
            killed=killed[0] if killed else "",
            replacement=replacement,
            parity=parity and bool(killed),
        )
    finally:
        await provider.aclose()


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fixture", default="tiny-llama", help="the model: tiny-llama (default) or tiny-v4"
    )
    p.add_argument("--stages", type=int, default=3, help="stages of the route (default 3)")
    p.add_argument("--sessions", type=int, default=3, help="concurrent route sessions (default 3)")
    p.add_argument("--steps", type=int, default=24, help="new tokens per session (default 24)")
    p.add_argument(
        "--lose-stage", type=int, default=1, help="stage index killed mid-decode (default 1)"
    )
    p.add_argument(
        "--lose-at", type=int, default=8, help="tokens session 0 has when it is lost (default 8)"
    )
    p.add_argument(
        "--no-spare", action="store_true", help="no spare: spawn a replacement on demand"
    )
    add_evidence_arguments(p, lock=False)
    p.add_argument(
        "--verbose", action="store_true", help="log state changes and stage calls to stderr"
    )


def run(args: argparse.Namespace) -> int:
    if args.verbose:
        log_to_stderr("DEBUG")
    if not 0 < args.lose_at < args.steps:
        print("--lose-at must be in (0, --steps)", file=sys.stderr)
        return 2
    providers: list[LoopbackRouteProvider] = []
    outcome: DemoOutcome | None = None
    try:
        with sigterm_as_interrupt():
            outcome = asyncio.run(run_demo(args, providers))
    except KeyboardInterrupt:
        print("interrupted: every worker stopped", file=sys.stderr)
        return 130
    finally:
        for provider in providers:
            provider.kill_all()  # no-op when already stopped
    ok = outcome is not None and outcome.parity
    print("PARITY OK" if ok else "PARITY FAILED", flush=True)
    return 0 if ok else 1
