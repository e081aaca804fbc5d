"""The asyncio SessionManager over the fake transport, on virtual time (no sleeps)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from dgr_session import (
    Boundary,
    DarkLane,
    DgrError,
    EvidenceClass,
    FailureBudgetExhausted,
    FailurePolicy,
    FaultKind,
    FinishReason,
    Forward,
    InvalidIdentifier,
    Logits,
    NoRouteAvailable,
    RequestRefused,
    Route,
    RouteProvider,
    RouteRefused,
    Sampling,
    SessionCancelled,
    SessionDeadlineExceeded,
    SessionManager,
    SessionState,
    StageDead,
    StageResult,
    StageUnreachable,
    StaleEpoch,
    StepDeadlineExceeded,
    fault_kind,
    greedy,
)
from dgr_session.testing import (
    HANG,
    FakeModel,
    FakeTransport,
    PoolRouteProvider,
    ScriptedRouteProvider,
    VirtualClockLoop,
    fixture_identity,
    fixture_lane,
    make_route,
    run_virtual,
    settle,
)
from tests.reference_sampler import DocumentedSampler

MODEL = FakeModel(n_layer=6, vocab=32)
IDENTITY = fixture_identity(MODEL.n_layer)
POLICY = FailurePolicy(
    step_deadline=2.0,
    session_deadline=60.0,
    max_route_changes=3,
    max_attempts_per_step=3,
    backoff=(0.0, 0.5),
)
PROMPT = (3, 1, 4, 1, 5)


def route(endpoints: Sequence[str], cuts: Sequence[int]) -> Route:
    return make_route(list(endpoints), list(cuts), identity=IDENTITY)


def fixture_manager(
    transport: FakeTransport, provider: RouteProvider, **kwargs: Any
) -> SessionManager:
    """A manager whose routes may run on fixture lanes (certified with fixture evidence)."""
    return SessionManager(transport, provider, required_evidence=EvidenceClass.FIXTURE, **kwargs)


def forwards(
    transport: FakeTransport, endpoint: str, session_id: str
) -> list[tuple[int, range, tuple[int, ...]]]:
    return [
        (c.epoch, c.positions, c.token_ids)  # type: ignore[misc]
        for c in transport.calls
        if c.op == "forward" and c.endpoint == endpoint and c.session_id == session_id
    ]


def test_fault_free_tokens_equal_the_whole_model_reference() -> None:
    transport = FakeTransport(MODEL, record=True)
    provider = ScriptedRouteProvider([route(["a", "b", "c"], [1, 4])])

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=POLICY)
        result = await manager.start(PROMPT, max_new_tokens=6, session_id="s").wait()
        assert result.state is SessionState.DONE and result.reason is FinishReason.LENGTH
        assert result.tokens == MODEL.reference(PROMPT, 6)
        assert (result.epoch, result.route_changes, result.stale_events_dropped) == (1, 0, 0)
        assert len(manager) == 0
        await settle()  # let the fire-and-forget closes run
        assert transport.slots() == {}
        assert asyncio.get_running_loop().time() == 0.0  # nothing waited on a timer

    run_virtual(main)
    assert transport.violations == []
    # stage c saw the prefill then one position per token, contiguous
    assert [p for _, p, _ in forwards(transport, "c", "s")] == [range(0, 5)] + [
        range(p, p + 1) for p in range(5, 10)
    ]


def test_by_default_fixture_lanes_are_refused_and_the_session_fails() -> None:
    transport = FakeTransport(MODEL, record=True)
    provider = ScriptedRouteProvider([route(["a", "b"], [3])])

    async def main() -> None:
        manager = SessionManager(transport, provider, policy=POLICY)  # requires real-hardware
        result = await manager.start(PROMPT, max_new_tokens=2, session_id="f").wait()
        assert result.state is SessionState.FAILED and result.tokens == ()
        assert result.reports
        for report in result.reports:
            assert report.fault is FaultKind.ROUTE_INVALID
            assert (report.stage_index, report.endpoint) == (0, "a")
            assert "fixture" in report.detail and "real-hardware" in report.detail

    run_virtual(main)
    assert transport.calls == []  # refused before any traffic


def test_many_sessions_run_concurrently_and_stay_isolated() -> None:
    transport = FakeTransport(MODEL)
    provider = PoolRouteProvider(
        transport, ["w0", "w1", "w2", "w3"], [(2,), (1, 3), (5,), (2, 3, 4)], identity=IDENTITY
    )
    prompts = [tuple((i * 7 + k) % 32 for k in range(1 + i % 5)) for i in range(40)]

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=POLICY)
        handles = [
            manager.start(p, max_new_tokens=5, session_id=f"s{i}") for i, p in enumerate(prompts)
        ]
        assert len(manager) == 40
        results = await asyncio.gather(*(h.wait() for h in handles))
        for prompt, result in zip(prompts, results, strict=True):
            assert result.tokens == MODEL.reference(prompt, 5)
        await settle()
        assert transport.slots() == {}

    run_virtual(main)


@pytest.mark.parametrize("replay", ["exact", "batched"])
def test_petals_case_replacement_stage_gets_the_whole_replay_from_position_zero(
    replay: str,
) -> None:
    policy = attrs.evolve(POLICY, replay=replay)
    transport = FakeTransport(MODEL, record=True)
    first = route(["a", "b"], [3])
    second = route(["a", "c"], [3])
    provider = ScriptedRouteProvider([first, second])

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=policy)
        accepted: list[int] = []
        sampled: list[int] = []

        def on_token(token: int) -> None:
            accepted.append(token)
            if len(accepted) == 3:
                transport.kill("b")

        class Counting:  # a sampler of the caller's own: the manager calls it on the logits
            sampling = None

            def __call__(self, logits: Any, position: int, history: Any = ()) -> int:
                sampled.append(position - len(PROMPT))
                return greedy(logits, position)

        sampler = Counting()

        result = await manager.start(
            PROMPT, max_new_tokens=6, session_id="p", on_token=on_token, sampler=sampler
        ).wait()
        assert sampled == [0, 1, 2, 3, 4, 5]  # once per token: replayed steps are not sampled
        assert result.state is SessionState.DONE
        assert result.tokens == MODEL.reference(PROMPT, 6)
        assert result.epoch == 2 and result.route_changes == 1
        (report,) = result.reports
        assert (report.endpoint, report.stage_index, report.fault) == ("b", 1, FaultKind.DEAD)
        assert provider.requests[1] == ("p", report)

    run_virtual(main)
    assert transport.violations == []
    expected = MODEL.reference(PROMPT, 6)
    replay = PROMPT + expected[:3]
    # The replacement stage starts at position 0 of a fresh epoch and receives the whole replay:
    # batched, prompt and accepted tokens in one call (the route takes any number of rows);
    # exact, in the first run's batching: the prompt in one call, then one per accepted token.
    c_calls = forwards(transport, "c", "p")
    n = len(PROMPT)
    replay_calls = [(2, range(0, n), PROMPT)] + [
        (2, range(n + i, n + i + 1), (tok,)) for i, tok in enumerate(expected[:3])
    ]
    if policy.replay == "batched":
        replay_calls = [(2, range(0, n + 3), replay)]
    assert c_calls[: len(replay_calls)] == replay_calls
    assert [p for _, p, _ in c_calls[len(replay_calls) :]] == [range(8, 9), range(9, 10)]
    assert tuple(t for _, _, ids in c_calls[: len(replay_calls)] for t in ids) == replay
    # The surviving stage is reopened too: a cache miss, never a migration.
    a_epoch2 = [(2, p, ids) for e, p, ids in forwards(transport, "a", "p") if e == 2]
    assert a_epoch2[: len(replay_calls)] == replay_calls
    opens = [(c.endpoint, c.epoch) for c in transport.calls if c.op == "open"]
    assert opens == [("a", 1), ("b", 1), ("a", 2), ("c", 2)]
    # logits are asked for only where a token is picked: not for the replay of the prompt and
    # the first two accepted tokens (the third, the newest, picks the fourth token)
    wants = [c.want_logits for c in transport.calls if c.op == "forward" and c.endpoint == "c"]
    assert wants[: len(replay_calls)] == [False] * (len(replay_calls) - 1) + [True]
    assert all(wants[len(replay_calls) :])


def test_hang_hits_the_step_deadline_and_the_late_reply_is_dropped() -> None:
    transport = FakeTransport(MODEL)
    provider = PoolRouteProvider(transport, ["w0", "w1", "w2"], [(3,)], identity=IDENTITY)
    policy = attrs.evolve(POLICY, backoff=(1.0,))

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=policy)

        def on_token(token: int) -> None:
            if handle.core.step == 2:
                transport.hang("w1")

        handle = manager.start(PROMPT, max_new_tokens=5, session_id="h", on_token=on_token)
        await asyncio.sleep(2.5)  # virtual: the deadline fired at 2.0, backoff runs to 3.0
        assert handle.core.state is SessionState.ROUTE_LOST and handle.core.epoch == 1
        assert transport.held_replies("w1") == 2  # the forward's reply and the close's
        transport.release("w1")  # the dead epoch's reply arrives now, late
        await settle()
        assert handle.core.stale_events_dropped == 1 and handle.core.tokens == handle.tokens
        assert len(handle.tokens) == 2  # the late reply was not applied
        result = await handle.wait()
        assert result.tokens == MODEL.reference(PROMPT, 5)
        assert result.stale_events_dropped == 1 and result.epoch == 2
        (report,) = result.reports
        assert (report.fault, report.endpoint, report.waited) == (FaultKind.DEADLINE, "w1", 2.0)
        assert asyncio.get_running_loop().time() == 3.0

    run_virtual(main)


def test_late_reply_during_the_next_epoch_is_dropped() -> None:
    transport = FakeTransport(MODEL)
    provider = ScriptedRouteProvider([route(["a", "b"], [3]), route(["a", "c"], [3])])

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=POLICY)
        transport.hang("b")
        handle = manager.start(PROMPT, max_new_tokens=3, session_id="l")
        await asyncio.sleep(2.0)  # deadline on b, new route over a and c (epoch 2)
        transport.hang("c")  # keep epoch 2 waiting on c
        await asyncio.sleep(0.5)
        assert handle.core.epoch == 2 and handle.core.state is SessionState.OPENING
        transport.release("b")  # epoch 1's prefill reply from b arrives during epoch 2
        await settle()
        assert handle.core.stale_events_dropped == 1 and handle.tokens == ()
        transport.release("c")
        result = await handle.wait()
        assert result.tokens == MODEL.reference(PROMPT, 3)

    run_virtual(main)


def test_engine_error_moves_to_a_new_route() -> None:
    transport = FakeTransport(MODEL)
    provider = PoolRouteProvider(transport, ["w0", "w1", "w2"], [(2,), (4,)], identity=IDENTITY)

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=POLICY)
        transport.fail_next("w1")
        result = await manager.start(PROMPT, max_new_tokens=4).wait()
        assert result.tokens == MODEL.reference(PROMPT, 4)
        assert [r.fault for r in result.reports] == [FaultKind.ENGINE_ERROR]
        assert provider.reports == list(result.reports)

    run_virtual(main)


def test_budget_exhausted_names_stage_fault_and_attempts() -> None:
    transport = FakeTransport(MODEL)
    broken = route(["a", "b"], [3])
    provider = ScriptedRouteProvider([broken])  # the tracker keeps offering the same route
    policy = FailurePolicy(step_deadline=2.0, max_route_changes=5, max_attempts_per_step=3)

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=policy)
        transport.fail_next("b", 100)
        handle = manager.start(PROMPT, max_new_tokens=4, session_id="x")
        result = await handle.wait()
        assert result.state is SessionState.FAILED and result.reason is FinishReason.FAILED
        error = result.error
        assert isinstance(error, FailureBudgetExhausted)
        assert (error.stage_index, error.endpoint, error.fault) == (1, "b", FaultKind.ENGINE_ERROR)
        assert error.attempts == 3 and error.route_changes == 2 and len(error.reports) == 3
        with pytest.raises(FailureBudgetExhausted):
            await handle.result()
        await settle()
        assert transport.slots() == {}

    run_virtual(main)


def test_silent_provider_ends_in_no_route_available() -> None:
    transport = FakeTransport(MODEL)
    provider = ScriptedRouteProvider([HANG])

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=POLICY)
        result = await manager.start(PROMPT, max_new_tokens=2).wait()
        assert isinstance(result.error, NoRouteAvailable)
        assert [r.fault for r in result.reports] == [FaultKind.DEADLINE] * 3
        assert isinstance(result.error.__cause__, StepDeadlineExceeded)
        # three waits of one step deadline each, plus the backoff (0.0 then 0.5)
        assert asyncio.get_running_loop().time() == pytest.approx(3 * 2.0 + 0.5)

    run_virtual(main)


def test_session_deadline() -> None:
    transport = FakeTransport(MODEL)
    provider = ScriptedRouteProvider([route(["a", "b"], [3])])
    policy = FailurePolicy(step_deadline=50.0, session_deadline=10.0)

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=policy)
        transport.hang("b")
        result = await manager.start(PROMPT, max_new_tokens=2).wait()
        assert isinstance(result.error, SessionDeadlineExceeded)
        assert (result.error.stage_index, result.error.endpoint) == (1, "b")
        assert asyncio.get_running_loop().time() == 10.0

    run_virtual(main)


def test_cancel_closes_every_stage() -> None:
    transport = FakeTransport(MODEL)
    provider = ScriptedRouteProvider([route(["a", "b", "c"], [2, 4])])

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=POLICY)
        transport.hang("c")
        handle = manager.start(PROMPT, max_new_tokens=5, session_id="k")
        await asyncio.sleep(0.5)  # stuck waiting for c, before its deadline
        assert {ep for ep, _ in transport.slots()} == {"a", "b", "c"}
        handle.cancel("user")
        result = await handle.wait()
        assert result.state is SessionState.CANCELLED
        assert isinstance(result.error, SessionCancelled) and "user" in str(result.error)
        with pytest.raises(SessionCancelled):
            await handle.result()
        await settle()
        assert transport.slots() == {}
        handle.cancel()  # no-op once finished

    run_virtual(main)


def test_cancelling_the_driver_task_still_closes_the_stages() -> None:
    transport = FakeTransport(MODEL)
    provider = ScriptedRouteProvider([route(["a", "b"], [3])])

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=POLICY)
        transport.hang("b")
        handle = manager.start(PROMPT, max_new_tokens=5)
        await asyncio.sleep(0.5)
        assert transport.slots()
        assert handle._task is not None
        handle._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handle.wait()
        await settle()
        assert transport.slots() == {} and len(manager) == 0
        assert handle.core.state is SessionState.CANCELLED

    run_virtual(main)


def test_aclose_cancels_everything() -> None:
    transport = FakeTransport(MODEL)
    provider = PoolRouteProvider(transport, ["w0", "w1"], [(3,)], identity=IDENTITY)

    async def main() -> None:
        async with fixture_manager(transport, provider, policy=POLICY) as manager:
            transport.hang("w1")
            handles = [manager.start(PROMPT, max_new_tokens=3) for _ in range(5)]
            await asyncio.sleep(0.1)
        assert all(h.core.state is SessionState.CANCELLED for h in handles)
        assert transport.slots() == {} and len(manager) == 0

    run_virtual(main)


def test_seeded_sampler_is_deterministic_and_survives_route_changes() -> None:
    sampler = DocumentedSampler(Sampling(seed=7, temperature=300_000.0))

    def run(kill_at: int | None) -> tuple[int, ...]:
        transport = FakeTransport(MODEL)
        provider = PoolRouteProvider(transport, ["w0", "w1", "w2"], [(3,)], identity=IDENTITY)

        async def main() -> tuple[int, ...]:
            manager = fixture_manager(transport, provider, policy=POLICY, sampler=sampler)
            count = 0

            def on_token(token: int) -> None:
                nonlocal count
                count += 1
                if count == kill_at:
                    transport.kill("w1")

            return await manager.generate(PROMPT, max_new_tokens=8, on_token=on_token)

        return run_virtual(main)

    clean = run(None)
    assert run(None) == clean
    assert run(3) == clean
    assert clean != MODEL.reference(PROMPT, 8)  # it really samples


def test_wrong_answer_kind_is_a_protocol_fault() -> None:
    class MiddleGivesLogits(FakeTransport):
        async def forward(self, call: Forward) -> StageResult:
            result = await super().forward(call)
            return Logits([1.0]) if call.stage.endpoint == "bad" else result

    transport = MiddleGivesLogits(MODEL)
    provider = ScriptedRouteProvider([route(["bad", "b"], [3]), route(["a", "b"], [3])])

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=POLICY)
        result = await manager.start(PROMPT, max_new_tokens=2).wait()
        assert result.tokens == MODEL.reference(PROMPT, 2)
        assert result.reports[0].fault is FaultKind.PROTOCOL
        assert result.reports[0].endpoint == "bad"

    run_virtual(main)


def test_the_transport_gets_the_cores_forward_command_as_it_is() -> None:
    """One value per forward: the core's ``Forward``, its stage, index, boundary and kind intact."""
    answers: list[tuple[Forward, StageResult]] = []

    class Recording(FakeTransport):
        async def forward(self, call: Forward) -> StageResult:
            result = await super().forward(call)
            answers.append((call, result))
            return result

    transport = Recording(MODEL)
    the_route = route(["a", "b", "c"], [2, 4])
    provider = ScriptedRouteProvider([the_route])

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=POLICY)
        result = await manager.start(PROMPT, max_new_tokens=3, session_id="v").wait()
        assert result.tokens == MODEL.reference(PROMPT, 3)

    run_virtual(main)
    assert len(answers) == 3 * 3  # three stages, three steps
    for call, _ in answers:
        assert isinstance(call, Forward) and call.session_id == "v" and call.epoch == 1
        assert call.stage is the_route.stages[call.stage_index]
        assert call.final is (call.stage_index == 2)
    assert [c.kind for c, _ in answers] == ["prefill"] * 3 + ["decode"] * 6
    by_step = {(c.step, c.stage_index): (c, r) for c, r in answers}
    for step in range(3):
        first, _ = by_step[(step, 0)]
        assert first.boundary is None
        for index in (1, 2):
            call, _ = by_step[(step, index)]
            before = by_step[(step, index - 1)][1]
            assert isinstance(before, Boundary)
            assert call.boundary is before.rows  # relayed untouched
            assert (call.positions, call.token_ids) == (first.positions, first.token_ids)


