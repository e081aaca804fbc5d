"""The sans-I/O core: events in, commands out, no I/O and no clock of its own."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
from loguru import logger

import dgr_session.core
from dgr_session import (
    AdmissionTimeout,
    Cancel,
    ClockTick,
    CloseStage,
    Command,
    DarkLane,
    EmitToken,
    EvidenceClass,
    FailureBudgetExhausted,
    FailurePolicy,
    FaultKind,
    Finish,
    FinishReason,
    Forward,
    ForwardKind,
    InvalidTransition,
    NoRouteAvailable,
    OpenStage,
    ReplayMode,
    RequestRefused,
    RequestRoute,
    Route,
    RouteAssigned,
    RouteRefused,
    RouteSession,
    RouteStalled,
    RouteUnavailable,
    SessionCancelled,
    SessionDeadlineExceeded,
    SessionState,
    StageFailed,
    StageOpened,
    StageOutput,
    StageUnreachable,
    Start,
    StepDeadlineExceeded,
)
from dgr_session.machine import SessionMachine
from dgr_session.testing import fixture_identity, fixture_lane, make_route

IDENTITY = fixture_identity(6)
POLICY = FailurePolicy(
    step_deadline=1.0,
    session_deadline=100.0,
    max_route_changes=3,
    max_attempts_per_step=3,
    backoff=(0.0,),
)
SID = "s"


def route(*endpoints: str) -> Route:
    n = len(endpoints)
    cuts = [IDENTITY.n_layer * k // n for k in range(1, n)]
    return make_route(list(endpoints), cuts, identity=IDENTITY)


def of(commands: Sequence[Command], kind: type) -> list[Any]:
    return [c for c in commands if isinstance(c, kind)]


class Driver:
    """Feeds a core by hand and keeps every command it returned."""

    def __init__(
        self,
        prompt: Sequence[int] = (1, 2, 3),
        max_new_tokens: int = 4,
        policy: FailurePolicy = POLICY,
        **kwargs: object,
    ) -> None:
        # The routes here run on fixture lanes: certified with fixture evidence.
        kwargs.setdefault("required_evidence", EvidenceClass.FIXTURE)
        self.core = RouteSession(
            SID,
            prompt,
            max_new_tokens=max_new_tokens,
            policy=policy,
            machine=SessionMachine(),
            **kwargs,  # type: ignore[arg-type]
        )
        self.now = 0.0
        self.log: list[Any] = []

    def feed(self, event: object) -> list[Any]:
        out = self.core.handle(event)  # type: ignore[arg-type]
        self.log.extend(out)
        return out

    def tick(self, now: float) -> list[Any]:
        self.now = now
        return self.feed(ClockTick(SID, now))

    def start(self) -> list[Any]:
        return self.feed(Start(SID, self.now))

    def assign(self, r: Route) -> list[Any]:
        """Answers the newest route request with ``r``."""
        return self.feed(RouteAssigned(SID, self.core.epoch + 1, r, self.core.route_attempt))

    def open_all(self) -> list[Any]:
        out: list[Any] = []
        assert self.core.route is not None
        for index in range(len(self.core.route)):
            out += self.feed(StageOpened(SID, self.core.epoch, index))
        return out

    def step(self, token: int) -> list[Any]:
        """Answer the pending forward at every stage; the last picks ``token``. Forwards that
        replay accepted tokens after a route change (no token emitted) are answered too."""
        assert self.core.route is not None
        out: list[Any] = []
        last = len(self.core.route) - 1
        for _ in range(1000):  # bounded: a replay is at most max_new_tokens forwards
            answer: list[Any] = []
            for index in range(last + 1):
                epoch, step = self.core.epoch, self.core.step
                if index < last:
                    answer += self.feed(
                        StageOutput(
                            session_id=SID,
                            epoch=epoch,
                            step=step,
                            stage_index=index,
                            payload=("rows", index),
                        )
                    )
                else:
                    answer += self.feed(
                        StageOutput(
                            session_id=SID, epoch=epoch, step=step, stage_index=index, token=token
                        )
                    )
            out += answer
            replaying = not of(answer, EmitToken) and any(
                isinstance(c, Forward) and c.stage_index == 0 for c in answer
            )
            if not replaying:
                return out
        raise AssertionError("replay did not end")

    def running(self, r: Route) -> Driver:
        self.start()
        self.assign(r)
        self.open_all()
        return self


# ------------------------------------------------------------------------------------------
# Happy path


def test_happy_path_commands_in_order() -> None:
    d = Driver(max_new_tokens=2)
    assert d.core.state is SessionState.NEW and d.core.epoch == 0
    assert d.start() == [RequestRoute(SID, 1, None)]
    r = route("a", "b")
    opens = d.assign(r)
    assert opens == [OpenStage(SID, 1, 0, r.stages[0]), OpenStage(SID, 1, 1, r.stages[1])]
    assert d.core.state is SessionState.OPENING and d.core.epoch == 1
    assert d.feed(StageOpened(SID, 1, 1)) == []
    (forward,) = d.feed(StageOpened(SID, 1, 0))
    assert d.core.state is SessionState.PREFILLING
    assert forward == Forward(
        session_id=SID,
        epoch=1,
        step=0,
        stage_index=0,
        stage=r.stages[0],
        positions=range(0, 3),
        token_ids=(1, 2, 3),
        boundary=None,
        final=False,
        kind="prefill",
    )
    (relay,) = d.feed(StageOutput(session_id=SID, epoch=1, step=0, stage_index=0, payload="rows-0"))
    assert relay.boundary == "rows-0" and relay.stage_index == 1 and relay.final
    assert relay.positions == range(0, 3) and relay.token_ids == (1, 2, 3)
    emit, decode = d.feed(StageOutput(session_id=SID, epoch=1, step=0, stage_index=1, token=9))
    assert emit == EmitToken(SID, 1, 0, 9)
    assert d.core.state is SessionState.DECODING
    assert decode.positions == range(3, 4) and decode.token_ids == (9,) and decode.step == 1
    d.feed(StageOutput(session_id=SID, epoch=1, step=1, stage_index=0, payload="rows-1"))
    out = d.feed(StageOutput(session_id=SID, epoch=1, step=1, stage_index=1, token=4))
    assert out[0] == EmitToken(SID, 1, 1, 4)
    assert of(out, CloseStage) == [
        CloseStage(SID, 1, 0, r.stages[0]),
        CloseStage(SID, 1, 1, r.stages[1]),
    ]
    assert out[-1] == Finish(SID, 1, FinishReason.LENGTH, (9, 4), None)
    assert d.core.state is SessionState.DONE and d.core.finished
    assert d.core.tokens == (9, 4) and d.core.error is None
    assert d.core.next_timer() is None


def test_stop_token_finishes_with_reason_stop() -> None:
    d = Driver(max_new_tokens=10, stop_tokens=[7]).running(route("a"))
    d.step(3)
    out = d.step(7)
    assert out[-1].reason is FinishReason.STOP and d.core.tokens == (3, 7)
    assert d.core.finish_reason is FinishReason.STOP


def test_one_info_line_per_state_change_bound_to_session_and_epoch() -> None:
    records: list[Any] = []
    logger.enable("dgr_session")
    sink = logger.add(lambda m: records.append(m.record), level="INFO")
    try:
        d = Driver(max_new_tokens=2).running(route("a", "b"))
        d.step(1)
        d.step(2)
    finally:
        logger.remove(sink)
        logger.disable("dgr_session")
    changes = [(r["message"].split()[0], r["message"].split()[2]) for r in records]
    assert changes == [
        ("new", "opening"),
        ("opening", "prefilling"),
        ("prefilling", "decoding"),
        ("decoding", "done"),
    ]
    assert all(r["level"].name == "INFO" and r["extra"]["session"] == SID for r in records)
    assert [r["extra"]["epoch"] for r in records] == [1, 1, 1, 1]


def test_fault_lines_name_the_stage() -> None:
    records: list[Any] = []
    logger.enable("dgr_session")
    sink = logger.add(lambda m: records.append(m.record), level="INFO")
    try:
        d = Driver().running(route("a", "b"))
        d.feed(StageFailed(session_id=SID, epoch=1, stage_index=1, kind=FaultKind.DEAD))
    finally:
        logger.remove(sink)
        logger.disable("dgr_session")
    lost = [r for r in records if "-> route_lost" in r["message"]]
    assert len(lost) == 1 and lost[0]["extra"]["stage"] == 1
    assert lost[0]["extra"]["epoch"] == 1 and lost[0]["extra"]["session"] == SID


def test_library_logging_is_disabled_by_default() -> None:
    lines: list[str] = []
    sink = logger.add(lines.append, level="DEBUG")
    try:
        Driver(max_new_tokens=1).running(route("a")).step(1)
    finally:
        logger.remove(sink)
    assert lines == []


# ------------------------------------------------------------------------------------------
# Epochs, stale events, the Petals case


def _lose_stage_one_after_two_tokens(d: Driver) -> None:
    d.step(10)
    d.step(11)
    d.feed(
        StageFailed(
            session_id=SID, epoch=1, stage_index=1, kind=FaultKind.DEAD, detail="gone", step=2
        )
    )


def test_a_batched_replay_sends_prompt_and_accepted_tokens_in_one_forward() -> None:
    d = Driver(prompt=(5, 6), max_new_tokens=5).running(route("a", "b"))
    _lose_stage_one_after_two_tokens(d)
    d.assign(route("a", "c"))
    (forward,) = d.open_all()
    # the default replay: prompt + accepted tokens from position 0 in forwards of the route's
    # max_rows (unlimited here), the last of which reaches the newest token and picks the next
    assert forward.positions == range(0, 4) and forward.token_ids == (5, 6, 10, 11)
    assert forward.step == 2 and forward.epoch == 2 and forward.wants_logits
    assert forward.kind == "replay"  # rows the first epoch computed: for metrics and usage
    first = [f for f in d.log if isinstance(f, Forward) and f.epoch == 1]
    assert [f.kind for f in first[:2]] == ["prefill", "prefill"]  # the prompt, both stages
    assert {f.kind for f in first[2:]} == {"decode"}
    (relay,) = d.feed(StageOutput(session_id=SID, epoch=2, step=2, stage_index=0, payload="r"))
    assert relay.positions == range(0, 4) and relay.wants_logits
    out = d.feed(StageOutput(session_id=SID, epoch=2, step=2, stage_index=1, token=12))
    assert out[0] == EmitToken(SID, 2, 2, 12) and d.core.tokens == (10, 11, 12)
    assert out[1].positions == range(4, 5) and out[1].token_ids == (12,)


def test_a_batched_replay_takes_the_new_routes_max_rows_per_forward() -> None:
    d = Driver(prompt=(5, 6), max_new_tokens=5).running(route("a", "b"))
    _lose_stage_one_after_two_tokens(d)
    narrow = Route(attrs.evolve(stage, max_rows=3) for stage in route("a", "c").stages)
    d.assign(narrow)
    (forward,) = d.open_all()
    assert forward.positions == range(0, 3) and forward.token_ids == (5, 6, 10)
    assert not forward.wants_logits  # a replay chunk before the newest token
    # pipelined: as stage 1 takes the first chunk, stage 0 takes the next one
    relay, rest = d.feed(StageOutput(session_id=SID, epoch=2, step=2, stage_index=0, payload="r"))
    assert (relay.stage_index, relay.positions, relay.boundary) == (1, range(0, 3), "r")
    assert (rest.stage_index, rest.positions, rest.token_ids) == (0, range(3, 4), (11,))
    assert rest.wants_logits
    assert d.feed(StageOutput(session_id=SID, epoch=2, step=2, stage_index=1, token=77)) == []


def test_route_change_replays_prompt_and_accepted_tokens_from_position_zero() -> None:
    exact = attrs.evolve(POLICY, replay="exact")
    d = Driver(prompt=(5, 6), max_new_tokens=5, policy=exact).running(route("a", "b"))
    d.step(10)
    d.step(11)
    old = d.core.route
    assert old is not None
    out = d.feed(
        StageFailed(
            session_id=SID, epoch=1, stage_index=1, kind=FaultKind.DEAD, detail="gone", step=2
        )
    )
    assert of(out, CloseStage) == [CloseStage(SID, 1, i, s) for i, s in enumerate(old.stages)]
    (request,) = of(out, RequestRoute)
    assert request.epoch == 2
    assert request.report.endpoint == "b" and request.report.fault is FaultKind.DEAD
    assert request.report.stage_index == 1 and request.report.step == 2
    assert d.core.state is SessionState.REROUTING
    replacement = route("a", "c")
    opens = d.assign(replacement)
    assert [o.epoch for o in opens] == [2, 2] and d.core.epoch == 2
    (forward,) = d.open_all()
    # The replacement stage (and every other) starts a fresh epoch at position 0 and, with
    # replay "exact", receives the whole replay in the first run's batching: the prompt in one
    # call, then each accepted
    # token in a call of its own; nothing is resampled (the tokens the last stage picks while
    # replaying are ignored) and nothing is emitted until the replay is complete.
    assert forward.positions == range(0, 2)
    assert forward.token_ids == (5, 6)
    assert forward.step == 2 and forward.epoch == 2
    # nobody reads a replay's logits: every stage is told, the last computes none
    assert not forward.wants_logits
    # The forwards are pipelined: as stage 1 ("c") takes a chunk, stage 0 takes the next one.
    relay, replay = d.feed(StageOutput(session_id=SID, epoch=2, step=2, stage_index=0, payload="r"))
    assert relay.stage.endpoint == "c" and relay.positions == range(0, 2)
    assert not relay.wants_logits
    assert (replay.stage_index, replay.positions, replay.token_ids) == (0, range(2, 3), (10,))
    # stage 0 answers token 10 before stage 1 answers the prompt: its rows wait for stage 1,
    # and stage 0 takes nothing more until they are taken
    assert d.feed(StageOutput(session_id=SID, epoch=2, step=2, stage_index=0, payload="r10")) == []
    out = d.feed(StageOutput(session_id=SID, epoch=2, step=2, stage_index=1, token=77))
    assert not of(out, EmitToken)  # a replay's token is ignored
    assert [(f.stage_index, f.positions, f.token_ids, f.boundary) for f in out] == [
        (1, range(2, 3), (10,), "r10"),
        (0, range(3, 4), (11,), None),
    ]
    assert d.core.kv_positions == 2
    assert d.feed(StageOutput(session_id=SID, epoch=2, step=2, stage_index=0, payload="r11")) == []
    (relay,) = d.feed(StageOutput(session_id=SID, epoch=2, step=2, stage_index=1, token=78))
    assert (relay.stage_index, relay.positions, relay.boundary) == (1, range(3, 4), "r11")
    assert relay.wants_logits  # the newest accepted token: its logits pick the next one
    out = d.feed(StageOutput(session_id=SID, epoch=2, step=2, stage_index=1, token=12))
    assert out[0] == EmitToken(SID, 2, 2, 12)
    assert d.core.tokens == (10, 11, 12)
    assert out[1].positions == range(4, 5) and out[1].token_ids == (12,)
    assert d.core.route_changes == 1


def test_events_of_an_old_epoch_are_dropped_and_counted() -> None:
    d = Driver(max_new_tokens=5).running(route("a", "b"))
    d.step(1)
    d.feed(
        StageFailed(
            session_id=SID, epoch=1, stage_index=0, kind=FaultKind.DEADLINE, detail="slow", step=1
        )
    )
    d.assign(route("a", "b"))
    before = d.core.state, d.core.epoch, d.core.step
    late = [
        StageOutput(session_id=SID, epoch=1, step=1, stage_index=0, payload="late"),
        StageOutput(session_id=SID, epoch=1, step=1, stage_index=1, token=99),
        StageOpened(SID, 1, 0),
        StageFailed(session_id=SID, epoch=1, stage_index=1, kind=FaultKind.DEAD),
        RouteAssigned(SID, 1, route("x")),
        RouteUnavailable(SID, 2),
    ]
    for event in late:
        assert d.feed(event) == []
    assert (d.core.state, d.core.epoch, d.core.step) == before
    assert d.core.stale_events_dropped == len(late)
    assert d.core.tokens == (1,)


def test_answers_after_a_fault_are_stale_even_before_the_new_epoch() -> None:
    policy = FailurePolicy(step_deadline=1.0, session_deadline=100.0, backoff=(5.0,))
    d = Driver(policy=policy).running(route("a", "b"))
    d.feed(
        StageFailed(
            session_id=SID,
            epoch=1,
            stage_index=0,
            kind=FaultKind.ENGINE_ERROR,
            detail="oom",
            step=0,
        )
    )
    assert d.core.state is SessionState.ROUTE_LOST and not d.core.live_epoch
    assert d.feed(StageOutput(session_id=SID, epoch=1, step=0, stage_index=1, token=3)) == []
    assert d.core.stale_events_dropped == 1 and d.core.tokens == ()


def test_epoch_increments_once_per_assignment_and_never_decreases() -> None:
    d = Driver(max_new_tokens=10, policy=FailurePolicy(max_route_changes=5, backoff=())).running(
        route("a")
    )
    epochs = [d.core.epoch]
    for n in range(5):
        d.step(n)
        d.feed(StageFailed(session_id=SID, epoch=d.core.epoch, stage_index=0, kind=FaultKind.DEAD))
        epochs.append(d.core.epoch)
        d.assign(route("a"))
        epochs.append(d.core.epoch)
        d.open_all()
    assert epochs == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]


def test_future_epoch_and_foreign_session_are_driver_bugs() -> None:
    d = Driver().running(route("a"))
    with pytest.raises(InvalidTransition):
        d.feed(StageOutput(session_id=SID, epoch=7, step=0, stage_index=0, token=1))
    with pytest.raises(InvalidTransition):
        d.feed(RouteAssigned(SID, 9, route("a")))
    with pytest.raises(InvalidTransition):
        d.feed(StageOutput(session_id="other", epoch=1, step=0, stage_index=0, token=1))
    with pytest.raises(InvalidTransition):
        d.feed(StageOpened(SID, 1, 5))
    with pytest.raises(InvalidTransition):
        d.feed(Start(SID, 0.0))
    with pytest.raises(TypeError):
        d.feed("not an event")
    assert d.core.state is SessionState.PREFILLING and d.core.stale_events_dropped == 0


@pytest.mark.parametrize(
    "event",
    [
        StageOutput(
            session_id=SID, epoch=1, step=0, stage_index=1, token=5
        ),  # wrong hop: stage 0 is awaited
        StageOutput(session_id=SID, epoch=1, step=3, stage_index=0, payload="x"),  # wrong step
        StageOpened(SID, 1, 0),  # duplicate open
    ],
)
def test_out_of_protocol_answers_are_faults_of_that_stage(event: object) -> None:
    d = Driver().running(route("a", "b"))
    out = d.feed(event)
    (request,) = of(out, RequestRoute)
    assert request.report.fault is FaultKind.PROTOCOL
    assert request.report.stage_index == event.stage_index  # type: ignore[attr-defined]
    assert d.core.tokens == ()


def test_last_stage_without_a_token_is_a_protocol_fault() -> None:
    d = Driver().running(route("a"))
    out = d.feed(
        StageOutput(session_id=SID, epoch=1, step=0, stage_index=0, payload="rows but no token")
    )
    assert of(out, RequestRoute)[0].report.fault is FaultKind.PROTOCOL


# ------------------------------------------------------------------------------------------
# Time, deadlines, budget


def test_step_deadline_blames_the_awaited_stage() -> None:
    d = Driver().running(route("a", "b", "c"))
    d.feed(StageOutput(session_id=SID, epoch=1, step=0, stage_index=0, payload="r"))
    assert d.core.next_timer() == 1.0
    assert d.tick(0.99) == []
    out = d.tick(1.0)
    (request,) = of(out, RequestRoute)
    assert request.report.fault is FaultKind.DEADLINE
    assert request.report.stage_index == 1 and request.report.endpoint == "b"
    assert request.report.waited == 1.0


def test_opening_deadline_blames_the_first_unopened_stage() -> None:
    d = Driver()
    d.start()
    d.assign(route("a", "b", "c"))
    d.feed(StageOpened(SID, 1, 0))
    d.feed(StageOpened(SID, 1, 2))
    (request,) = of(d.tick(5.0), RequestRoute)
    assert request.report.stage_index == 1 and request.report.fault is FaultKind.DEADLINE


def test_backoff_waits_for_the_clock() -> None:
    policy = FailurePolicy(step_deadline=1.0, backoff=(0.5, 2.0))
    d = Driver(policy=policy).running(route("a"))
    d.tick(0.25)
    d.feed(StageFailed(session_id=SID, epoch=1, stage_index=0, kind=FaultKind.DEAD))
    assert d.core.state is SessionState.ROUTE_LOST
    assert d.core.next_timer() == 0.75
    assert d.tick(0.7) == []
    (request,) = d.tick(0.75)
    assert isinstance(request, RequestRoute) and d.core.state is SessionState.REROUTING
    d.assign(route("b"))
    d.open_all()
    d.feed(StageFailed(session_id=SID, epoch=2, stage_index=0, kind=FaultKind.DEAD))
    assert d.core.next_timer() == 2.75  # second fault: second delay


def test_route_request_deadline_and_no_route_count_as_attempts() -> None:
    d = Driver()
    d.start()
    out = d.tick(1.0)  # provider silent for a whole step deadline
    (retry,) = of(out, RequestRoute)
    assert retry.report.fault is FaultKind.DEADLINE and retry.attempt == 2
    out = d.feed(RouteUnavailable(SID, 1, "empty pool", attempt=2))
    (retry,) = of(out, RequestRoute)
    assert retry.report.fault is FaultKind.NO_ROUTE and retry.attempt == 3
    out = d.feed(RouteUnavailable(SID, 1, attempt=3))
    assert d.core.state is SessionState.FAILED
    error = d.core.error
    assert isinstance(error, NoRouteAvailable)
    assert error.attempts == 3 and error.fault is FaultKind.NO_ROUTE
    assert len(error.reports) == 3 and out[-1].reason is FinishReason.FAILED


def test_a_late_answer_to_a_timed_out_route_request_is_not_taken_for_its_retry() -> None:
    d = Driver()
    assert d.start() == [RequestRoute(SID, 1, None, attempt=1)]
    (retry,) = of(d.tick(1.0), RequestRoute)  # the provider is silent: timed out, asked again
    assert (retry.epoch, retry.attempt) == (1, 2) and d.core.route_attempt == 2
    # the first request's answers arrive late: dropped (counted stale), nothing opened
    assert d.feed(RouteAssigned(SID, 1, route("late"), attempt=1)) == []
    assert d.feed(RouteUnavailable(SID, 1, "late too", attempt=1)) == []
    assert d.core.stale_events_dropped == 2 and d.core.route is None
    assert d.core.state is SessionState.REROUTING and d.core.epoch == 0
    # the retry's answer is the one applied
    fresh = route("fresh")
    opens = of(d.feed(RouteAssigned(SID, 1, fresh, attempt=2)), OpenStage)
    assert [o.stage.endpoint for o in opens] == ["fresh"]
    assert d.core.route is fresh and d.core.epoch == 1 and d.core.route_attempt == 0
    # an answer to a request never made is a protocol error, as for an epoch never asked
    with pytest.raises(InvalidTransition):
        d.feed(RouteAssigned(SID, 2, fresh, attempt=1))


def test_invalid_route_is_refused_and_reported() -> None:
    d = Driver()
    d.start()
    bad = make_route(["x", "y"], [3], identity=IDENTITY, lane=fixture_lane(certified=False))
    (request,) = of(d.assign(bad), RequestRoute)
    assert request.report.fault is FaultKind.ROUTE_INVALID
    assert request.report.stage_index == 0 and request.report.endpoint == "x"
    assert d.core.epoch == 0 and d.core.state is SessionState.REROUTING
    d.assign(route("a"))
    assert d.core.epoch == 1 and d.core.route_changes == 0


def test_fixture_lanes_are_refused_unless_fixture_evidence_is_required() -> None:
    d = Driver(required_evidence=EvidenceClass.REAL_HARDWARE)
    assert d.core.required_evidence is EvidenceClass.REAL_HARDWARE
    d.start()
    (request,) = of(d.assign(route("x", "y")), RequestRoute)
    assert request.report.fault is FaultKind.ROUTE_INVALID
    assert request.report.stage_index == 0 and request.report.endpoint == "x"
    assert "fixture" in request.report.detail and "real-hardware" in request.report.detail
    assert d.core.epoch == 0 and d.core.state is SessionState.REROUTING
    # the default is real-hardware: a core built without a requirement refuses fixture lanes too
    assert RouteSession("t", [1], max_new_tokens=1).required_evidence is EvidenceClass.REAL_HARDWARE


def test_later_routes_must_serve_the_pinned_model() -> None:
    d = Driver().running(route("a"))
    d.feed(StageFailed(session_id=SID, epoch=1, stage_index=0, kind=FaultKind.DEAD))
    other = make_route(["z"], [], identity=fixture_identity(7))
    (request,) = of(d.assign(other), RequestRoute)
    assert request.report.fault is FaultKind.ROUTE_INVALID and d.core.epoch == 1


def test_attempts_per_step_bound_the_faults_at_one_step() -> None:
    policy = FailurePolicy(max_attempts_per_step=2, max_route_changes=10, backoff=())
    d = Driver(policy=policy).running(route("a", "b"))
    d.step(1)
    d.feed(
        StageFailed(
            session_id=SID,
            epoch=1,
            stage_index=1,
            kind=FaultKind.ENGINE_ERROR,
            detail="boom",
            step=1,
        )
    )
    d.assign(route("a", "b"))
    d.open_all()
    d.step(2)  # progress resets the per-step count
    d.feed(StageFailed(session_id=SID, epoch=2, stage_index=0, kind=FaultKind.DEAD, step=2))
    d.assign(route("a", "b"))
    d.open_all()
    out = d.feed(
        StageFailed(
            session_id=SID,
            epoch=3,
            stage_index=1,
            kind=FaultKind.ENGINE_ERROR,
            detail="boom",
            step=2,
        )
    )
    error = d.core.error
    assert isinstance(error, FailureBudgetExhausted) and not isinstance(error, NoRouteAvailable)
    assert (error.stage_index, error.endpoint, error.fault) == (1, "b", FaultKind.ENGINE_ERROR)
    assert error.attempts == 2 and error.step == 2 and error.route_changes == 2
    assert "stage 1 (b)" in str(error) and "engine_error" in str(error)
    assert out[-1] == Finish(SID, 3, FinishReason.FAILED, (1, 2), error)
    assert len(of(out, CloseStage)) == 2


def test_route_change_budget() -> None:
    policy = FailurePolicy(max_route_changes=1, max_attempts_per_step=10, backoff=())
    d = Driver(policy=policy, max_new_tokens=10).running(route("a"))
    d.feed(StageFailed(session_id=SID, epoch=1, stage_index=0, kind=FaultKind.DEAD))
    d.assign(route("b"))
    d.open_all()
    d.feed(StageFailed(session_id=SID, epoch=2, stage_index=0, kind=FaultKind.DEAD))
    error = d.core.error
    assert isinstance(error, FailureBudgetExhausted)
    assert error.route_changes == 1 and error.endpoint == "b"
    assert of(d.log, RequestRoute)[-1].report is not None
    assert len(of(d.log, RequestRoute)) == 2  # first route + one change, no third request


def test_deadline_cause_is_attached_when_it_spends_the_budget() -> None:
    policy = FailurePolicy(step_deadline=1.0, max_route_changes=0, backoff=())
    d = Driver(policy=policy).running(route("a"))
    d.tick(1.0)
    assert isinstance(d.core.error, FailureBudgetExhausted)
    assert isinstance(d.core.error.__cause__, StepDeadlineExceeded)
    assert d.core.error.fault is FaultKind.DEADLINE


def test_a_transport_that_finds_silent_stages_makes_a_step_deadline_name_none() -> None:
    """Over a chained route the client waits on the first stage only: a step deadline there
    says nothing of which stage held the step, so it names none (a wrong blame would exclude a
    healthy worker); a plain transport's names the stage it waited on."""
    policy = FailurePolicy(step_deadline=1.0, max_route_changes=3, backoff=())
    for finds, named in ((True, None), (False, 0)):
        d = Driver(policy=policy, finds_silent_stages=finds).running(route("a", "b", "c"))
        d.tick(1.0)
        (request,) = of(d.log, RequestRoute)[-1:]
        report = request.report
        assert report is not None and report.fault is FaultKind.DEADLINE
        assert (report.stage_index, report.endpoint) == (named, None if named is None else "a")
        assert ("found silent" in report.detail) is finds


