"""FailureBudget: what a route session spent of its FailurePolicy, and the clocks it bounds."""

from __future__ import annotations

import pytest

from dgr_session import FailurePolicy, RouteSession
from dgr_session.budget import FailureBudget

POLICY = FailurePolicy(
    step_deadline=2.0,
    session_deadline=50.0,
    max_route_changes=2,
    max_attempts_per_step=3,
    backoff=(0.0, 1.5),
    admission_budget=10.0,
    busy_retry=0.5,
)


def test_the_session_keeps_no_budget_field_of_its_own() -> None:
    spent = {"_route_changes", "_faults_at_step", "_busy_since", "_busy_retry", "_wait_since"}
    clocks = {"_session_deadline_at", "_wait_deadline", "_backoff_until"}
    assert (spent | clocks).isdisjoint(RouteSession.__slots__)
    assert RouteSession("s", (1,), max_new_tokens=1, policy=POLICY).policy is POLICY


def test_attempts_run_out_at_the_step_and_come_back_with_a_token() -> None:
    budget = FailureBudget(POLICY)
    assert budget.attempts == 1 and budget.spent(routed=True) is None
    assert [budget.fault(), budget.fault()] == [1, 2]
    assert budget.spent(routed=True) is None and budget.attempts == 3
    assert budget.fault() == 3
    assert budget.spent(routed=True) == "attempt 3 of 3 at step"
    budget.token_accepted()
    assert budget.attempts == 1 and budget.spent(routed=True) is None


def test_route_changes_count_after_the_first_route_and_never_after_a_busy_answer() -> None:
    budget = FailureBudget(POLICY)
    budget.route_assigned(first=True)
    assert budget.route_changes == 0
    budget.route_assigned(first=False)
    assert budget.route_changes == 1
    budget.busy_back_off(5.0, None, 0.0)  # load: the next route is a retry, not a change
    budget.route_assigned(first=False)
    assert budget.route_changes == 1
    budget.route_assigned(first=False)
    assert budget.route_changes == 2
    assert budget.spent(routed=True) == "route changes 2 of 2 at step"
    assert budget.spent(routed=False) is None  # no route ever: nothing to change yet
    budget.busy_back_off(6.0, None, 0.0)
    budget.fault()  # a fault after a busy answer: the next route is a change again
    budget.route_assigned(first=False)
    assert budget.route_changes == 3


def test_the_clocks_follow_the_policy() -> None:
    budget = FailureBudget(POLICY)
    budget.start(10.0)
    assert not budget.session_over(59.9) and budget.session_over(60.0)
    assert budget.next_timer(backing_off=False) == 60.0  # nothing awaited yet
    budget.begin_wait(12.0)
    assert budget.next_timer(backing_off=False) == 14.0
    assert not budget.wait_over(13.9) and budget.wait_over(14.0)
    assert budget.waited(13.5) == 1.5
    budget.end_wait()
    assert not budget.wait_over(1e9) and budget.next_timer(backing_off=False) == 60.0
    assert budget.back_off(20.0, 1)  # the schedule's first entry: no wait
    assert budget.backoff_over(20.0)
    assert not budget.back_off(20.0, 2)  # then 1.5 s, repeated after
    assert budget.next_timer(backing_off=True) == 21.5
    assert not budget.backoff_over(21.4) and budget.backoff_over(21.5)
    budget.back_off(59.0, 7)
    assert budget.next_timer(backing_off=True) == 60.0  # the session deadline comes first


def test_busy_answers_spend_the_admission_budget_from_the_first_opening() -> None:
    budget = FailureBudget(POLICY)
    budget.begin_wait(3.0)  # the opening that gets the first busy answer began at 3
    assert budget.busy(4.0) == 1.0
    assert not budget.busy_back_off(4.0, 2.0, 1.0)  # the worker's hint: 2 s
    assert budget.backoff_until == 6.0 and budget.busy_retry
    budget.begin_wait(6.0)
    assert budget.busy(7.0) == 4.0  # counted from the first, not from this opening
    assert not budget.busy_back_off(7.0, None, 4.0)  # no hint: the policy's busy_retry
    assert budget.backoff_until == pytest.approx(7.5)
    assert not budget.busy_back_off(12.5, 30.0, 9.5)  # never past the admission budget
    assert budget.backoff_until == pytest.approx(13.0)
    assert budget.busy_back_off(13.0, -1.0, 10.0)  # a negative hint: ask again now
    assert not budget.admission_spent(9.9) and budget.admission_spent(10.0)
    budget.admitted()
    budget.begin_wait(20.0)
    assert budget.busy(20.5) == 0.5  # a new run of busy answers starts from scratch
