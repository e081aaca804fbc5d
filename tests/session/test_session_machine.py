"""The transition table: every entry reachable by events, every missing entry refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from transitions import MachineError

from dgr_session import (
    TRANSITIONS,
    Cancel,
    ClockTick,
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    InvalidTransition,
    RouteAssigned,
    RouteSession,
    RouteUnavailable,
    SessionMachine,
    SessionState,
    StageFailed,
    StageOpened,
    StageOutput,
    Start,
    shared_machine,
)
from dgr_session.machine import LIVE_STATES, NEXT_STATE, TERMINAL_STATES, TRIGGERS
from dgr_session.testing import fixture_identity, make_route

S = SessionState
IDENTITY = fixture_identity(4)
ROUTE = make_route(["a", "b"], [2], identity=IDENTITY)
POLICY = FailurePolicy(step_deadline=10.0, session_deadline=1000.0, backoff=(5.0,))
STOP = 31


class Model:
    _state: str


def test_table_shape() -> None:
    assert {s.value for s in SessionState} == {
        "new", "opening", "prefilling", "decoding", "done",
        "route_lost", "rerouting", "failed", "cancelled",
    }  # fmt: skip
    sources_with_exits = {source for (source, _trigger) in NEXT_STATE}
    assert sources_with_exits == {s.value for s in LIVE_STATES}
    assert TERMINAL_STATES == {S.DONE, S.FAILED, S.CANCELLED}
    for state in LIVE_STATES:  # every live state can fail and be cancelled
        assert NEXT_STATE[(state.value, "exhausted")] is S.FAILED
        assert NEXT_STATE[(state.value, "cancel")] is S.CANCELLED


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "library"])
@pytest.mark.parametrize("state", list(SessionState))
@pytest.mark.parametrize("trigger", TRIGGERS)
def test_machine_follows_the_table_exactly(state: SessionState, trigger: str, direct: bool) -> None:
    """Both dispatch paths (the direct table and the library's own) give the table's answer."""
    machine = SessionMachine(direct=direct)
    model = Model()
    machine.add_model(model, initial=state.value)
    dest = NEXT_STATE.get((state.value, trigger))
    if dest is None:
        with pytest.raises(MachineError):
            machine.fire(model, trigger)
        assert model._state == state.value
    else:
        machine.fire(model, trigger)
        assert model._state == dest.value


def test_direct_table_is_the_library_machine_itself() -> None:
    machine = SessionMachine()
    assert machine.direct_table() == {key: dest.value for key, dest in NEXT_STATE.items()}
    assert SessionMachine(direct=False)._direct == {}


def test_a_machine_with_a_callback_has_no_direct_table() -> None:
    """A callback anywhere would be skipped by the direct path: then every trigger must go
    through the library, and the callback runs."""
    entered: list[str] = []
    machine = SessionMachine()
    machine.on_enter_decoding(lambda *_: entered.append("decoding"))
    assert machine.direct_table() == {}
    machine._direct = machine.direct_table()
    model = Model()
    machine.add_model(model, initial=S.PREFILLING.value)
    machine.fire(model, "token_accepted")
    assert model._state == "decoding" and entered == ["decoding"]


def test_add_model_refuses_an_unknown_state() -> None:
    with pytest.raises(ValueError, match="'nowhere' is not a state"):
        SessionMachine().add_model(Model(), initial="nowhere")


def test_machine_binds_nothing_onto_sessions() -> None:
    machine = SessionMachine()
    model = Model()
    machine.add_model(model)
    assert vars(model) == {"_state": "new"}
    assert machine.member_count == 1 and machine.models == []
    machine.remove_model(model)
    assert machine.member_count == 0


def test_one_shared_machine_per_thread() -> None:
    import threading

    assert shared_machine() is shared_machine()
    other: list[SessionMachine] = []
    thread = threading.Thread(target=lambda: other.append(shared_machine()))
    thread.start()
    thread.join()
    assert other[0] is not shared_machine()


# ------------------------------------------------------------------------------------------
# Every entry, reached through the core's events


class Drive:
    def __init__(self) -> None:
        self.core = RouteSession(
            "t",
            [1, 2],
            max_new_tokens=8,
            policy=POLICY,
            stop_tokens=[STOP],
            required_evidence=EvidenceClass.FIXTURE,  # ROUTE runs on fixture lanes
        )
        self.now = 0.0

    def feed(self, event: object) -> None:
        self.core.handle(event)  # type: ignore[arg-type]

    def tick(self, dt: float) -> None:
        self.now += dt
        self.feed(ClockTick("t", self.now))

    def assign(self) -> None:
        self.feed(RouteAssigned("t", self.core.epoch + 1, ROUTE, self.core.route_attempt))

    def refuse(self) -> None:
        self.feed(RouteUnavailable("t", self.core.epoch + 1, "", self.core.route_attempt))

    def open_all(self) -> None:
        for index in range(2):
            self.feed(StageOpened("t", self.core.epoch, index))

    def step(self, token: int = 3) -> None:
        epoch, step = self.core.epoch, self.core.step
        self.feed(
            StageOutput(session_id="t", epoch=epoch, step=step, stage_index=0, payload=("rows",))
        )
        self.feed(StageOutput(session_id="t", epoch=epoch, step=step, stage_index=1, token=token))

    def lose_stage(self) -> None:
        self.feed(
            StageFailed(
                session_id="t",
                epoch=self.core.epoch,
                stage_index=0,
                kind=FaultKind.DEAD,
                detail="killed",
            )
        )


def reach(state: SessionState) -> Drive:
    d = Drive()
    d.feed(Start("t", 0.0))
    paths: dict[SessionState, list[Callable[[Drive], None]]] = {
        S.NEW: [],
        S.OPENING: [Drive.assign],
        S.PREFILLING: [Drive.assign, Drive.open_all],
        S.DECODING: [Drive.assign, Drive.open_all, Drive.step],
        S.ROUTE_LOST: [Drive.assign, Drive.open_all, Drive.step, Drive.lose_stage],
        S.REROUTING: [Drive.assign, Drive.open_all, Drive.lose_stage, lambda d: d.tick(5.0)],
    }
    for action in paths[state]:
        action(d)
    assert d.core.state is state
    return d


TRIGGER_EVENTS: dict[str, Callable[[Drive], None]] = {
    "route_assigned": Drive.assign,
    "stages_opened": Drive.open_all,
    "token_accepted": Drive.step,
    "finished": lambda d: d.step(STOP),
    "stage_lost": Drive.lose_stage,
    "route_refused": Drive.refuse,
    "backoff_elapsed": lambda d: d.tick(5.0),
    "exhausted": lambda d: d.tick(1000.0),
    "cancel": lambda d: d.feed(Cancel("t")),
}

ENTRIES = [(trigger, source, dest) for trigger, sources, dest in TRANSITIONS for source in sources]


@pytest.mark.parametrize(("trigger", "source", "dest"), ENTRIES, ids=lambda v: str(v))
def test_each_table_entry_is_reached_by_its_event(
    trigger: str, source: SessionState, dest: SessionState
) -> None:
    d = reach(source)
    epoch = d.core.epoch
    TRIGGER_EVENTS[trigger](d)
    assert d.core.state is dest
    assert d.core.epoch == epoch + (1 if trigger == "route_assigned" else 0)


def test_every_trigger_has_an_event() -> None:
    assert set(TRIGGER_EVENTS) == set(TRIGGERS)


@pytest.mark.parametrize("terminal", sorted(TERMINAL_STATES))
def test_terminal_states_absorb_every_event(terminal: SessionState) -> None:
    d = reach(S.DECODING)
    if terminal is S.DONE:
        d.step(STOP)
    elif terminal is S.FAILED:
        d.tick(1000.0)
    else:
        d.feed(Cancel("t"))
    tokens = d.core.tokens
    for trigger, make_event in TRIGGER_EVENTS.items():
        if trigger in {"route_assigned", "route_refused", "stages_opened", "token_accepted",
                       "finished", "stage_lost"}:  # fmt: skip
            continue  # answers of a closed epoch: dropped, checked below
        make_event(d)
        assert d.core.state is terminal
    dropped = d.core.stale_events_dropped
    d.step(5)
    d.lose_stage()
    assert d.core.state is terminal and d.core.tokens == tokens
    assert d.core.stale_events_dropped == dropped + 3


def test_a_missing_entry_is_a_typed_error_naming_state_and_trigger() -> None:
    d = reach(S.DECODING)
    with pytest.raises(InvalidTransition) as caught:
        d.core._fire("stages_opened")
    assert caught.value.state == "decoding" and caught.value.event == "stages_opened"
    assert d.core.state is S.DECODING