def test_a_route_failure_that_names_no_stage_is_reported_with_none() -> None:
    """A transport that cannot tell which stage held a step raises ``RouteStalled`` from any
    stage's forward; the manager posts it with no stage, and the report names none."""
    d = Driver().running(route("a", "b"))
    error = RouteStalled("no chained output, and no stage was found silent")
    d.feed(
        StageFailed(session_id=SID, epoch=1, stage_index=None, kind=FaultKind.DEADLINE, error=error)
    )
    report = of(d.log, RequestRoute)[-1].report
    assert report is not None and report.fault is FaultKind.DEADLINE
    assert report.stage_index is None and report.endpoint is None
    assert d.core.state is SessionState.REROUTING  # and asks for a new route at once


def test_session_deadline_fails_from_any_live_state() -> None:
    policy = FailurePolicy(step_deadline=10.0, session_deadline=30.0, backoff=(100.0,))
    d = Driver(policy=policy).running(route("a", "b"))
    d.tick(9.0)
    d.feed(StageFailed(session_id=SID, epoch=1, stage_index=0, kind=FaultKind.DEAD))
    assert d.core.state is SessionState.ROUTE_LOST and d.core.next_timer() == 30.0
    out = d.tick(30.0)
    assert d.core.state is SessionState.FAILED
    assert isinstance(d.core.error, SessionDeadlineExceeded)
    assert out == [Finish(SID, 1, FinishReason.FAILED, (), d.core.error)]
    assert d.core.ended_at == 30.0 and d.core.started_at == 0.0


