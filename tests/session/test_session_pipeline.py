"""Pipelined forwards in the sans-I/O core: the rows a session knows ahead (prompt chunks and
replayed tokens) are in flight at several stages at once, and every stage still computes the
same calls, in the same order, as one forward at a time would give it."""

from __future__ import annotations

import collections
from typing import Any

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from dgr_session import (
    Command,
    EmitToken,
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    Forward,
    ForwardKind,
    OpenStage,
    RequestRoute,
    Route,
    RouteAssigned,
    RouteSession,
    StageFailed,
    StageOpened,
    StageOutput,
    Start,
)
from dgr_session.machine import SessionMachine
from dgr_session.pipeline import Chunk, EpochPipeline
from dgr_session.testing import fixture_identity, make_route

IDENTITY = fixture_identity(8)
SID = "p"


def route(n_stages: int, max_rows: int, tag: str) -> Route:
    cuts = [IDENTITY.n_layer * k // n_stages for k in range(1, n_stages)]
    r = make_route([f"{tag}{k}" for k in range(n_stages)], cuts, identity=IDENTITY)
    return Route(attrs.evolve(stage, max_rows=max_rows) for stage in r.stages)


def next_token(history: tuple[int, ...]) -> int:
    """What the simulated model picks after ``history``: depends on every row before it."""
    return (sum((i + 1) * t for i, t in enumerate(history)) * 7 + 3) % 97


@attrs.define
class SimulatedRoute:
    """Stands in for the stages of one epoch: each keeps its KV position, checks that its
    forwards come in order and carry the previous stage's rows for the same positions, and
    logs the calls it computed."""

    n_stages: int
    history: list[tuple[int, ...]] = attrs.Factory(list)  # per stage: the tokens it holds
    calls: list[list[tuple[range, tuple[int, ...], str]]] = attrs.Factory(list)
    in_flight: dict[int, Forward] = attrs.Factory(dict)  # stage -> its forward

    def __attrs_post_init__(self) -> None:
        self.history = [() for _ in range(self.n_stages)]
        self.calls = [[] for _ in range(self.n_stages)]

    def take(self, forward: Forward) -> None:
        k = forward.stage_index
        assert k not in self.in_flight, f"stage {k} got a second forward in flight"
        assert forward.positions.start == len(self.history[k]), "a forward out of order"
        if k == 0:
            assert forward.boundary is None
        else:
            assert forward.boundary == ("rows", k - 1, forward.positions)
        self.in_flight[k] = forward

    def chunks_on_the_way(self) -> int:
        """Chunks stage 0 took (answered or computing) that the last stage has not answered."""
        return len(self.calls[0]) + (0 in self.in_flight) - len(self.calls[-1])

    def answer(self, k: int) -> StageOutput:
        forward = self.in_flight.pop(k)
        self.history[k] += tuple(forward.token_ids)
        self.calls[k].append((forward.positions, tuple(forward.token_ids), forward.kind))
        if k < self.n_stages - 1:
            payload, token = ("rows", k, forward.positions), None
        else:
            payload, token = None, next_token(self.history[k])
        return StageOutput(
            session_id=SID,
            epoch=forward.epoch,
            step=forward.step,
            stage_index=k,
            payload=payload,
            token=token,
        )


def run(
    prompt: tuple[int, ...],
    max_new: int,
    n_stages: int,
    max_rows: int,
    replay: str,
    order: st.DataObject | None,
    lose_at: int | None,
    pipelined: bool = True,
) -> tuple[RouteSession, list[SimulatedRoute], int]:
    """Runs one session to its end; ``order`` (when given) picks which stage in flight answers
    next, else the furthest one does; at ``lose_at`` accepted tokens the last stage is lost
    once (right after that token is accepted, when only its decode forward is on the way).
    Returns the session, each epoch's route, and the most chunks ever on the way through the
    route at once."""
    policy = FailurePolicy(step_deadline=5.0, backoff=(0.0,), replay=replay, pipelined=pipelined)
    core = RouteSession(
        SID,
        prompt,
        max_new_tokens=max_new,
        policy=policy,
        machine=SessionMachine(),
        required_evidence=EvidenceClass.FIXTURE,
    )
    routes: list[SimulatedRoute] = []
    most = 0
    lost = False
    pending = collections.deque(core.handle(Start(SID, 0.0)))
    for _ in range(10_000):  # bounded: far more events than any example needs
        while pending:  # route requests and opens are answered at once
            command = pending.popleft()
            if isinstance(command, RequestRoute):
                routes.append(SimulatedRoute(n_stages))
                r = route(n_stages, max_rows, "abcdefgh"[len(routes) - 1])
                pending += core.handle(RouteAssigned(SID, command.epoch, r, command.attempt))
            elif isinstance(command, OpenStage):
                pending += core.handle(StageOpened(SID, command.epoch, command.stage_index))
            elif isinstance(command, Forward):
                routes[-1].take(command)
        if core.finished:
            return core, routes, most
        sim = routes[-1]
        most = max(most, sim.chunks_on_the_way())
        assert sim.in_flight, "a live session with nothing in flight"
        if lose_at is not None and not lost and len(core.tokens) == lose_at:
            lost = True
            sim.in_flight.clear()
            fault = StageFailed(
                session_id=SID,
                epoch=core.epoch,
                stage_index=n_stages - 1,
                kind=FaultKind.DEAD,
                detail="killed",
            )
            pending += core.handle(fault)
            continue
        stages = sorted(sim.in_flight)
        k = stages[-1] if order is None else order.draw(st.sampled_from(stages))
        pending += core.handle(sim.answer(k))
    raise AssertionError("the session did not end")


CASES = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(0, 90), min_size=1, max_size=12).map(tuple),
        "max_new": st.integers(1, 6),
        "n_stages": st.integers(1, 4),
        "max_rows": st.integers(1, 5),
        "replay": st.sampled_from(["exact", "batched"]),
    }
)