def test_duplicate_session_id_is_refused() -> None:
    transport = FakeTransport(MODEL)
    provider = ScriptedRouteProvider([HANG])

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=POLICY)
        manager.start(PROMPT, max_new_tokens=1, session_id="dup")
        with pytest.raises(ValueError, match="dup"):
            manager.start(PROMPT, max_new_tokens=1, session_id="dup")
        assert manager.get("dup") is not None and manager.get("nope") is None
        await manager.aclose()

    run_virtual(main)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (StageDead("x"), FaultKind.DEAD),
        (ConnectionResetError(), FaultKind.DEAD),
        (TimeoutError(), FaultKind.DEADLINE),
        (StaleEpoch("x", session_id="s", epoch=1, held_epoch=2), FaultKind.PROTOCOL),
        (RuntimeError("engine"), FaultKind.ENGINE_ERROR),
        (InvalidIdentifier("session id", "empty"), FaultKind.CLIENT),  # a ValueError, yet ours
    ],
)
def test_fault_kind_of_transport_errors(error: BaseException, kind: FaultKind) -> None:
    assert fault_kind(error) is kind


def test_fault_kind_attribute_wins() -> None:
    class Custom(Exception):
        fault_kind = FaultKind.PROTOCOL

    assert fault_kind(Custom()) is FaultKind.PROTOCOL


