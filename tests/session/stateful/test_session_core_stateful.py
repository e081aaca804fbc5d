"""Stateful property test: many sessions in one SessionManager over a faulty fake transport.

Rules start sessions, let virtual time pass, kill / hang / revive workers (reviving a hung worker
delivers its held replies late, i.e. stale replies of dead epochs), inject engine errors and
cancel sessions. After every rule the loop is settled (everything ready has run, the clock has
not moved) and the invariants are checked against a trivially correct model: the fault-free
whole-model greedy tokens.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    SessionMachine,
    SessionManager,
)
from dgr_session.testing import (
    FakeModel,
    FakeTransport,
    PoolRouteProvider,
    close_loop,
    fixture_identity,
)
from tests.session.stateful._fleet_invariants import SessionOutcomeInvariants

MODEL = FakeModel(n_layer=6, vocab=16)
IDENTITY = fixture_identity(MODEL.n_layer)
WORKERS = ("w0", "w1", "w2", "w3", "w4")
POLICY = FailurePolicy(
    step_deadline=1.0,
    session_deadline=30.0,
    max_route_changes=3,
    max_attempts_per_step=3,
    backoff=(0.0, 0.25, 0.5),
)
MAX_LIVE = 6

layouts = st.lists(
    st.lists(st.integers(1, MODEL.n_layer - 1), unique=True, max_size=3).map(sorted),
    min_size=1,
    max_size=3,
)
prompts = st.lists(st.integers(0, MODEL.vocab - 1), min_size=1, max_size=6).map(tuple)


class SessionFleet(SessionOutcomeInvariants, RuleBasedStateMachine):
    policy = POLICY
    sessions = Bundle("sessions")

    def __init__(self) -> None:
        super().__init__()
        self.init_fleet()
        self.transport = FakeTransport(MODEL)
        self.machine = SessionMachine()
        self.kills = dict.fromkeys(WORKERS, 0)
        # kill counts when an epoch was first seen live: a worker killed since lost the slot
        self.kills_at_epoch: dict[tuple[str, int], dict[str, int]] = {}

    def reference(self, prompt: tuple[int, ...], max_new: int, stop: set[int]) -> tuple[int, ...]:
        return MODEL.reference(prompt, max_new, stop)

    # -- rules -------------------------------------------------------------------------------

    @initialize(
        target=sessions,
        cuts=layouts,
        latency=st.sampled_from([0.0, 0.05, 0.2]),
        first=st.lists(st.tuples(prompts, st.integers(1, 6)), min_size=1, max_size=4),
    )
    def setup(
        self, cuts: list[list[int]], latency: float, first: list[tuple[tuple[int, ...], int]]
    ) -> MultipleResults[str]:
        """A pool of workers, routes cut at random layers, each reply taking ``latency`` seconds
        of loop time, and a first batch of sessions."""
        provider = PoolRouteProvider(self.transport, WORKERS, cuts, identity=IDENTITY)
        self.transport.latency = latency * POLICY.step_deadline
        self.manager = SessionManager(
            self.transport,
            provider,
            policy=POLICY,
            required_evidence=EvidenceClass.FIXTURE,  # the pool's routes run on fixture lanes
            machine=self.machine,
        )
        return multiple(*(self.start_session(p, max_new, set()) for p, max_new in first))

    @precondition(lambda self: self.manager is not None and len(self.manager) < MAX_LIVE)
    @rule(
        target=sessions,
        prompt=prompts,
        max_new=st.integers(1, 6),
        stop=st.sets(st.integers(0, MODEL.vocab - 1), max_size=2),
    )
    def start(self, prompt: tuple[int, ...], max_new: int, stop: set[int]) -> str:
        return self.start_session(prompt, max_new, stop)

    @rule(worker=st.sampled_from(WORKERS))
    def kill(self, worker: str) -> None:
        self.transport.kill(worker)
        self.kills[worker] += 1
        self.settle()

    @rule(worker=st.sampled_from(WORKERS))
    def hang(self, worker: str) -> None:
        self.transport.hang(worker)
        self.settle()

    @rule(worker=st.sampled_from(WORKERS))
    def revive(self, worker: str) -> None:
        """Bring a dead worker back, empty (a hung one is released as well)."""
        self.transport.revive(worker)
        self.settle()

    @rule(worker=st.sampled_from(WORKERS))
    def deliver_late_replies(self, worker: str) -> None:
        """A hung worker answers: its held replies, often of epochs abandoned after a deadline,
        arrive late and must be dropped, never applied."""
        before = {sid: h.core.stale_events_dropped for sid, h in self.handles.items()}
        self.transport.release(worker)
        self.settle()
        for sid, handle in self.handles.items():
            assert handle.core.stale_events_dropped >= before[sid]

    @rule(worker=st.sampled_from(WORKERS), count=st.integers(1, 2))
    def engine_error(self, worker: str, count: int) -> None:
        self.transport.fail_next(worker, count)
        self.settle()

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def no_stage_ever_saw_an_incorrect_request(self) -> None:
        """No duplicate open, no position that does not continue the KV, no wrong rows."""
        assert self.transport.violations == []

    @invariant()
    def open_slots_match_the_sessions_held(self) -> None:
        """Every slot on a worker belongs to the live epoch of a running session; every stage
        that confirmed its open holds one, unless its worker was killed since."""
        if self.manager is None:
            return
        allowed: dict[tuple[str, str], int] = {}
        required: set[tuple[str, str]] = set()
        for sid, handle in self.handles.items():
            core = handle.core
            if not core.live_epoch or core.route is None:
                continue
            seen = self.kills_at_epoch.setdefault((sid, core.epoch), dict(self.kills))
            for index, stage in enumerate(core.route.stages):
                allowed[(stage.endpoint, sid)] = core.epoch
                ep = stage.endpoint
                confirmed = index in core.opened_stages
                if confirmed and self.transport.alive(ep) and self.kills[ep] == seen[ep]:
                    required.add((ep, sid))
        slots = self.transport.slots()
        assert required <= slots.keys()
        assert all(allowed.get(key) == epoch for key, epoch in slots.items()), (slots, allowed)
        live = [h for h in self.handles.values() if not h.core.finished]
        assert len(self.manager) == len(live) == self.machine.member_count
        if not live:
            assert slots == {}

    def teardown(self) -> None:
        try:
            if self.manager is not None:
                self.run(self.manager.aclose(grace=POLICY.step_deadline))
                self.settle()
                assert len(self.manager) == 0
                assert self.transport.slots() == {}
                assert self.machine.member_count == 0
        finally:
            close_loop(self.loop)


SessionFleet.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSessionFleet = SessionFleet.TestCase