@settings(max_examples=150, deadline=None)
@given(case=CASES, lose=st.booleans(), data=st.data())
def test_pipelined_stages_compute_what_one_forward_in_flight_computes(
    case: dict[str, Any], lose: bool, data: st.DataObject
) -> None:
    lose_at = data.draw(st.integers(0, case["max_new"] - 1)) if lose else None
    serial, serial_routes, serial_most = run(**case, order=None, lose_at=lose_at, pipelined=False)
    piped, piped_routes, piped_most = run(**case, order=data, lose_at=lose_at)
    # the same tokens, and each epoch's stages computed the same calls in the same order
    assert piped.tokens == serial.tokens
    history = case["prompt"]
    for token in piped.tokens:
        assert token == next_token(history)
        history += (token,)
    assert len(piped_routes) == len(serial_routes)
    for piped_route, serial_route in zip(piped_routes, serial_routes, strict=True):
        assert piped_route.calls == serial_route.calls
    # not pipelined, one chunk is on the way at a time; pipelined, a stage takes its next
    # chunk only once the next stage took its output: at most two chunks per stage are on the
    # way (one computing, one waiting to be taken)
    assert serial_most == 1
    assert piped_most <= 2 * case["n_stages"] - 1


def test_an_exact_replay_keeps_every_stage_busy_at_once() -> None:
    """Four stages replaying eight accepted tokens one per forward: once the pipeline fills,
    all four stages compute at once, and the replay's forwards reach every stage in order."""
    prompt = (1, 2, 3)

    def answer_all(sim: SimulatedRoute) -> list[StageOutput]:
        return [sim.answer(k) for k in sorted(sim.in_flight, reverse=True)]

    core = RouteSession(
        SID,
        prompt,
        max_new_tokens=12,
        policy=FailurePolicy(backoff=(0.0,), replay="exact"),
        machine=SessionMachine(),
        required_evidence=EvidenceClass.FIXTURE,
    )
    sims = [SimulatedRoute(4), SimulatedRoute(4)]
    out = core.handle(Start(SID, 0.0))
    (request,) = out
    out = core.handle(RouteAssigned(SID, 1, route(4, 8, "a"), request.attempt))
    for k in range(4):
        out = core.handle(StageOpened(SID, 1, k))
    for _ in range(200):  # decode 8 tokens, one forward at a time
        if len(core.tokens) == 8:
            break
        for f in out:
            if isinstance(f, Forward):
                sims[0].take(f)
        out = []
        for output in answer_all(sims[0]):
            out += core.handle(output)
    assert len(core.tokens) == 8
    out = core.handle(
        StageFailed(session_id=SID, epoch=1, stage_index=2, kind=FaultKind.DEAD, detail="killed")
    )
    (request,) = [c for c in out if isinstance(c, RequestRoute)]
    out = core.handle(RouteAssigned(SID, 2, route(4, 8, "b"), request.attempt))
    for k in range(4):
        out = core.handle(StageOpened(SID, 2, k))
    widest = 0
    for _ in range(200):  # the replay, answering every stage in flight each round
        for f in out:
            if isinstance(f, Forward):
                sims[1].take(f)
        widest = max(widest, len(sims[1].in_flight))
        out = []
        for output in answer_all(sims[1]):
            out += core.handle(output)
        if any(isinstance(c, EmitToken) for c in out):
            break
    assert widest == 4
    # every stage computed the prompt, then each accepted token in a call of its own
    expected = [(range(0, 3), prompt, "replay")]
    expected += [(range(3 + i, 4 + i), (t,), "replay") for i, t in enumerate(core.tokens[:7])]
    # the newest accepted token was never computed: a decode, whose logits pick token 9
    expected += [(range(10, 11), (core.tokens[7],), "decode")]
    assert all(calls == expected for calls in sims[1].calls)
    assert core.kv_positions == 11 and len(core.tokens) == 9


PER_EPOCH_FIELDS = {
    "_opened",
    "_kv_pos",
    "_sent",
    "_flight",
    "_stage_done",
    "_computing",
    "_slot",
    "_hop_started",
    "_hop_seconds",
}