def test_virtual_clock_jumps_and_detects_deadlock() -> None:
    loop = VirtualClockLoop()
    try:
        loop.run_until_complete(asyncio.sleep(3600))
        assert loop.time() == 3600
        with pytest.raises(RuntimeError, match="deadlock"):
            loop.run_until_complete(loop.create_future())
    finally:
        loop.close()


# --- refusals that would repeat are not retried; errors keep their cause ----------------------


class UnreachableProvider:
    """A provider that cannot reach stage 1's worker, and says so."""

    def __init__(self) -> None:
        self.raised: list[StageUnreachable] = []

    async def assign(self, session_id: str, report: object) -> Route | None:
        error = StageUnreachable(
            "stage 1 (127.0.0.1:9) is unreachable: Connection refused",
            stage_index=1,
            endpoint="127.0.0.1:9",
        )
        self.raised.append(error)
        raise error


def test_a_provider_that_cannot_reach_a_stage_is_named_in_the_sessions_error() -> None:
    provider = UnreachableProvider()

    async def main() -> None:
        manager = fixture_manager(FakeTransport(MODEL), provider, policy=POLICY)
        result = await manager.start(PROMPT, max_new_tokens=2).wait()
        error = result.error
        assert isinstance(error, NoRouteAvailable)
        assert error.__cause__ is provider.raised[-1]  # the typed error, not its repr
        assert "stage 1 (127.0.0.1:9) is unreachable: Connection refused" in str(error)
        assert "provider error" not in str(error)
        assert [r.detail for r in result.reports] == [str(provider.raised[0])] * 3

    run_virtual(main)