def test_clock_never_goes_back() -> None:
    d = Driver().running(route("a"))
    d.tick(0.9)
    d.tick(0.1)
    assert of(d.tick(0.95), RequestRoute) == []
    assert of(d.tick(1.0), RequestRoute)


# ------------------------------------------------------------------------------------------
# Cancel


@pytest.mark.parametrize("stages", [1, 3])
def test_cancel_closes_every_stage_of_the_epoch(stages: int) -> None:
    r = route(*"abc"[:stages])
    d = Driver()
    d.start()
    d.assign(r)
    d.feed(StageOpened(SID, 1, 0))  # some stages still opening: they are closed too
    out = d.feed(Cancel(SID, "user"))
    assert of(out, CloseStage) == [CloseStage(SID, 1, i, s) for i, s in enumerate(r.stages)]
    assert d.core.state is SessionState.CANCELLED
    assert isinstance(out[-1].error, SessionCancelled) and "user" in str(out[-1].error)
    assert d.feed(Cancel(SID)) == []  # idempotent
    assert d.feed(StageOpened(SID, 1, 1)) == [] and d.core.stale_events_dropped == 1
    assert d.tick(1e9) == []


def test_cancel_after_a_fault_has_nothing_left_to_close() -> None:
    d = Driver(policy=FailurePolicy(backoff=(3.0,))).running(route("a", "b"))
    d.feed(StageFailed(session_id=SID, epoch=1, stage_index=0, kind=FaultKind.DEAD))
    out = d.feed(Cancel(SID))
    assert of(out, CloseStage) == [] and d.core.state is SessionState.CANCELLED