def test_a_new_epoch_starts_with_a_new_empty_pipeline() -> None:
    """The session keeps no per-epoch field of its own (it has no slot for one): the opens and
    forwards in flight live in one EpochPipeline, made new on each route assignment. A stage
    lost with chunks on their way leaves nothing behind for the next epoch."""
    assert PER_EPOCH_FIELDS.isdisjoint(RouteSession.__slots__)
    core = RouteSession(
        SID,
        tuple(range(1, 9)),
        max_new_tokens=3,
        policy=FailurePolicy(backoff=(0.0,)),
        machine=SessionMachine(),
        required_evidence=EvidenceClass.FIXTURE,
    )
    (request,) = core.handle(Start(SID, 0.0))
    core.handle(RouteAssigned(SID, 1, route(3, 2, "a"), request.attempt))
    for k in range(3):
        out = core.handle(StageOpened(SID, 1, k))
    sim = SimulatedRoute(3)
    for command in out:
        sim.take(command)
    for k in (0, 0, 1):  # stage 0 answers twice, stage 1 once: three chunks on their way
        out = core.handle(sim.answer(k))
        for command in out:
            if isinstance(command, Forward):
                sim.take(command)
    old = core._pipe
    assert len(old.flight) == 3 and old.computing and old.sent == 6 and old.opened == 0b111
    assert any(v is not None for v in old.hop_seconds)

    out = core.handle(
        StageFailed(session_id=SID, epoch=1, stage_index=2, kind=FaultKind.DEAD, detail="lost")
    )
    (request,) = [c for c in out if isinstance(c, RequestRoute)]
    core.handle(RouteAssigned(SID, 2, route(2, 4, "b"), request.attempt))

    new = core._pipe
    assert new is not old and core.epoch == 2 and new.epoch == 2
    assert (new.n_stages, new.opened, new.kv_pos, new.sent, new.computing) == (2, 0, 0, 0, 0)
    assert new.flight == [] and new.stage_done == [0, 0]
    assert new.hop_seconds == [None, None] and new.hop_times() == (None, None)
    assert core.opened_stages == () and core.kv_positions == 0
    # the old epoch's pipeline is left as the fault found it: nothing was reset by hand
    assert len(old.flight) == 3 and old.sent == 6


def test_an_epoch_pipeline_moves_named_chunks_through_its_stages_in_order() -> None:
    """EpochPipeline on its own: a chunk into stage 0 is relayed stage by stage, a stage takes
    its next chunk only once the next stage took its output, and the last stage's answer
    completes the oldest chunk, named by its fields."""
    stages = route(3, 8, "a").stages
    pipe = EpochPipeline(SID, 4, stages, True)
    assert pipe.first_unopened() == 0
    assert [pipe.confirm_open(k) for k in (0, 2, 1)] == [False, False, True]
    assert pipe.opened_stages() == (0, 1, 2) and pipe.first_unopened() is None
    first = Chunk(range(0, 2), (5, 6), ForwardKind.PREFILL, False)
    second = Chunk(range(2, 3), (7,), ForwardKind.PREFILL, True)
    out: list[Command] = []
    assert pipe.pump(0, 0, 1.0, out)  # every stage is idle: stage 0 takes a chunk
    pipe.send(0, first, None, 0, 1.0, out)
    assert not pipe.pump(0, 0, 1.0, out)  # stage 0 is computing
    assert pipe.relay(0, "rows0", 0, 2.0, out)  # stage 1 takes them; stage 0 is free again
    pipe.send(0, second, None, 0, 2.0, out)
    assert not pipe.relay(0, "rows0'", 0, 3.0, out)  # stage 1 is busy: the rows wait
    assert pipe.computing_stages() == [1] and pipe.furthest_computing() == 1
    assert pipe.relay(1, "rows1", 0, 4.0, out)  # stages 2 and 1 go on; stage 0 is free
    assert pipe.computing_stages() == [1, 2]
    assert pipe.complete(5.0) is first and pipe.kv_pos == 2
    assert not pipe.relay(1, "rows1'", 0, 6.0, out)
    done = pipe.complete(7.0)
    assert done is second and done.positions == range(2, 3) and done.wants_logits
    assert pipe.kv_pos == 3 and pipe.flight == [] and pipe.computing == 0
    forwards = [(f.stage_index, f.positions, f.boundary, f.kind, f.final) for f in out]
    assert forwards == [
        (0, range(0, 2), None, "prefill", False),
        (1, range(0, 2), "rows0", "prefill", False),
        (0, range(2, 3), None, "prefill", False),
        (2, range(0, 2), "rows1", "prefill", True),
        (1, range(2, 3), "rows0'", "prefill", False),
        (2, range(2, 3), "rows1'", "prefill", True),
    ]
    assert all(f.session_id == SID and f.epoch == 4 and f.step == 0 for f in out)
    assert [f.wants_logits for f in out] == [False, False, True, False, True, True]
    assert pipe.hop_times() == (3.0 - 2.0, 6.0 - 4.0, 7.0 - 6.0)  # each stage's last forward
