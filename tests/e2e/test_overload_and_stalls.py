"""Overload and stalls over real ``dgr worker`` processes on 127.0.0.1 (issue 12, items 1-2).

* More sessions than slots: the extra sessions wait their turn (admission), never spend their
  failure budget, and no healthy worker is excluded.
* A stalled stage (SIGSTOP past the step deadline, then SIGCONT) gets every slot back: by the
  client's background close retries while the client lives, by the worker's stall rule when
  the client is gone.

Tokens are compared with the whole model in-process; every wait is bounded (policy deadlines,
call deadlines, ``run``'s limit, polling with a deadline); the provider stops every process.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.routes import describe
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_reference
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    SessionHandle,
    SessionManager,
    SessionResult,
    SessionState,
)
from tests import harness

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("certified_fixtures")]

T = TypeVar("T")
N_TOKENS = 12
ONE_SLOT = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=1)
FOUR_SLOTS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
PROMPTS = [
    [int(t) for t in np.random.default_rng(100 + seed).integers(0, 256, size=10)]
    for seed in range(4)
]


def run(coro: Coroutine[Any, Any, T], limit: float = 120.0) -> T:
    return harness.run(coro, limit)


@pytest.fixture(scope="module")
def want(tiny_llama: Path) -> list[list[int]]:
    return [tokens for tokens, _ in whole_model_reference(tiny_llama, PROMPTS, N_TOKENS, ONE_SLOT)]


async def sessions_open(endpoint: str) -> int:
    return (await describe(endpoint, timeout=5.0)).capacity.sessions_open


async def wait_until_free(endpoints: Sequence[str], limit: float) -> dict[str, int]:
    """Polls the adverts until no endpoint holds a session or ``limit`` s pass; returns the
    last counts."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while True:
        counts = {e: await sessions_open(e) for e in endpoints}
        if not any(counts.values()) or loop.time() >= end:
            return counts
        await asyncio.sleep(0.1)


def start_all(manager: SessionManager, prefix: str) -> list[SessionHandle]:
    return [
        manager.start(prompt, max_new_tokens=N_TOKENS, session_id=f"{prefix}-{i}")
        for i, prompt in enumerate(PROMPTS)
    ]


def assert_exact(results: Sequence[SessionResult], want: list[list[int]]) -> None:
    for result, tokens in zip(results, want, strict=True):
        assert result.state is SessionState.DONE, result.error
        assert list(result.tokens) == tokens


# --- more sessions than slots ------------------------------------------------------------------


@pytest.mark.parametrize("admission_wait", ["5", "0"], ids=["queued", "busy-at-once"])
def test_more_sessions_than_slots_wait_their_turn_and_nobody_is_blamed(
    tiny_llama: Path, want: list[list[int]], admission_wait: str
) -> None:
    provider = LoopbackRouteProvider(
        tiny_llama,
        ((0, 2), (2, 4)),
        options=ONE_SLOT,
        worker_args=["--admission-wait", admission_wait],
    )
    # the failure budget is tight on purpose: busy answers must not spend it
    policy = FailurePolicy(max_attempts_per_step=1, max_route_changes=0, admission_budget=60.0)

    async def main() -> tuple[list[SessionResult], SessionResult, dict[str, int]]:
        await provider.start()
        try:
            async with GrpcStageTransport(timeout=10.0) as transport:
                manager = SessionManager(
                    transport, provider, policy=policy, required_evidence=EvidenceClass.FIXTURE
                )
                results = [await h.wait() for h in start_all(manager, f"busy{admission_wait}")]
                fresh = await manager.start(
                    PROMPTS[0], max_new_tokens=N_TOKENS, session_id="fresh"
                ).wait()
                await manager.aclose()
                counts = await wait_until_free([w.endpoint for w in provider.workers], 10.0)
        finally:
            await provider.aclose()
        return results, fresh, counts

    results, fresh, counts = run(main())
    assert_exact([*results, fresh], [*want, want[0]])
    busy_reports = [r for result in results for r in result.reports]
    assert all(r.fault is FaultKind.BUSY for r in busy_reports), busy_reports
    assert all(result.route_changes == 0 for result in results)
    if admission_wait == "0":
        assert busy_reports, "with no admission wait, 4 sessions over 1 slot must meet busy"
    assert [w.excluded for w in provider.workers] == [None, None]
    assert counts == dict.fromkeys(counts, 0)