def test_terminal_sessions_leave_the_shared_machine() -> None:
    machine = SessionMachine()
    cores = [RouteSession(f"s{i}", [1], max_new_tokens=1, machine=machine) for i in range(5)]
    assert machine.member_count == 5
    for core in cores[:3]:
        core.handle(Cancel(core.session_id))
    assert machine.member_count == 2
    del cores
    import gc

    gc.collect()
    assert machine.member_count == 0  # weak: a dropped live session is not kept alive


def test_constructor_rejects_empty_prompt_and_no_tokens() -> None:
    with pytest.raises(ValueError):
        RouteSession("x", [], max_new_tokens=1)
    with pytest.raises(ValueError):
        RouteSession("x", [1], max_new_tokens=0)


def with_max_rows(r: Route, max_rows: int) -> Route:
    return Route(attrs.evolve(stage, max_rows=max_rows) for stage in r.stages)


def test_prefill_is_chunked_to_the_routes_max_rows_and_replayed_in_the_same_chunks() -> None:
    exact = attrs.evolve(POLICY, replay="exact")
    d = Driver(prompt=tuple(range(10)), max_new_tokens=4, policy=exact)
    d.start()
    d.assign(with_max_rows(route("a", "b"), 4))
    (first,) = d.open_all()
    assert (first.positions, first.token_ids) == (range(0, 4), (0, 1, 2, 3))
    assert not first.wants_logits  # a chunk before the prompt's last: no logits asked
    # the chunks are pipelined: stage 0 takes each next chunk as stage 1 takes its rows
    relay, second = d.feed(StageOutput(session_id=SID, epoch=1, step=0, stage_index=0, payload="r"))
    assert (relay.stage_index, relay.positions) == (1, range(0, 4))
    assert (second.stage_index, second.positions) == (0, range(4, 8))
    assert not second.wants_logits
    # mid-prompt: no token, nothing emitted
    assert d.feed(StageOutput(session_id=SID, epoch=1, step=0, stage_index=1)) == []
    relay, third = d.feed(StageOutput(session_id=SID, epoch=1, step=0, stage_index=0, payload="r"))
    assert (relay.stage_index, relay.positions) == (1, range(4, 8))
    assert (third.positions, third.token_ids) == (range(8, 10), (8, 9))
    assert third.wants_logits  # the prompt's last chunk: its logits pick the first token
    # a token anyway: ignored
    assert d.feed(StageOutput(session_id=SID, epoch=1, step=0, stage_index=1, token=98)) == []
    (last,) = d.feed(StageOutput(session_id=SID, epoch=1, step=0, stage_index=0, payload="r"))
    assert last.final and last.wants_logits and last.positions == range(8, 10)
    out = d.feed(StageOutput(session_id=SID, epoch=1, step=0, stage_index=1, token=7))
    assert out[0] == EmitToken(SID, 1, 0, 7) and d.core.tokens == (7,)
    # a later route whose stages take fewer rows than the pinned chunk is refused...
    d.feed(
        StageFailed(
            session_id=SID, epoch=1, stage_index=1, kind=FaultKind.DEAD, detail="gone", step=1
        )
    )
    out = d.assign(with_max_rows(route("a", "c"), 2))
    assert of(out, RequestRoute) and d.core.reports[-1].fault is FaultKind.ROUTE_INVALID
    assert "at most 2 rows" in d.core.reports[-1].detail
    # ...and one that takes them re-prefills in the first run's chunks (replay "exact")
    d.assign(with_max_rows(route("a", "c"), 8))
    (replay,) = d.open_all()
    assert replay.positions == range(0, 4)


