"""The certification scenarios of one lane, each over real ``dgr worker`` processes.

Every scenario returns :class:`Outcome`: figures (with units) and one requirement verdict. The
whole model, run in-process with the same engine options, is the reference throughout; parity
is bit-exact (tokens and logits), as the lock requires.

Routes here run over the lane being certified before any record of it exists, so its stages
are dark: :class:`CandidateRoutes` presents them to the session layer as certified by the
*candidate* record (the evidence class its facts derive, record id ``candidate``). Only the
certification run does this, only for its own workers, and nothing it routes leaves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np
import numpy.typing as npt

from dgr_engine.certification.lock import Thresholds
from dgr_engine.certification.record import Figure, Requirement, Verdict
from dgr_engine.client.chained import ChainRecord, ChainStageTransport
from dgr_engine.client.relay import ForwardRecord, GrpcStageTransport
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.engine import ShardEngine
from dgr_engine.errors import ShardError
from dgr_engine.options import EngineOptions
from dgr_engine.reference import InProcessRoute
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.rpc_peer import (
    PeerConfig,
    RpcEndpoint,
    RpcServer,
    pick,
    rpc_servers,
    run_llama_bench_async,
    settings_differ,
)
from dgr_session.faults import FailureReport
from dgr_session.identity import CertificationStatus, EvidenceClass
from dgr_session.manager import SessionHandle, SessionManager, SessionResult
from dgr_session.policy import FailurePolicy, ReplayMode
from dgr_session.route import Route

Layout = tuple[tuple[int, int], ...]
Progress = Callable[[str], None]
CANDIDATE = "candidate"


@attrs.frozen
class Outcome:
    """What one scenario measured and the verdict of its requirement."""

    figures: tuple[Figure, ...]
    requirement: Requirement


def _req(rid: str, ok: bool, detail: str) -> Requirement:
    return Requirement(rid, Verdict.PASS if ok else Verdict.FAIL, detail)


def layout_text(layout: Layout) -> str:
    return " ".join(f"[{a},{b})" for a, b in layout)


class CandidateRoutes:
    """The provider's routes, with each stage's lane stamped as certified by the candidate
    record of ``evidence`` class (see the module's docstring)."""

    def __init__(self, provider: LoopbackRouteProvider, evidence: EvidenceClass) -> None:
        self.provider = provider
        self.evidence = evidence

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        route = await self.provider.assign(session_id, report)
        if route is None:
            return None
        stages = []
        for stage in route.stages:
            lane = attrs.evolve(
                stage.lane,
                certification=CertificationStatus.CERTIFIED,
                evidence=self.evidence,
                record_id=CANDIDATE,
            )
            stages.append(attrs.evolve(stage, lane=lane))
        return Route(stages)


@attrs.frozen
class Reference:
    """The whole model's greedy run of each prompt: tokens and the logits each was chosen
    from."""

    prompts: tuple[tuple[int, ...], ...]
    tokens: tuple[tuple[int, ...], ...]
    logits: tuple[tuple[npt.NDArray[np.float32], ...], ...]


async def run_sessions(
    provider: LoopbackRouteProvider,
    evidence: EvidenceClass,
    prompts: Sequence[Sequence[int]],
    n_tokens: int,
    *,
    deadline: float,
    observer: Callable[[ForwardRecord], None] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    act: Callable[[list[SessionHandle]], None] | None = None,
    seen: Callable[[GrpcStageTransport], None] | None = None,
    ring: Callable[[ChainRecord], None] | None = None,
) -> list[SessionResult]:
    """Greedy route sessions over ``provider`` (one per prompt), concurrently; ``act`` is
    called with their handles once all have started, ``on_token`` with (index, token),
    ``seen`` with the transport they run on. With ``ring``, the sessions run as a ring over
    the fastest data path every stage offers (``docs/chain.md``, ``docs/data-paths.md``) and
    ``ring`` is told of every chained frame; else over the client relay (``observer``).

    A session that re-prefills after a fault replays ``exact`` (the first run's batching:
    the prompt in its chunks, then one forward per accepted token): the scenarios require its
    tokens to equal the whole model's, which only that replay promises. A ``batched`` replay
    computes the accepted tokens as prefill rows, and llama.cpp's kernels round those
    differently from one-row decodes: on Gemma 3 270M that moves logits by up to about 5 and flips a
    greedy token of the certify prompts."""
    policy = FailurePolicy(
        step_deadline=deadline, session_deadline=20 * deadline, replay=ReplayMode.EXACT
    )
    stage_transport = (
        GrpcStageTransport(timeout=deadline, observer=observer)
        if ring is None
        else ChainStageTransport(timeout=deadline, ring=True, chain_observer=ring)
    )
    async with stage_transport as transport:
        if seen is not None:
            seen(transport)
        manager = SessionManager(
            transport,
            CandidateRoutes(provider, evidence),
            policy=policy,
            required_evidence=evidence,
        )
        handles: list[SessionHandle] = []
        for index, prompt in enumerate(prompts):

            def token_hook(token: int, index: int = index) -> None:
                if on_token is not None:
                    on_token(index, token)

            handles.append(manager.start(prompt, max_new_tokens=n_tokens, on_token=token_hook))
        if act is not None:
            act(handles)
        results = [await h.wait() for h in handles]
        await manager.aclose()
    return results


def _reference_stage_io(
    model: Path, layout: Layout, options: EngineOptions, prompt: Sequence[int]
) -> tuple[list[npt.NDArray[np.float32] | None], list[npt.NDArray[np.float32]], list[int]]:
    """Per stage of ``layout`` run in-process: its input rows (``None``: token ids), its
    output rows, and its weight + KV bytes."""
    engines = [ShardEngine(model, layers=r, **options.engine_kwargs()) for r in layout]
    try:
        chain = InProcessRoute(engines)
        chain.open(0, 0)
        tok = np.asarray(prompt, dtype=np.int32)
        positions = np.arange(len(prompt), dtype=np.int32)
        inputs: list[npt.NDArray[np.float32] | None] = []
        outputs: list[npt.NDArray[np.float32]] = []
        rows: npt.NDArray[np.float32] | None = None
        for engine in engines:
            info = engine.info
            inputs.append(None if info.is_first else rows)
            rows = engine.forward(
                0,
                0,
                positions,
                tokens=tok if info.needs_token_ids else None,
                rows=None if info.is_first else rows,
            ).copy()
            outputs.append(rows)
        sizes = [e.stats().weight_bytes + e.stats().kv_bytes for e in engines]
        return inputs, outputs, sizes
    finally:
        for engine in engines:
            engine.close()


async def stage_checks(
    provider: LoopbackRouteProvider,
    model: Path,
    layout: Layout,
    options: EngineOptions,
    reference: Reference,
    session: str,
) -> tuple[bool, bool, str, list[int]]:
    """Chain parity (the client relays the prompt through the workers: the last logits row
    bit-equal to the whole model's) and per-stage independent execution (each worker alone,
    given the in-process reference input of its range, returns bit-equal output). Returns
    (chain ok, per-stage ok, detail, per-stage weight + KV bytes)."""
    prompt = list(reference.prompts[0])
    inputs, outputs, sizes = await asyncio.to_thread(
        _reference_stage_io, model, layout, options, prompt
    )
    workers = [provider.workers[i] for i in range(len(layout))]
    positions = list(range(len(prompt)))
    chain_ok, stage_ok, notes = True, True, []
    rows: npt.NDArray[np.float32] | None = None
    for index, worker in enumerate(workers):
        expect = expectations_of(worker.advert)
        async with ShardClient(worker.endpoint, timeout=30.0) as client:
            for sid, given in ((f"{session}-chain", rows), (f"{session}-alone", inputs[index])):
                await client.open(sid, 0, expect)
                span = worker.advert.span
                result = await client.forward(
                    sid,
                    0,
                    0,
                    expect,
                    positions,
                    tokens=prompt if (span.is_first or span.needs_token_ids) else None,
                    boundary=given,
                )
                await client.close(sid, 0)
                out = np.array(result.output)
                if sid.endswith("chain"):
                    rows = out
                elif not np.array_equal(out, outputs[index]):
                    stage_ok = False
                    notes.append(f"stage {index} alone differs from its in-process reference")
    assert rows is not None
    want = reference.logits[0][0]
    if not np.array_equal(rows[-1], want):
        chain_ok = False
        diff = float(np.max(np.abs(rows[-1] - want)))
        notes.append(f"relayed chain's logits differ from the whole model's (max |d| {diff:.3g})")
    return chain_ok, stage_ok, "; ".join(notes), sizes


def _status_bytes(pid: int, field: str) -> int:
    """``field`` (``VmHWM``, ``VmRSS``) of a live process's ``/proc`` status (Linux), bytes;
    0 where unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def peak_rss_bytes(pid: int) -> int:
    """VmHWM of a live process (Linux), bytes; 0 where unknown."""
    return _status_bytes(pid, "VmHWM")


def steady_rss_bytes(pid: int) -> int:
    """VmRSS of a live process (Linux), bytes; 0 where unknown."""
    return _status_bytes(pid, "VmRSS")


def resources(
    provider: LoopbackRouteProvider, layout: Layout, sizes: Sequence[int], limits: Thresholds
) -> tuple[list[Figure], bool, str]:
    """Each shard's peak RSS (its high-water mark since start: a start-up transient counts)
    against factor x (its weights + KV) + slack; its RSS now beside it."""
    figures, ok, notes = [], True, []
    scenario = f"{len(layout)} stages"
    for index, (worker, size) in enumerate(zip(provider.workers, sizes, strict=False)):
        peak = peak_rss_bytes(worker.pid)
        steady = steady_rss_bytes(worker.pid)
        bound = limits.rss_factor * size + limits.rss_slack_mib * 2**20
        figures.append(Figure(f"rss.peak.stage{index}", peak / 2**20, "MiB", scenario))
        figures.append(Figure(f"rss.steady.stage{index}", steady / 2**20, "MiB", scenario))
        figures.append(Figure(f"rss.bound.stage{index}", bound / 2**20, "MiB", scenario))
        if not 0 < peak <= bound:
            ok = False
            notes.append(f"stage {index} peak {peak / 2**20:.0f} MiB > bound {bound / 2**20:.0f}")
    return figures, ok, "; ".join(notes)


@attrs.frozen
class RpcSide:
    """llama.cpp RPC with the route's split, run beside the route in the speed rounds: the
    ``llama-bench`` process computes the first stage's layers, one ``ggml-rpc-server`` per
    further stage on 127.0.0.1 the rest (:func:`~dgr_engine.tooling.rpc_peer.rpc_split`), every
    process with the route's threads, KV type and flash-attention mode and
    ``OMP_WAIT_POLICY=PASSIVE``."""

    config: PeerConfig
    server: Path
    """The ``ggml-rpc-server`` executable."""
    n_layer: int

    @classmethod
    def of(cls, prefix: Path, model: Path, options: EngineOptions, n_layer: int) -> RpcSide:
        """The peers installed at ``prefix`` (``bin/<tool>``) run with ``options``."""
        config = PeerConfig(
            model=model,
            bench=prefix / "bin" / "llama-bench",
            batched=prefix / "bin" / "llama-batched-bench",
            threads=options.n_threads,
            kv_type=options.kv_type,
            flash_attn=options.flash_attn,
            n_batch=options.n_batch,
        )
        return cls(config, prefix / "bin" / "ggml-rpc-server", n_layer)

    async def decode_tps(
        self, servers: Sequence[RpcEndpoint], n_decode: int, depth: int
    ) -> tuple[float, str | None]:
        """One run: decode tok/s of ``n_decode`` tokens at ``depth``, and what in the peer's
        own report differs from the settings it was given (``None``: nothing)."""
        results = await run_llama_bench_async(
            self.config, [0], n_decode, [depth], servers=servers, n_layer=self.n_layer
        )
        tg = pick(results, 0, n_decode, depth)
        return tg.avg_ts, settings_differ(tg, self.config)


@attrs.frozen
class RpcComparison:
    """One speed layout's routed decode against llama.cpp RPC with the same split."""

    stages: int
    route_tps: float
    """The route's decode tok/s (median over the rounds)."""
    rpc_tps: float | None
    """RPC's decode tok/s (median over the rounds); ``None`` when it could not be measured."""
    error: str = ""
    """Why ``rpc_tps`` is ``None``."""


@attrs.frozen
class Speed:
    """One side-by-side speed measurement."""

    decode_ratio: float
    prefill_ratio: float
    figures: tuple[Figure, ...]
    shares: dict[str, float]
    vs_rpc: RpcComparison | None = None
    """Against llama.cpp RPC, when it was run."""


def judge_vs_rpc(
    comparisons: Sequence[RpcComparison],
    minimum: float,
    *,
    not_measured: str = "",
    how: str = "",
) -> Outcome:
    """``speed.vs_rpc``: pass when the route's decode tok/s is at least ``minimum`` x RPC's at
    every speed layout; not measured when RPC was not run (``not_measured`` says why), when a
    layout's RPC run failed, or when there was no speed layout. Figures per layout:
    ``speed.vs_rpc_decode`` (route/RPC) and ``speed.decode_tps.rpc``."""
    rid = "speed.vs_rpc"
    if not_measured:
        return Outcome((), Requirement(rid, Verdict.NOT_MEASURED, not_measured))
    if not comparisons:
        return Outcome((), Requirement(rid, Verdict.NOT_MEASURED, "no speed layout was run"))
    figures: list[Figure] = []
    parts, failed = [], []
    for c in comparisons:
        scenario = f"{c.stages} stages"
        if c.rpc_tps is None or not c.rpc_tps > 0:
            failed.append(f"{scenario}: {c.error or 'RPC gave no decode figure'}")
            continue
        ratio = c.route_tps / c.rpc_tps
        figures.append(Figure("speed.vs_rpc_decode", ratio, "route/rpc", scenario))
        figures.append(Figure("speed.decode_tps.rpc", c.rpc_tps, "tok/s", scenario))
        parts.append((ratio, f"{scenario} {ratio:.2f} ({c.route_tps:.1f} / {c.rpc_tps:.1f} tok/s)"))
    if failed:
        detail = "llama.cpp RPC could not be measured: " + "; ".join(failed)
        return Outcome(tuple(figures), Requirement(rid, Verdict.NOT_MEASURED, detail))
    ok = all(ratio >= minimum for ratio, _ in parts)
    detail = (
        f"route decode / llama.cpp RPC decode with the same split >= {minimum:g}: "
        + ", ".join(text for _, text in parts)
        + (f" ({how})" if how else "")
    )
    return Outcome(tuple(figures), _req(rid, ok, detail))


def _whole_model_speed(
    model: Path, options: EngineOptions, prompt: Sequence[int], n_decode: int
) -> tuple[float, float]:
    """(prefill seconds, decode seconds per token) of the whole model in-process."""
    with ShardEngine(model, **options.engine_kwargs()) as whole:
        chain = InProcessRoute([whole])
        chain.open(0, 0)
        began = time.perf_counter()
        chunk = options.n_batch  # as a route session feeds its stages: n_batch rows at most
        for start in range(0, len(prompt), chunk):
            logits = chain.forward(0, 0, list(prompt[start : start + chunk]), start)
        prefill = time.perf_counter() - began
        pos = len(prompt)
        began = time.perf_counter()
        for _ in range(n_decode):
            token = int(np.argmax(logits[-1]))
            logits = chain.forward(0, 0, [token], pos)
            pos += 1
        decode = (time.perf_counter() - began) / n_decode
        chain.close(0, 0)
    return prefill, decode


async def speed(
    provider: LoopbackRouteProvider,
    evidence: EvidenceClass,
    model: Path,
    options: EngineOptions,
    prompt: Sequence[int],
    limits: Thresholds,
    n_stages: int,
    rpc: RpcSide | None = None,
) -> Speed:
    """Route against whole model, interleaved rounds: decode and prefill ratios (whole-model
    time over route time: 1.0 is parity, lower is slower), and the per-token breakdown of
    routed decode into engine, worker code, transit and client code. The route runs as users'
    greedy sessions run fastest: a ring over the fastest data path its stages offer (the frame
    link), so its client code is off the critical path (``client`` is 0). With ``rpc``, each round
    also runs llama.cpp RPC with the same split decoding as many tokens at the same depth (the
    prompt's length); its servers are stopped before this returns, whatever happens."""
    n_decode = limits.speed.decode_tokens
    route_prefill, route_decode, whole_prefill, whole_decode = [], [], [], []
    rpc_tps: list[float] = []
    rpc_error = ""
    parts = {"engine": 0.0, "worker": 0.0, "transit": 0.0, "client": 0.0}
    decode_wall_us = 0.0
    with contextlib.ExitStack() as stack:
        servers: list[RpcServer] = []
        if rpc is not None:
            try:
                servers = stack.enter_context(
                    rpc_servers(rpc.server, n_stages - 1, options.n_threads)
                )
            except (RuntimeError, OSError) as exc:
                rpc_error = f"ggml-rpc-server did not start: {str(exc)[:300]}"
        for _ in range(limits.speed.rounds):
            p, d = await asyncio.to_thread(_whole_model_speed, model, options, prompt, n_decode)
            whole_prefill.append(p)
            whole_decode.append(d)
            if rpc is not None and not rpc_error:
                try:
                    tps, differs = await rpc.decode_tps(servers, n_decode, len(prompt))
                except (RuntimeError, ValueError, LookupError, TimeoutError, OSError) as exc:
                    rpc_error = f"llama-bench over RPC failed: {str(exc)[-400:]}"
                else:
                    if differs is not None:
                        rpc_error = f"llama-bench ran with other settings than the route: {differs}"
                    rpc_tps.append(tps)
            records: list[ChainRecord] = []
            stamps: list[float] = []
            began = time.perf_counter()
            await run_sessions(
                provider,
                evidence,
                [prompt],
                n_decode + 1,
                deadline=limits.step_deadline_seconds,
                ring=records.append,
                on_token=lambda _i, _t, s=stamps: s.append(time.perf_counter()),  # type: ignore[misc]
            )
            route_prefill.append(stamps[0] - began)
            decode_s = (stamps[-1] - stamps[0]) / n_decode
            route_decode.append(decode_s)
            decode_wall_us += decode_s * 1e6 * n_decode
            steps = [r for r in records if r.step > 0]
            parts["engine"] += sum(sum(r.compute_us) for r in steps)
            parts["worker"] += sum(sum(r.handler_us) - sum(r.compute_us) for r in steps)
    # a ring's client is off the critical path (the last stage sends the next frame itself, the
    # client reads the logits beside it): what the stages' handlers do not account for is the
    # hops between them
    parts["transit"] = max(0.0, decode_wall_us - parts["engine"] - parts["worker"])
    total = sum(parts.values()) or 1.0
    shares = {k: v / total for k, v in parts.items()}
    decode_ratio = float(np.median(whole_decode) / np.median(route_decode))
    prefill_ratio = float(np.median(whole_prefill) / np.median(route_prefill))
    route_tps = 1.0 / float(np.median(route_decode))
    scenario = f"{n_stages} stages"
    figures = (
        Figure("speed.decode_ratio", decode_ratio, "whole/route", scenario),
        Figure("speed.prefill_ratio", prefill_ratio, "whole/route", scenario),
        Figure("speed.decode_ms.route", 1e3 * float(np.median(route_decode)), "ms/token", scenario),
        Figure("speed.decode_ms.whole", 1e3 * float(np.median(whole_decode)), "ms/token", scenario),
        Figure("speed.prefill_ms.route", 1e3 * float(np.median(route_prefill)), "ms", scenario),
        Figure("speed.prefill_ms.whole", 1e3 * float(np.median(whole_prefill)), "ms", scenario),
        Figure("speed.decode_tps.route", route_tps, "tok/s", scenario),
    )
    vs_rpc = None
    if rpc is not None:
        rpc_median = None if rpc_error or not rpc_tps else float(np.median(rpc_tps))
        vs_rpc = RpcComparison(n_stages, route_tps, rpc_median, rpc_error)
    return Speed(decode_ratio, prefill_ratio, figures, shares, vs_rpc)


def compare(
    results: Sequence[SessionResult], reference: Reference, indices: Sequence[int]
) -> list[int]:
    """Indices among ``indices`` whose session did not end done with the reference tokens."""
    bad = []
    for i in indices:
        r = results[i]
        if r.error is not None or tuple(r.tokens) != reference.tokens[i]:
            bad.append(i)
    return bad


async def isolation(
    provider: LoopbackRouteProvider,
    evidence: EvidenceClass,
    reference: Reference,
    limits: Thresholds,
) -> Outcome:
    """Concurrent sessions; mid-decode, session 0 is cancelled and session 1's state is killed
    on every stage (closed under it with its own secret, as a worker that lost it would: its
    next frame finds nothing, so it must re-prefill alone; no other client may close it).
    Every other session's tokens must equal the whole model's, and session 1 must still end
    with them."""
    n = len(reference.prompts)
    half = max(1, limits.isolation_tokens // 2)
    handles: list[SessionHandle] = []
    kills: list[asyncio.Task[None]] = []
    transports: list[GrpcStageTransport] = []

    def on_token(index: int, _token: int) -> None:
        if index != 0 or kills or len(handles[0].tokens) < half:
            return
        handles[0].cancel("certification: cancelled mid-decode")
        victim = handles[1]
        route = victim.core.route
        assert route is not None  # it is decoding
        kills.append(
            asyncio.ensure_future(
                _close_under(transports[0], route, victim.session_id, victim.core.epoch)
            )
        )

    results = await run_sessions(
        provider,
        evidence,
        reference.prompts,
        limits.isolation_tokens,
        deadline=limits.step_deadline_seconds,
        on_token=on_token,
        act=handles.extend,
        seen=transports.append,
    )
    for kill in kills:
        await kill
    bad = compare(results, reference, range(1, n))
    cancelled = results[0].state.value == "cancelled"
    ok = not bad and cancelled and bool(kills) and results[1].route_changes >= 1
    victim = results[1]
    ended = victim.state.value if victim.error is None else f"{victim.state.value}: {victim.error}"
    detail = (
        f"{n} concurrent sessions; session 0 cancelled at {half} tokens "
        f"({'cancelled' if cancelled else results[0].state.value}), session 1's stage state "
        f"killed (route changes {victim.route_changes}, {len(victim.tokens)} tokens, "
        f"{ended[:300]}); sessions with tokens not equal to the whole model's: {bad or 'none'}"
    )
    figures = (
        Figure("isolation.sessions", float(n), "sessions", "2 stages"),
        Figure("isolation.mismatched", float(len(bad)), "sessions", "2 stages"),
    )
    return Outcome(figures, _req("isolation.sessions", ok, detail))


async def _close_under(
    transport: GrpcStageTransport, route: Route, session_id: str, epoch: int
) -> None:
    for stage in route.stages:
        # the session's own client (it holds the secret); the session is not told
        secret = transport.client(stage.endpoint).session_secret(session_id, epoch)
        async with ShardClient(stage.endpoint, timeout=5.0) as other:  # loopback workers
            try:
                await other.close(session_id, epoch, secret=secret)
            except ShardError:  # the session may be gone already: that is fine
                pass


async def bounded_failure(
    provider: LoopbackRouteProvider,
    evidence: EvidenceClass,
    reference: Reference,
    limits: Thresholds,
    lose_stage: int,
) -> Outcome:
    """One session; its stage ``lose_stage`` is SIGKILLed mid-decode. The session must end
    with the whole model's tokens, within the locked route changes, and its next token must
    come within the locked recovery time of the kill."""
    half = max(1, limits.isolation_tokens // 2)
    times: list[float] = []
    killed: list[float] = []
    handles: list[SessionHandle] = []

    def on_token(_index: int, _token: int) -> None:
        times.append(time.perf_counter())
        route = handles[0].core.route
        if len(times) == half and not killed and route is not None:
            provider.kill(route.stages[lose_stage].endpoint)
            killed.append(time.perf_counter())

    one = Reference(reference.prompts[:1], reference.tokens[:1], reference.logits[:1])
    results = await run_sessions(
        provider,
        evidence,
        one.prompts,
        limits.isolation_tokens,
        deadline=limits.step_deadline_seconds,
        on_token=on_token,
        act=handles.extend,
    )
    result = results[0]
    after = [t for t in times if killed and t > killed[0]]
    recovery = (after[0] - killed[0]) if after else float("inf")
    equal = not compare(results, one, [0])
    ok = (
        bool(killed)
        and equal
        and 1 <= result.route_changes <= limits.max_route_changes
        and recovery <= limits.recovery_max_seconds
    )
    detail = (
        f"stage {lose_stage} SIGKILLed at token {half}: next token {recovery:.2f} s later "
        f"(bound {limits.recovery_max_seconds:g} s), route changes {result.route_changes} "
        f"(bound {limits.max_route_changes}), tokens equal to the whole model's: {equal}"
    )
    figures = (
        Figure("failure.recovery_s", recovery, "s", f"stage {lose_stage} lost"),
        Figure("failure.route_changes", float(result.route_changes), "changes", ""),
    )
    return Outcome(figures, _req("failure.bounded", ok, detail))