class BadRequest(DgrError, ValueError):
    """What a stage raises for a request no route would take (a token id off the vocabulary)."""

    fault_kind = FaultKind.BAD_REQUEST


class RefusingTransport(FakeTransport):
    """Refuses every forward to stage 0 as a bad request."""

    async def forward(self, call: Forward) -> StageResult:
        if call.stage_index == 0:
            raise BadRequest("token id 99 is outside the vocabulary [0, 32)")
        return await super().forward(call)


def test_a_bad_request_is_not_retried_on_another_route() -> None:
    transport = RefusingTransport(MODEL)
    provider = ScriptedRouteProvider([route(["a", "b"], [3]), route(["c", "d"], [3])])

    async def main() -> None:
        manager = fixture_manager(transport, provider, policy=POLICY)
        result = await manager.start((99,), max_new_tokens=2).wait()
        assert len(provider.requests) == 1  # no second route asked for
        error = result.error
        assert isinstance(error, RequestRefused) and isinstance(error.__cause__, BadRequest)
        assert (error.stage_index, error.endpoint) == (0, "a")
        assert "outside the vocabulary" in str(error) and result.route_changes == 0
        assert [r.fault for r in result.reports] == [FaultKind.BAD_REQUEST]

    run_virtual(main)


def test_a_route_refused_twice_the_same_way_fails_after_two_requests_not_three() -> None:
    dark = make_route(["a", "b"], [3], identity=IDENTITY, lane=fixture_lane(certified=False))
    provider = ScriptedRouteProvider([dark])

    async def main() -> None:
        manager = fixture_manager(FakeTransport(MODEL), provider, policy=POLICY)
        result = await manager.start(PROMPT, max_new_tokens=2).wait()
        error = result.error
        assert isinstance(error, RouteRefused) and isinstance(error.refusal, DarkLane)
        assert len(provider.requests) == 2 and len(result.reports) == 2
        assert "stage 0 (a) layers [0,3)" in str(error) and "not retried" in str(error)

    run_virtual(main)