# ------------------------------------------------------------------------------------------
# Busy stages: load, not faults


def busy(d: Driver, stage: int, retry_after: float | None = None) -> list[Any]:
    return d.feed(
        StageFailed(
            session_id=SID,
            epoch=d.core.epoch,
            stage_index=stage,
            kind=FaultKind.BUSY,
            detail="no free slot",
            retry_after=retry_after,
        )
    )


def test_busy_at_open_waits_the_hint_and_spends_neither_attempts_nor_route_changes() -> None:
    policy = FailurePolicy(max_route_changes=0, max_attempts_per_step=1, admission_budget=10.0)
    d = Driver(policy=policy)
    d.start()
    for _ in range(5):  # far more than attempts (1) or route changes (0) would allow
        d.assign(route("a", "b"))
        d.feed(StageOpened(SID, d.core.epoch, 0))
        out = busy(d, 1, retry_after=0.5)
        # the epoch is closed on every stage (stage 0 gives its slot back), then it waits
        assert [c.stage_index for c in of(out, CloseStage)] == [0, 1]
        assert d.core.state is SessionState.ROUTE_LOST
        assert d.core.next_timer() == d.now + 0.5
        (request,) = of(d.tick(d.now + 0.5), RequestRoute)
        assert request.report.fault is FaultKind.BUSY and request.report.endpoint == "b"
    d.assign(route("a", "b"))
    d.open_all()
    for token in (7, 8, 9, 10):
        d.step(token)
    assert d.core.state is SessionState.DONE
    assert d.core.route_changes == 0
    assert [r.fault for r in d.core.reports] == [FaultKind.BUSY] * 5


