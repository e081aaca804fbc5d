"""What a request to ``dgr serve`` can meet, each with its HTTP status and its OpenAI error
shape (``{"error": {"message", "type", "param", "code"}}``): the request's own mistakes (400),
no API key the server takes (401),
a route too busy to take another session (503 with ``Retry-After``), a route that could not be
recovered (502, naming the stage), a session past its deadline (504), and a failure of the
server itself (500). :func:`error_for_failure` files a session's terminal error.

Every class is a :class:`~dgr_session.errors.DgrError`; none outlives its request (the server
and its route live on).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from dgr_session.errors import (
    AdmissionTimeout,
    ClientFailure,
    DgrError,
    NoRouteAvailable,
    SessionDeadlineExceeded,
    SessionFailed,
)


class ServeError(DgrError):
    """Base of the errors a request is answered with. ``status`` is the HTTP status, ``kind``
    the OpenAI error ``type``, ``code`` its ``code`` and ``param`` the request field at fault
    (``None``: none)."""

    status: ClassVar[int] = 500
    kind: ClassVar[str] = "server_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        """Extra response headers (none)."""
        return {}


class BadRequest(ServeError):
    """The request cannot be run as given: a malformed body, a value out of range, a feature
    dgr does not offer (``n`` > 1, log-probabilities, penalties)."""

    status = 400
    kind = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    """The prompt, or the prompt with the tokens asked for, does not fit in a session's
    context on this route (the smallest stage's KV positions per session)."""

    def __init__(self, message: str, *, param: str = "messages") -> None:
        super().__init__(message, code="context_length_exceeded", param=param)


class Unauthorized(ServeError):
    """The server takes API keys and the request carried none of them (``Authorization:
    Bearer KEY``): OpenAI's 401."""

    status = 401
    kind = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class NotFound(ServeError):
    """No such path."""

    status = 404
    kind = "invalid_request_error"


class RouteOverloaded(ServeError):
    """Every stage slot stayed taken for as long as the request could wait (the workers
    answered busy): load, not a fault. ``retry_after`` (seconds) is the workers' admission
    hint, else the session policy's wait after a busy answer; ``Retry-After`` carries it
    rounded up to whole seconds."""

    status = 503
    kind = "overloaded_error"

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message, code="route_busy")
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class RouteUnhealthy(ServeError):
    """``GET /health``: a stage of the route is not answering, or not certified; ``stages``
    is every stage as ``GET /v1/route`` shows it."""

    status = 503
    kind = "unavailable_error"

    def __init__(self, message: str, *, stages: list[dict[str, Any]]) -> None:
        super().__init__(message, code="route_unhealthy")
        self.stages = stages

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["stages"] = self.stages
        return body


class RouteFailed(ServeError):
    """The session's route failed and could not be recovered within its failure budget (or no
    route was to be had). ``stage_index``/``endpoint`` name the stage whose fault spent the
    budget (``None``: no stage was to blame, the provider had no route)."""

    status = 502
    kind = "route_error"

    def __init__(self, message: str, *, stage_index: int | None, endpoint: str | None) -> None:
        super().__init__(message, code="route_failed")
        self.stage_index = stage_index
        self.endpoint = endpoint

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["stage"] = (
            None
            if self.stage_index is None
            else {"index": self.stage_index, "endpoint": self.endpoint}
        )
        return body


class SessionTimedOut(ServeError):
    """The session ran past its deadline."""

    status = 504
    kind = "timeout_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="session_deadline")


def error_for_failure(error: SessionFailed, *, retry_after: float) -> ServeError:
    """The answer to a request whose session ended ``failed`` with ``error``; ``retry_after``
    is the busy hint to give an overloaded route's client (seconds)."""
    if isinstance(error, AdmissionTimeout):
        return RouteOverloaded(f"the route is busy: {error}", retry_after=retry_after)
    if isinstance(error, SessionDeadlineExceeded):
        return SessionTimedOut(str(error))
    if isinstance(error, ClientFailure):
        return ServeError(f"the server failed the session itself: {error}", code="client_failure")
    stage_index, endpoint = error.stage_index, error.endpoint
    if isinstance(error, NoRouteAvailable) and error.lost is not None:
        stage_index, endpoint = error.lost.stage_index, error.lost.endpoint
    if stage_index is None:
        where = "no route could be had"
    else:
        where = f"stage {stage_index} ({endpoint}) failed"
    return RouteFailed(
        f"the route could not be recovered: {where}: {error}",
        stage_index=stage_index,
        endpoint=endpoint,
    )
