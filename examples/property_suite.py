"""How your own hypothesis suite checks YOUR route provider against dgr's session invariants.

Run: ``.venv/bin/python examples/property_suite.py`` (a few seconds). ``dgr_session.testing``
supplies what the suite runs on, none of it a network or a real model: ``FakeModel`` (a small
deterministic layered model with per-layer "KV" and its fault-free ``reference`` generation),
``FakeTransport`` (stages over it with fault injection: kill, revive, hang), and
``VirtualClockLoop`` (an event loop whose clock jumps to the next timer, so deadlines and
backoff fire at once and every run is deterministic). The state machine below starts sessions
through a ``SessionManager`` over the provider under test, injects faults, lets virtual time
pass, and after every step checks what must hold whatever the provider does:

- a session's tokens are always a prefix of the fault-free tokens, and equal them once done;
- epochs never decrease; a failed session carries a typed ``SessionFailed`` error;
- every stage slot belongs to the live epoch of a running session: nothing leaks;
- (the provider's own promise) a session is never routed back to a stage that failed it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Coroutine
from typing import Any, TypeVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FailureReport,
    Route,
    SessionFailed,
    SessionHandle,
    SessionManager,
    SessionState,
)
from dgr_session.testing import (
    FakeModel,
    FakeTransport,
    VirtualClockLoop,
    close_loop,
    fixture_identity,
    make_route,
    settle,
)

T = TypeVar("T")
MODEL = FakeModel(n_layer=6, vocab=16)
POOL = ("w0", "w1", "w2", "w3")
POLICY = FailurePolicy(step_deadline=1.0, session_deadline=30.0, backoff=(0.0, 0.5))
TOTALS: collections.Counter[str] = collections.Counter()  # outcomes over the whole run


class RoundRobin:
    """The provider under test (yours goes here): two-stage routes cut at layer 3, stages
    taken round-robin from the pool, never a worker that has failed this session before."""

    def __init__(self) -> None:
        self.turn = 0
        self.blamed: dict[str, set[str]] = collections.defaultdict(set)

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        if report is not None and report.endpoint is not None:
            self.blamed[session_id].add(report.endpoint)
        usable = [w for w in POOL if w not in self.blamed[session_id]]
        if len(usable) < 2:
            return None  # the session fails with NoRouteAvailable (a typed error)
        self.turn += 1
        pair = [usable[self.turn % len(usable)], usable[(self.turn + 1) % len(usable)]]
        return make_route(pair, [3], identity=fixture_identity(MODEL.n_layer))


class ProviderSuite(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = VirtualClockLoop()
        self.transport = FakeTransport(MODEL, latency=0.1)  # replies take 0.1 s (virtual)
        # make_route's lanes are certified with fixture evidence; a manager routes only lanes
        # certified at the class it requires (real-hardware by default), so ask for fixture.
        self.manager = SessionManager(
            self.transport, RoundRobin(), policy=POLICY, required_evidence=EvidenceClass.FIXTURE
        )
        self.handles: dict[str, SessionHandle] = {}
        self.expected: dict[str, tuple[int, ...]] = {}
        self.epochs: dict[str, int] = {}

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        result = self.loop.run_until_complete(coro)
        self.loop.run_until_complete(settle())  # everything ready has run; time stands still
        return result

    @precondition(lambda self: len(self.manager) < 4)
    @rule(prompt=st.lists(st.integers(0, 15), min_size=1, max_size=5), n=st.integers(1, 6))
    def start(self, prompt: list[int], n: int) -> None:
        sid = f"s{len(self.handles)}"

        async def begin() -> SessionHandle:  # SessionManager.start needs a running loop
            return self.manager.start(prompt, max_new_tokens=n, session_id=sid)

        self.handles[sid] = self.run(begin())
        self.expected[sid] = MODEL.reference(prompt, n)

    @rule(seconds=st.sampled_from([0.1, 0.5, 2.0]))
    def let_time_pass(self, seconds: float) -> None:
        self.run(asyncio.sleep(seconds))

    @rule(worker=st.sampled_from(POOL), fault=st.sampled_from(["kill", "hang", "revive"]))
    def inject(self, worker: str, fault: str) -> None:
        getattr(self.transport, fault)(worker)  # revive also releases a hung worker's replies
        self.run(asyncio.sleep(0))

    @invariant()
    def sessions_keep_their_promises(self) -> None:
        for sid, handle in self.handles.items():
            core = handle.core
            assert core.tokens == self.expected[sid][: len(core.tokens)]
            assert core.state is not SessionState.DONE or core.tokens == self.expected[sid]
            assert core.epoch >= self.epochs.get(sid, 0)
            self.epochs[sid] = core.epoch
            if core.state is SessionState.FAILED:
                assert isinstance(core.error, SessionFailed), core.error
            blamed = {r.endpoint for r in core.reports}
            if core.live_epoch and core.route is not None:  # the provider's own promise
                assert not blamed & set(core.route.endpoints), (sid, core.route.endpoints)

    @invariant()
    def no_slot_leaks(self) -> None:
        live = {h.session_id: h.core.epoch for h in self.handles.values() if h.core.live_epoch}
        for (endpoint, sid), epoch in self.transport.slots().items():
            assert live.get(sid) == epoch, (endpoint, sid, epoch)

    def teardown(self) -> None:
        try:
            self.run(self.manager.aclose())
            assert self.transport.slots() == {}  # every stage closed, also after faults
            TOTALS.update(h.core.state.value for h in self.handles.values())
        finally:
            close_loop(self.loop)


if __name__ == "__main__":
    # Small and bounded so the example ends in seconds; a real suite keeps hypothesis's
    # defaults (random search, the example database) and runs under pytest as a TestCase:
    # ``TestProviderSuite = ProviderSuite.TestCase``.
    run_state_machine_as_test(
        ProviderSuite,
        settings=settings(
            max_examples=100, stateful_step_count=30, deadline=None, database=None, derandomize=True
        ),
    )
    # "cancelled": still running when an example ended (teardown's aclose cancels them)
    print(f"sessions ended: {dict(sorted(TOTALS.items()))}")
    assert TOTALS["done"] > 0 and TOTALS["failed"] > 0  # both paths were exercised
    print("property_suite: OK")