def test_busy_past_the_admission_budget_fails_typed() -> None:
    policy = FailurePolicy(admission_budget=2.0, busy_retry=0.5, step_deadline=10.0)
    d = Driver(policy=policy)
    d.start()
    for _ in range(10):  # bounded: the budget ends it after 4 waits of 0.5 s
        if d.core.state is SessionState.FAILED:
            break
        d.assign(route("a"))
        busy(d, 0)  # no hint: the policy's busy_retry
        if d.core.state is SessionState.ROUTE_LOST:
            d.tick(d.core.next_timer() or d.now)
    error = d.core.error
    assert d.core.state is SessionState.FAILED
    assert isinstance(error, AdmissionTimeout)
    assert error.fault is FaultKind.BUSY and error.endpoint == "a"
    assert d.now == pytest.approx(2.0)


def test_busy_while_decoding_is_a_fault_like_any_other() -> None:
    d = Driver().running(route("a"))
    (request,) = of(busy(d, 0), RequestRoute)  # POLICY backs off 0 s: asks at once
    assert request.report.fault is FaultKind.BUSY
    assert d.core.attempts == 2  # counted against the step, as any fault outside opening


def test_forward_kinds_and_replay_modes_are_str_enums_equal_to_their_old_strings() -> None:
    assert dgr_session.ForwardKind is ForwardKind and dgr_session.ReplayMode is ReplayMode
    assert [kind.value for kind in ForwardKind] == ["prefill", "decode", "replay"]
    assert ForwardKind.PREFILL == "prefill" and isinstance(ForwardKind.REPLAY, str)
    assert {"decode": 1}[ForwardKind.DECODE] == 1  # a str key, as a label or a wire name
    assert FailurePolicy().replay is ReplayMode.BATCHED
    exact = FailurePolicy(replay="exact")  # the old spelling still works, and becomes the enum
    assert exact.replay is ReplayMode.EXACT and exact.replay == "exact"
    assert exact == FailurePolicy(replay=ReplayMode.EXACT)
    with pytest.raises(ValueError, match="'replay' must be in \\('batched', 'exact'\\)"):
        FailurePolicy(replay="fast")


