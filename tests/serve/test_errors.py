"""Each way a session fails is answered with its HTTP status and OpenAI's error shape: a busy
route 503 with Retry-After, a route lost for good 502 naming the stage, a deadline 504."""

from __future__ import annotations

from dgr_engine.serve.errors import (
    RouteFailed,
    RouteOverloaded,
    SessionTimedOut,
    error_for_failure,
)
from dgr_session import (
    AdmissionTimeout,
    FailureBudgetExhausted,
    FailureReport,
    FaultKind,
    NoRouteAvailable,
    SessionDeadlineExceeded,
)


def failure(kind: type, **kw: object) -> object:
    fields = {
        "session_id": "s",
        "epoch": 2,
        "step": 3,
        "stage_index": 1,
        "endpoint": "127.0.0.1:9001",
        "fault": FaultKind.DEAD,
        "attempts": 3,
        "route_changes": 2,
    }
    return kind("it failed", **{**fields, **kw})


def report(stage: int | None, endpoint: str | None, fault: FaultKind) -> FailureReport:
    return FailureReport("s", 1, 3, stage, endpoint, fault, "gone", 1, 0, 0.0, 0.0)


def test_an_admission_timeout_is_a_503_with_the_hint_rounded_up() -> None:
    error = error_for_failure(failure(AdmissionTimeout, fault=FaultKind.BUSY), retry_after=1.2)
    assert isinstance(error, RouteOverloaded) and error.status == 503
    assert error.headers() == {"Retry-After": "2"}
    assert error.body()["error"]["code"] == "route_busy"


def test_a_spent_failure_budget_is_a_502_naming_the_stage() -> None:
    error = error_for_failure(failure(FailureBudgetExhausted), retry_after=1.0)
    assert isinstance(error, RouteFailed) and error.status == 502
    body = error.body()["error"]
    assert body["stage"] == {"index": 1, "endpoint": "127.0.0.1:9001"}
    assert "stage 1 (127.0.0.1:9001) failed" in body["message"]


def test_no_route_names_the_stage_whose_loss_cost_the_route() -> None:
    lost = report(2, "127.0.0.1:9002", FaultKind.DEAD)
    no_route = failure(
        NoRouteAvailable,
        stage_index=None,
        endpoint=None,
        fault=FaultKind.NO_ROUTE,
        reports=[lost, report(None, None, FaultKind.NO_ROUTE)],
    )
    error = error_for_failure(no_route, retry_after=1.0)
    assert isinstance(error, RouteFailed)
    assert (error.stage_index, error.endpoint) == (2, "127.0.0.1:9002")
    never = failure(NoRouteAvailable, stage_index=None, endpoint=None, fault=FaultKind.NO_ROUTE)
    assert "no route could be had" in error_for_failure(never, retry_after=1.0).message


def test_a_session_deadline_is_a_504() -> None:
    error = error_for_failure(failure(SessionDeadlineExceeded, fault=None), retry_after=1.0)
    assert isinstance(error, SessionTimedOut) and error.status == 504
