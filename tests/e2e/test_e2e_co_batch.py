"""Co-batching workers end to end (issue 15 part 2): a route of ``dgr worker --batching
co-batch`` processes serving concurrent sessions runs several sessions' frames in one engine
call, every session's tokens equal the whole model's, the lane says so, and a stage lost under
co-batched sessions is recovered like any other."""

from __future__ import annotations

import asyncio
from pathlib import Path

import attrs
import pytest

from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.record import load_evidence
from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.shard_client import ShardClient
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_greedy
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    SessionManager,
    SessionResult,
    SessionState,
)
from tests.worker.test_metrics import count, scrape

pytestmark = pytest.mark.usefixtures("certified_co_batch")

# dgr certify's default options (the lane the suite certifies), co-batching
OPTIONS = EngineOptions(
    n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=8, batching="co-batch"
)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 4, 1, 4, 2, 1, 3], [1, 7, 3, 2]]
N_NEW = 10


def run_sessions(
    provider: LoopbackRouteProvider, *, kill_at: int | None = None
) -> tuple[list[SessionResult], dict[str, dict]]:
    """The prompts as concurrent sessions on the provider's route; with ``kill_at``, the last
    stage is SIGKILLed once session 0 accepted that many tokens. Returns the results and each
    surviving worker's metrics, scraped before the workers stop."""

    async def scenario() -> tuple[list[SessionResult], dict[str, dict]]:
        async with provider, GrpcStageTransport(timeout=20.0) as transport:
            manager = SessionManager(
                transport,
                provider,
                policy=FailurePolicy(step_deadline=20.0),
                required_evidence=EvidenceClass.FIXTURE,
            )
            handles = []

            def on_token(_token: int) -> None:
                route = handles[0].core.route
                if kill_at is not None and len(handles[0].tokens) == kill_at and route:
                    if not provider.reports:
                        provider.kill(route.stages[-1].endpoint)

            for index, prompt in enumerate(PROMPTS):
                hook = on_token if index == 0 else None
                handles.append(manager.start(prompt, max_new_tokens=N_NEW, on_token=hook))
            results = list(await asyncio.gather(*(h.wait() for h in handles)))
            await manager.aclose()
            metrics = {
                w.endpoint: scrape(w) for w in provider.workers if w.process.proc.poll() is None
            }
            return results, metrics

    return asyncio.run(asyncio.wait_for(scenario(), 180.0))


def test_co_batched_route_matches_the_whole_model(tiny_llama: Path) -> None:
    provider = LoopbackRouteProvider(
        tiny_llama,
        [(0, 2), (2, 4)],
        options=OPTIONS,
        # a bounded wait to fill each call: the sessions' frames meet whatever the timing
        worker_args=["--metrics-port", "0", "--co-batch-wait-ms", "200"],
    )
    results, metrics = run_sessions(provider)
    expected = whole_model_greedy(tiny_llama, PROMPTS, N_NEW, OPTIONS)
    for result, tokens in zip(results, expected, strict=True):
        assert result.state is SessionState.DONE and list(result.tokens) == tokens
    for samples in metrics.values():
        calls = count(samples, "dgr_worker_frames_per_engine_call_count")
        frames = count(samples, "dgr_worker_frames_per_engine_call_sum")
        # every frame ran in a co-batched call, and calls carried several sessions' frames
        kinds = ("prefill", "decode")
        forwards = sum(count(samples, "dgr_worker_forwards_total", kind=k) for k in kinds)
        assert frames == forwards and calls < frames, (calls, frames)
        info = next(dict(k[1]) for k in samples if k[0] == "dgr_worker_info")
        assert info["batching"] == "co-batch"


def test_co_batched_lane_is_its_own_certified_lane(
    tiny_llama: Path, certified_co_batch: Path
) -> None:
    """The advert of a co-batching worker names another lane than the same worker without it,
    and each is certified by its own record, made by ``dgr certify --batching co-batch``."""
    loaded = load_evidence(certified_co_batch, load_lock())
    assert not loaded.refused
    lanes = sorted((r.family, r.lane.batching) for r in loaded.records)
    assert lanes == [("dense", "co-batch"), ("dense", "session"), ("v4", "session")]
    co_batched = next(r for r in loaded.records if r.lane.batching == "co-batch")
    assert co_batched.command[-2:] == ("--batching", "co-batch")

    async def adverts() -> list[tuple[str, str]]:
        lanes = []
        for options in (OPTIONS, attrs.evolve(OPTIONS, batching="session")):
            provider = LoopbackRouteProvider(tiny_llama, [(0, 4)], options=options)
            async with provider:
                async with ShardClient(provider.workers[0].endpoint, timeout=10.0) as client:
                    advert = await client.describe()
            lanes.append((advert.lane.lane_id, advert.lane.certification.value))
        return lanes

    (co_batch, co_cert), (session, cert) = asyncio.run(asyncio.wait_for(adverts(), 120.0))
    assert co_batch != session
    assert co_cert == cert == "certified"


def test_a_stage_lost_under_co_batched_sessions_is_recovered(tiny_llama: Path) -> None:
    provider = LoopbackRouteProvider(
        tiny_llama,
        [(0, 2), (2, 4)],
        spares=[(2, 4)],
        options=OPTIONS,
        worker_args=["--metrics-port", "0"],
    )
    results, _ = run_sessions(provider, kill_at=4)
    expected = whole_model_greedy(tiny_llama, PROMPTS, N_NEW, OPTIONS)
    assert sum(r.route_changes for r in results) >= 1
    for result, tokens in zip(results, expected, strict=True):
        assert result.state is SessionState.DONE and list(result.tokens) == tokens


def test_a_native_ring_of_co_batching_workers_matches_the_whole_model(tiny_llama: Path) -> None:
    """Greedy rings take native links on co-batching workers too: each worker's links run in
    one co-batching group (``dgr_link_batch``, the lane's rule for rows a call), and every
    concurrent session's tokens equal the whole model's."""
    provider = LoopbackRouteProvider(tiny_llama, [(0, 2), (2, 4)], options=OPTIONS)

    async def scenario() -> tuple[list[SessionResult], int]:
        transport = ChainStageTransport(timeout=20.0, ring=True, data_path="native")
        async with provider, transport:
            manager = SessionManager(
                transport,
                provider,
                policy=FailurePolicy(step_deadline=20.0),
                required_evidence=EvidenceClass.FIXTURE,
            )
            handles = [manager.start(p, max_new_tokens=N_NEW) for p in PROMPTS]
            results = list(await asyncio.gather(*(h.wait() for h in handles)))
            await manager.aclose()
            return results, transport.chain_stats.native_epochs

    results, native_epochs = asyncio.run(asyncio.wait_for(scenario(), 180.0))
    expected = whole_model_greedy(tiny_llama, PROMPTS, N_NEW, OPTIONS)
    for result, tokens in zip(results, expected, strict=True):
        assert result.state is SessionState.DONE and list(result.tokens) == tokens
    assert native_epochs == len(PROMPTS)