def test_every_forward_names_its_kind_with_the_enum() -> None:
    d = Driver(prompt=(5, 6), max_new_tokens=5).running(route("a", "b"))
    _lose_stage_one_after_two_tokens(d)
    d.assign(route("a", "c"))
    d.open_all()
    forwards = of(d.log, Forward)
    assert {type(f.kind) for f in forwards} == {ForwardKind}
    assert {f.kind for f in forwards} == set(ForwardKind)


def test_event_dispatch_is_type_checked_without_ignores() -> None:
    """handle() dispatches with match over the event classes, so mypy checks each handler
    against its event; the core carries no ``type: ignore`` (mypy runs with
    warn_unused_ignores, and this says there is none to warn about)."""
    source = Path(dgr_session.core.__file__).read_text(encoding="utf-8")
    assert "type: ignore" not in source
    assert "match event:" in source
    for event in (Start(SID, 0.0), Cancel(SID)):
        assert f"case {type(event).__name__}():" in source
    d = Driver()
    with pytest.raises(TypeError, match="not a session event"):
        d.feed(Forward)  # a class, not an event: refused before anything changes
    d.start()
    impostor = RequestRoute(SID, 1, None)  # names this session, but is a command
    for wrong in (impostor, attrs.evolve(impostor, session_id="other"), "not an event"):
        with pytest.raises(TypeError, match="not a session event"):
            d.feed(wrong)
    assert d.core.state is SessionState.NEW and d.core.route_attempt == 1 and d.log == [impostor]


