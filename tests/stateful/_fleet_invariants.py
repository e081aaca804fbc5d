"""Invariants shared by the stateful session tests (fake transport and real engine).

A mixin for a ``RuleBasedStateMachine`` that keeps ``handles`` (session id -> handle),
``expected`` (session id -> fault-free whole-model tokens), ``cancelled`` (ids the test
cancelled), ``last_epoch`` (session id -> epoch last seen) and a class attribute ``policy``.
"""

from __future__ import annotations

from hypothesis.stateful import invariant

from dgr_session import (
    FailureBudgetExhausted,
    FailurePolicy,
    NoRouteAvailable,
    SessionDeadlineExceeded,
    SessionFailed,
    SessionHandle,
    SessionState,
)


class SessionOutcomeInvariants:
    policy: FailurePolicy
    handles: dict[str, SessionHandle]
    expected: dict[str, tuple[int, ...]]
    cancelled: set[str]
    last_epoch: dict[str, int]

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