def test_admission_budget_spent_fails_typed_and_blames_nobody(tiny_llama: Path) -> None:
    """A slot held for ever (a session that never ends within the test): the waiting session
    fails with AdmissionTimeout once its admission budget is spent, within the bound."""
    provider = LoopbackRouteProvider(
        tiny_llama, ((0, 4),), options=ONE_SLOT, worker_args=["--admission-wait", "0.2"]
    )

    async def main() -> tuple[SessionResult, float]:
        await provider.start()
        try:
            async with GrpcStageTransport(timeout=10.0) as transport:
                (worker,) = provider.workers
                stage = worker.stage
                await transport.open(stage, "holder", 1)  # takes the only slot, never closes
                manager = SessionManager(
                    transport,
                    provider,
                    policy=FailurePolicy(admission_budget=1.5),
                    required_evidence=EvidenceClass.FIXTURE,
                )
                loop = asyncio.get_running_loop()
                began = loop.time()
                result = await manager.start(PROMPTS[0], max_new_tokens=2).wait()
                took = loop.time() - began
                await transport.close(stage, "holder", 1)
                await manager.aclose()
        finally:
            await provider.aclose()
        return result, took

    result, took = run(main())
    assert result.state is SessionState.FAILED
    assert type(result.error).__name__ == "AdmissionTimeout"
    assert result.error is not None and "admission budget" in str(result.error)
    assert {r.fault for r in result.reports} == {FaultKind.BUSY}
    assert result.route_changes == 0
    assert 1.5 <= took < 1.5 + 5.0  # loose upper bound: a loaded 2-core box
    assert provider.workers[0].excluded is None


# --- a stalled stage ---------------------------------------------------------------------------


@pytest.mark.parametrize("client", ["alive", "gone"])
def test_a_stalled_stage_gets_every_slot_back(
    tiny_llama: Path, want: list[list[int]], client: str
) -> None:
    layout = ((0, 1), (1, 3), (3, 4))
    provider = LoopbackRouteProvider(
        tiny_llama,
        layout,
        spares=[(1, 3)],
        options=FOUR_SLOTS,
        worker_args=["--stall-seconds", "1", "--resume-grace", "1"],
    )
    policy = FailurePolicy(step_deadline=1.5, backoff=(0.0,))

    async def main() -> tuple[list[SessionResult], str, dict[str, int], int]:
        await provider.start()
        stalled: list[str] = []
        try:
            transport = GrpcStageTransport(timeout=5.0, close_timeout=0.3)
            manager = SessionManager(
                transport, provider, policy=policy, required_evidence=EvidenceClass.FIXTURE
            )
            handles = start_all(manager, f"stall-{client}")

            async def stall_when_decoding() -> None:
                loop = asyncio.get_running_loop()
                end = loop.time() + 30.0
                while len(handles[0].tokens) < 4 and loop.time() < end:
                    await asyncio.sleep(0.01)
                route = handles[0].core.route
                assert route is not None
                stalled.append(route.stages[1].endpoint)
                provider.suspend(stalled[0])

            await stall_when_decoding()
            results = [await h.wait() for h in handles]
            await manager.aclose()
            pending = transport.pending_closes
            if client == "gone":
                await transport.aclose()  # nobody will retry: the worker's stall rule must
            worker = provider.worker(stalled[0])
            worker.process.proc.send_signal(signal.SIGCONT)
            counts = await wait_until_free([w.endpoint for w in provider.workers], 15.0)
            if client == "alive":
                await transport.aclose()
        finally:
            await provider.aclose()
        return results, stalled[0], counts, pending

    results, stalled, counts, pending = run(main())
    assert_exact(results, want)
    assert any(r.endpoint == stalled for result in results for r in result.reports)
    assert pending > 0  # closes to the stopped worker timed out and were being retried
    assert counts[stalled] == 0, counts
    assert counts == dict.fromkeys(counts, 0)
