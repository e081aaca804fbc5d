"""End to end: route sessions in the SessionManager over gRPC workers on 127.0.0.1.

Real ``dgr worker`` processes (one engine thread each), GrpcStageTransport, the loopback route
provider; tokens compared with the whole model run in-process with the same engine options.
Faults are real: SIGKILL (a crash), SIGSTOP (a hung stage), every worker of a range gone.
Every wait is bounded (policy deadlines, call deadlines, ``run``'s limit, process timeouts);
the provider stops every process it started in teardown (SIGCONT first for a stopped one).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np
import pytest

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_reference
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    NoRouteAvailable,
    SessionHandle,
    SessionManager,
    SessionResult,
    SessionState,
)
from tests.harness import run
from tests.recorder import LogitsRecorder

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("certified_fixtures")]

T = TypeVar("T")
N_TOKENS = 16
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
PROMPTS = [
    [int(t) for t in np.random.default_rng(seed).integers(0, 256, size=12)] for seed in range(3)
]


Reference = list[tuple[list[int], list[np.ndarray]]]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> Reference:
    """Per prompt: the whole model's tokens and the logits row of each step."""
    return whole_model_reference(tiny_llama, PROMPTS, N_TOKENS, OPTIONS)


def assert_bit_exact(recorder: LogitsRecorder, want: list[np.ndarray]) -> None:
    assert recorder.steps == list(range(len(want)))  # each step sampled once, replays never
    for step, row in enumerate(want):
        assert np.array_equal(recorder.logits[step], row), f"logits differ at step {step}"


def assert_exact_until(recorder: LogitsRecorder, want: list[np.ndarray], step: int) -> float:
    """Bit for bit before ``step`` (the first run); after it (a batched replay's KV) close;
    returns the largest difference there."""
    assert recorder.steps == list(range(len(want)))
    for before in range(step):
        assert np.array_equal(recorder.logits[before], want[before]), f"step {before} differs"
    after = range(step, len(want))
    worst = max(float(np.max(np.abs(recorder.logits[s] - want[s]))) for s in after)
    assert worst < 1e-2, f"logits after the batched replay differ by {worst}"  # f16 KV
    return worst


@attrs.define
class Outcome:
    results: list[SessionResult]
    handles: list[SessionHandle]
    recorders: list[LogitsRecorder]
    provider: LoopbackRouteProvider
    transport_stats: dict[str, Any]
    marks: dict[str, float]


async def drive(
    provider: LoopbackRouteProvider,
    prompts: Sequence[Sequence[int]],
    *,
    policy: FailurePolicy,
    fault: Callable[[LoopbackRouteProvider, SessionHandle], str] | None = None,
    at_step: int = 0,
    call_timeout: float = 10.0,
    close_timeout: float = 2.0,
) -> Outcome:
    """Runs one session per prompt; ``fault(provider, session 0)`` is called once session 0
    has accepted ``at_step`` tokens (its loop time is ``marks['fault']``)."""
    marks: dict[str, float] = {}
    handles: list[SessionHandle] = []
    recorders = [LogitsRecorder(len(p)) for p in prompts]

    def on_token(token: int) -> None:
        if fault is not None and "fault" not in marks and len(handles[0].tokens) == at_step:
            marks["fault"] = asyncio.get_running_loop().time()
            fault(provider, handles[0])

    await provider.start()
    try:
        transport = GrpcStageTransport(timeout=call_timeout, close_timeout=close_timeout)
        async with transport:
            manager = SessionManager(
                transport, provider, policy=policy, required_evidence=EvidenceClass.FIXTURE
            )
            for i, prompt in enumerate(prompts):
                handles.append(
                    manager.start(
                        prompt,
                        max_new_tokens=N_TOKENS,
                        session_id=f"e2e-{i}",
                        on_token=on_token if i == 0 else None,
                        sampler=recorders[i],
                    )
                )
            results = [await h.wait() for h in handles]
            await manager.aclose()
            stats = transport.stats()
    finally:
        await provider.aclose()
    return Outcome(results, handles, recorders, provider, stats, marks)


def stage_of(index: int) -> Callable[[SessionHandle], str]:
    def endpoint(handle: SessionHandle) -> str:
        route = handle.core.route
        assert route is not None
        return route.stages[index].endpoint

    return endpoint


def assert_not_running(provider: LoopbackRouteProvider) -> None:
    for worker in provider.workers:
        assert not worker.running, f"{worker} still running"


# --- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    [((0, 2), (2, 4)), ((0, 1), (1, 2), (2, 3), (3, 4))],
    ids=["2-stages", "4-stages"],
)
def test_parity_through_the_manager_and_grpc(
    tiny_llama: Path, reference: Reference, layout: tuple[tuple[int, int], ...]
) -> None:
    provider = LoopbackRouteProvider(tiny_llama, layout, options=OPTIONS)
    out = run(drive(provider, PROMPTS, policy=FailurePolicy(step_deadline=10.0)))
    for result, recorder, (tokens, logits) in zip(
        out.results, out.recorders, reference, strict=True
    ):
        assert result.state is SessionState.DONE, result.error
        assert list(result.tokens) == tokens
        assert_bit_exact(recorder, logits)
        assert (result.epoch, result.route_changes, result.reports) == (1, 0, ())
    # every stage saw every session's prefill and each decode step, nothing else
    rows = len(PROMPTS) * (len(PROMPTS[0]) + N_TOKENS - 1)
    assert [s.rows for s in out.transport_stats.values()] == [rows] * len(layout)
    assert_not_running(provider)


# --- a stage lost mid-decode -------------------------------------------------------------------