# ------------------------------------------------------------------------------------------
# Deterministic refusals end the session; every terminal error keeps its cause


def dark(*endpoints: str) -> Route:
    n = len(endpoints)
    cuts = [IDENTITY.n_layer * k // n for k in range(1, n)]
    return make_route(list(endpoints), cuts, identity=IDENTITY, lane=fixture_lane(certified=False))


def test_a_route_refused_the_same_way_again_ends_the_session_without_spending_attempts() -> None:
    d = Driver()  # three attempts per step
    d.start()
    (again,) = of(d.assign(dark("x", "y")), RequestRoute)
    assert again.report.fault is FaultKind.ROUTE_INVALID
    out = d.assign(dark("x2", "y2"))  # other workers, the same dark lane at the same stage
    assert of(out, RequestRoute) == [] and d.core.state is SessionState.FAILED
    error = d.core.error
    assert isinstance(error, RouteRefused)
    assert isinstance(error.refusal, DarkLane) and error.__cause__ is error.refusal
    assert (error.stage_index, error.endpoint, error.fault) == (0, "x2", FaultKind.ROUTE_INVALID)
    assert error.attempts == 2 and len(error.reports) == 2
    message = str(error)
    assert "stage 0 (x2) layers [0,3)" in message and "is dark" in message
    assert "not retried" in message and "attempt" not in message
    assert out[-1].reason is FinishReason.FAILED


def test_a_different_refusal_or_a_good_route_in_between_keeps_the_session_asking() -> None:
    d = Driver(max_new_tokens=2)
    d.start()
    d.assign(dark("x", "y"))  # stage 0 dark
    half = make_route(["a", "b"], [3], identity=IDENTITY)
    half = Route([half.stages[0], attrs.evolve(half.stages[1], lane=fixture_lane(False))])
    (request,) = of(d.assign(half), RequestRoute)  # stage 1 dark: another refusal
    assert request.report.stage_index == 1 and d.core.state is SessionState.REROUTING
    d.assign(route("a"))
    d.open_all()
    d.step(5)
    d.feed(StageFailed(session_id=SID, epoch=1, stage_index=0, kind=FaultKind.DEAD))
    (request,) = of(d.assign(half), RequestRoute)  # the first since a route was accepted
    assert request.report.fault is FaultKind.ROUTE_INVALID
    assert d.core.state is SessionState.REROUTING


def test_a_bad_request_ends_the_session_at_once_naming_the_stage_and_keeping_the_cause() -> None:
    d = Driver().running(route("a", "b"))
    cause = ValueError("DGR_E_INVALID_ARGUMENT: token id 99999 is outside the vocabulary")
    out = d.feed(
        StageFailed(
            session_id=SID,
            epoch=1,
            stage_index=0,
            kind=FaultKind.BAD_REQUEST,
            detail=repr(cause),
            step=0,
            error=cause,
        )
    )
    assert of(out, RequestRoute) == []  # no other route is tried: it would refuse the same
    assert len(of(out, CloseStage)) == 2 and d.core.state is SessionState.FAILED
    error = d.core.error
    assert isinstance(error, RequestRefused) and error.__cause__ is cause
    assert (error.stage_index, error.endpoint, error.fault) == (0, "a", FaultKind.BAD_REQUEST)
    assert error.attempts == 1 and "outside the vocabulary" in str(error)
    assert "not retried" in str(error)


def dead_stage(epoch: int, error: BaseException) -> StageFailed:
    return StageFailed(session_id=SID, epoch=epoch, stage_index=0, kind=FaultKind.DEAD, error=error)


def test_the_fault_that_spends_the_budget_is_the_terminal_errors_cause() -> None:
    d = Driver()
    d.start()
    errors = [ConnectionRefusedError(f"stage 0 (127.0.0.1:9) is unreachable {i}") for i in (1, 2)]
    d.feed(RouteUnavailable(SID, 1, str(errors[0]), 1, errors[0]))
    d.feed(RouteUnavailable(SID, 1, str(errors[1]), 2, errors[1]))
    d.feed(RouteUnavailable(SID, 1, "provider has no route", 3))
    error = d.core.error
    assert isinstance(error, NoRouteAvailable) and error.__cause__ is None  # the last had none
    d = Driver().running(route("a"))
    dead = ConnectionResetError("gone")
    for _attempt in (1, 2):  # two faults, each followed by a new route
        d.feed(dead_stage(d.core.epoch, ConnectionError("x")))
        assert d.core.state is SessionState.REROUTING
        d.assign(route("a"))
        d.open_all()
    d.feed(dead_stage(d.core.epoch, dead))  # the third: spent
    error = d.core.error
    assert isinstance(error, FailureBudgetExhausted) and error.__cause__ is dead


def test_no_route_names_the_unreachable_stage_the_provider_named() -> None:
    d = Driver(policy=attrs.evolve(POLICY, max_attempts_per_step=1))
    d.start()
    unreachable = StageUnreachable(
        "stage 1 (127.0.0.1:9) is unreachable: Connection refused",
        stage_index=1,
        endpoint="127.0.0.1:9",
    )
    d.feed(RouteUnavailable(SID, 1, str(unreachable), 1, unreachable))
    error = d.core.error
    assert isinstance(error, NoRouteAvailable) and error.__cause__ is unreachable
    assert "stage 1 (127.0.0.1:9) is unreachable: Connection refused" in str(error)
