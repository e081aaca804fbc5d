"""Faults and the failure report handed to the route provider (the tracker).

The session tells the tracker what it needs to learn from a failure (which provider, which
fault, timings); what to do about it (routing policy) stays the tracker's.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs


class FaultKind(enum.StrEnum):
    """What went wrong with a stage or with a route request."""

    #: The stage is unreachable or its worker died (its state is gone).
    DEAD = "dead"
    #: The awaited reply did not come within the per-step deadline.
    DEADLINE = "deadline"
    #: The stage's engine returned an error (bad positions, out of memory, ...).
    ENGINE_ERROR = "engine_error"
    #: The stage replied out of protocol (wrong step, duplicate, wrong payload kind).
    PROTOCOL = "protocol"
    #: The stage is healthy but no longer holds the session's state (closed under it, lease
    #: expired, worker restarted): a cache miss. The session re-prefills; nobody is to blame.
    STATE_LOST = "state_lost"
    #: The stage is healthy but has no free session slot now (it answered "busy"): load, not a
    #: fault. The session waits and asks again within its admission budget; nobody is blamed
    #: and the failure budget is untouched.
    BUSY = "busy"
    #: A call failed in this client before anything reached the stage (an invalid argument it
    #: built, such as a session id that cannot be gRPC metadata; a local gRPC error; its own
    #: channel closed): the client's fault, never the stage's. The session ends at once
    #: (``ClientFailure``), no provider hears of it and no worker is excluded.
    CLIENT = "client"
    #: The stage refused the session's request itself as invalid (a token id outside the
    #: model's vocabulary): any route of the model would refuse it the same way, and the stage
    #: is not to blame. The session ends at once (``RequestRefused``); no provider hears of it.
    BAD_REQUEST = "bad_request"
    #: The provider assigned a route that failed validation (deterministic: the same route is
    #: refused the same way again, so a second such refusal ends the session: ``RouteRefused``).
    ROUTE_INVALID = "route_invalid"
    #: The provider had no route.
    NO_ROUTE = "no_route"


@attrs.frozen
class FailureReport:
    """One fault, as the session saw it. Handed to the route provider with the next request."""

    session_id: str
    """Session that met the fault."""
    epoch: int
    """Epoch the fault belongs to (0 before the first route)."""
    step: int
    """Step (number of accepted tokens) the session was working on."""
    stage_index: int | None
    """Faulty stage's index in the route; ``None`` for route-request faults."""
    endpoint: str | None
    """Faulty stage's endpoint (the provider to blame); ``None`` for route-request faults."""
    fault: FaultKind
    """What went wrong."""
    detail: str
    """Human-readable detail (error text from the stage or the validator)."""
    attempt: int
    """Which attempt at ``step`` this was (1-based)."""
    route_changes: int
    """Route changes made by the session before this fault."""
    at: float
    """Session clock time of the fault."""
    waited: float
    """Seconds the failed operation had been outstanding."""
    hop_seconds: tuple[float | None, ...] = ()
    """Last observed latency per stage of the epoch (``None``: no reply seen yet)."""


def last_stage_fault(reports: Sequence[FailureReport]) -> FailureReport | None:
    """The newest of ``reports`` that names a stage's fault (which stage, which endpoint, what
    went wrong): what cost a session its route. ``busy`` answers are load, not faults, and are
    skipped; ``None`` when no stage failed."""
    for report in reversed(reports):
        if report.stage_index is not None and report.fault is not FaultKind.BUSY:
            return report
    return None
