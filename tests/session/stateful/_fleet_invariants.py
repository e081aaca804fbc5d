"""Rules and invariants shared by the stateful session tests (fake transport and real engine).

A mixin for a ``RuleBasedStateMachine`` over one ``SessionManager`` on a virtual-clock loop:
it keeps ``handles`` (session id -> handle), ``expected`` (session id -> fault-free whole-model
tokens), ``cancelled`` (ids the test cancelled) and ``last_epoch`` (session id -> epoch last
seen); a subclass sets the class attribute ``policy``, calls ``init_fleet()`` from its
``__init__``, creates ``self.manager`` in its setup, starts sessions with ``start_session`` and
says what the fault-free tokens are (``reference``).
"""

from __future__ import annotations

import asyncio

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, invariant, rule

from dgr_session import (
    FailureBudgetExhausted,
    FailurePolicy,
    NoRouteAvailable,
    SessionDeadlineExceeded,
    SessionFailed,
    SessionHandle,
    SessionManager,
    SessionState,
)
from dgr_session.testing import VirtualClockLoop, settle

sessions = Bundle("sessions")
"""Session ids (a bundle is found by name: subclasses' ``Bundle("sessions")`` is this one)."""


class SessionOutcomeInvariants:
    policy: FailurePolicy
    handles: dict[str, SessionHandle]
    expected: dict[str, tuple[int, ...]]
    cancelled: set[str]
    last_epoch: dict[str, int]

    def init_fleet(self) -> None:
        self.loop = VirtualClockLoop()
        self.manager: SessionManager | None = None
        self.handles = {}
        self.expected = {}
        self.cancelled = set()
        self.last_epoch = {}
        self.count = 0

    def reference(self, prompt: tuple[int, ...], max_new: int, stop: set[int]) -> tuple[int, ...]:
        """The fault-free whole-model tokens of a session."""
        raise NotImplementedError

    def run(self, coro: object) -> object:
        return self.loop.run_until_complete(coro)  # type: ignore[arg-type]

    def settle(self) -> None:
        self.run(settle())

    def start_session(self, prompt: tuple[int, ...], max_new: int, stop: set[int]) -> str:
        assert self.manager is not None
        sid = f"s{self.count}"
        self.count += 1
        manager = self.manager

        async def begin() -> SessionHandle:
            return manager.start(prompt, max_new_tokens=max_new, session_id=sid, stop_tokens=stop)

        self.handles[sid] = self.run(begin())  # type: ignore[assignment]
        self.expected[sid] = self.reference(prompt, max_new, stop)
        self.settle()
        return sid

    # -- shared rules ------------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 2.5]))
    def let_time_pass(self, dt: float) -> None:
        self.run(asyncio.sleep(dt * self.policy.step_deadline))
        self.settle()

    @rule(sid=sessions)
    def cancel(self, sid: str) -> None:
        handle = self.handles[sid]
        was_live = not handle.core.finished
        tokens = handle.core.tokens
        handle.cancel("rule")
        if was_live:
            self.cancelled.add(sid)
        self.settle()
        # a live session ends cancelled; a finished one is as it was (and, by the invariant
        # below, cancelled only if the test cancelled it)
        if was_live:
            assert handle.core.state is SessionState.CANCELLED
        assert handle.core.tokens == tokens

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def epochs_never_decrease(self) -> None:
        for sid, handle in self.handles.items():
            epoch = handle.core.epoch
            assert epoch >= self.last_epoch.get(sid, 0)
            self.last_epoch[sid] = epoch

    @invariant()
    def tokens_are_always_a_prefix_of_the_fault_free_tokens(self) -> None:
        """So no session ever observes another's state, or a stale epoch's."""
        for sid, handle in self.handles.items():
            tokens = handle.core.tokens
            assert tokens == self.expected[sid][: len(tokens)], sid
            if handle.core.state is SessionState.DONE:
                assert tokens == self.expected[sid]

    @invariant()
    def ended_sessions_ended_for_a_reason_within_policy(self) -> None:
        policy = self.policy
        for sid, handle in self.handles.items():
            core = handle.core
            assert core.route_changes <= policy.max_route_changes
            assert all(r.attempt <= policy.max_attempts_per_step for r in core.reports)
            if core.state is SessionState.CANCELLED:
                assert sid in self.cancelled
            if core.state is not SessionState.FAILED:
                continue
            error = core.error
            assert isinstance(error, SessionFailed)
            assert core.started_at is not None and core.ended_at is not None
            assert core.ended_at - core.started_at <= policy.session_deadline
            if isinstance(error, SessionDeadlineExceeded):
                assert core.ended_at - core.started_at == policy.session_deadline
            else:
                assert isinstance(error, FailureBudgetExhausted)
                # the budget was really spent, not given up early
                spent_attempts = error.attempts >= policy.max_attempts_per_step
                spent_changes = error.route_changes >= policy.max_route_changes
                assert spent_attempts or (spent_changes and not isinstance(error, NoRouteAvailable))
                assert error.fault is not None and error.reports
                assert error.reports[-1].fault is error.fault