@pytest.mark.parametrize("replay", ["exact", "batched"])
def test_sigkill_of_a_middle_stage_mid_decode_recovers_at_the_next_epoch(
    tiny_llama: Path, reference: Reference, replay: str
) -> None:
    layout = ((0, 1), (1, 3), (3, 4))
    provider = LoopbackRouteProvider(tiny_llama, layout, spares=[(1, 3)], options=OPTIONS)
    killed: list[str] = []

    def kill(p: LoopbackRouteProvider, session: SessionHandle) -> str:
        endpoint = stage_of(1)(session)
        p.kill(endpoint)
        killed.append(endpoint)
        return endpoint

    policy = FailurePolicy(replay=replay)
    out = run(drive(provider, PROMPTS, policy=policy, fault=kill, at_step=6))
    spare = next(w for w in provider.workers if w.role == "spare")
    assert killed and killed[0] != spare.endpoint
    assert provider.worker(killed[0]).process.proc.returncode == -signal.SIGKILL
    for result, handle, recorder, (tokens, logits) in zip(
        out.results, out.handles, out.recorders, reference, strict=True
    ):
        assert result.state is SessionState.DONE, result.error
        assert list(result.tokens) == tokens
        if replay == "exact":
            # bit for bit, also after the re-prefill (the prompt in one call, then the accepted
            # tokens one per call, as the first epoch fed them, pipelined across the stages)
            assert_bit_exact(recorder, logits)
        else:  # prompt + accepted tokens at once: the same tokens, logits close after the loss
            assert_exact_until(recorder, logits, result.reports[0].step)
        assert (result.epoch, result.route_changes) == (2, 1)  # first route: epoch 1
        (report,) = result.reports
        assert (report.epoch, report.stage_index, report.endpoint) == (1, 1, killed[0])
        assert report.fault is FaultKind.DEAD
        assert handle.core.route is not None
        assert handle.core.route.endpoints[1] == spare.endpoint  # the replacement worker
    # the re-prefill of session 0 went through the spare: prompt + 6 accepted tokens from 0
    assert out.transport_stats[spare.endpoint].forwards > 0
    assert_not_running(provider)


def test_a_hung_stage_meets_the_step_deadline_and_the_session_moves_on(
    tiny_llama: Path, reference: Reference
) -> None:
    layout = ((0, 1), (1, 3), (3, 4))
    provider = LoopbackRouteProvider(tiny_llama, layout, spares=[(1, 3)], options=OPTIONS)
    hung: list[str] = []

    def suspend(p: LoopbackRouteProvider, session: SessionHandle) -> str:
        endpoint = stage_of(1)(session)
        p.suspend(endpoint)
        hung.append(endpoint)
        return endpoint

    policy = FailurePolicy(step_deadline=1.0, backoff=(0.0,), replay="exact")
    # the transport's own call deadline is longer: the session's step deadline decides; the
    # close of the hung epoch is abandoned after close_timeout
    out = run(
        drive(
            provider,
            PROMPTS[:1],
            policy=policy,
            fault=suspend,
            at_step=5,
            call_timeout=5.0,
            close_timeout=0.3,
        )
    )
    (result,) = out.results
    assert result.state is SessionState.DONE, result.error
    assert list(result.tokens) == reference[0][0]
    assert_bit_exact(out.recorders[0], reference[0][1])
    assert (result.epoch, result.route_changes) == (2, 1)
    (report,) = result.reports
    assert (report.fault, report.endpoint, report.step) == (FaultKind.DEADLINE, hung[0], 5)
    assert (
        policy.step_deadline <= report.waited < policy.step_deadline + 5.0
    )  # loose: a loaded 2-core box
    assert out.handles[0].core.route is not None
    assert hung[0] not in out.handles[0].core.route.endpoints
    assert_not_running(provider)  # the stopped worker was resumed and stopped


def test_all_routes_gone_fails_typed_within_the_policy_bound(
    tiny_llama: Path, reference: Reference
) -> None:
    provider = LoopbackRouteProvider(tiny_llama, ((0, 2), (2, 4)), options=OPTIONS)
    policy = FailurePolicy(
        step_deadline=2.0, max_attempts_per_step=3, max_route_changes=3, backoff=(0.05, 0.1)
    )
    killed: list[str] = []

    def kill(p: LoopbackRouteProvider, session: SessionHandle) -> str:
        killed.append(p.kill(stage_of(1)(session)).endpoint)
        return killed[-1]

    out = run(drive(provider, PROMPTS[:1], policy=policy, fault=kill, at_step=4))
    (result,) = out.results
    (handle,) = out.handles
    assert result.state is SessionState.FAILED
    error = result.error
    assert isinstance(error, NoRouteAvailable)
    assert error.attempts == policy.max_attempts_per_step
    assert error.fault is FaultKind.NO_ROUTE and error.step == 4
    assert [r.fault for r in result.reports] == [
        FaultKind.DEAD,
        FaultKind.NO_ROUTE,
        FaultKind.NO_ROUTE,
    ]
    # with no spare left, the final error still names the stage that died, and how (issue 28)
    assert error.lost is result.reports[0]
    assert (error.lost.stage_index, error.lost.endpoint) == (1, killed[0])
    assert error.lost.fault is FaultKind.DEAD and error.lost.epoch == 1
    assert f"the route was lost at stage 1 ({killed[0]}), epoch 1: dead (" in str(error)
    assert list(result.tokens) == reference[0][0][:4]
    # loop time from the kill to the end: the backoffs, and never more than the policy allows
    assert handle.core.ended_at is not None
    elapsed = handle.core.ended_at - out.marks["fault"]
    backoffs = sum(policy.backoff_after(k) for k in range(1, policy.max_attempts_per_step))
    assert backoffs <= elapsed <= backoffs + policy.max_attempts_per_step * policy.step_deadline
    assert_not_running(provider)
