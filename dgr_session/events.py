"""Events: what a driver tells a route session (:meth:`RouteSession.handle` consumes them).

Every event names its session. Events that answer a command carry the epoch (and step) of that
command, so a late answer for an old epoch is recognised and dropped, never applied.
"""

from __future__ import annotations

import attrs

from dgr_session.faults import FaultKind
from dgr_session.route import Route


@attrs.frozen
class Start:
    """Begin the session: the core asks for its first route."""

    session_id: str
    """Session addressed."""
    now: float
    """Session clock time at start; the session deadline counts from here."""


@attrs.frozen
class ClockTick:
    """Time passed. The core checks its deadlines and backoff against ``now``."""

    session_id: str
    """Session addressed."""
    now: float
    """Current session clock time (never goes back; an earlier value is ignored)."""


@attrs.frozen
class RouteAssigned:
    """The route provider answered a :class:`~dgr_session.commands.RequestRoute` with a route."""

    session_id: str
    """Session addressed."""
    epoch: int
    """The epoch named by the request (the session's epoch + 1)."""
    route: Route
    """The assigned route; validated by the session before use."""
    attempt: int = 1
    """The request's ``attempt`` (only the newest request's answer is applied)."""


@attrs.frozen
class RouteUnavailable:
    """The route provider answered a route request with no route (or failed to answer)."""

    session_id: str
    """Session addressed."""
    epoch: int
    """The epoch named by the request."""
    detail: str = ""
    """Why, if known."""
    attempt: int = 1
    """The request's ``attempt`` (only the newest request's answer is applied)."""
    error: BaseException | None = attrs.field(default=None, eq=False, repr=False)
    """The provider's exception, if it raised one (a ``NoRoute`` says why it has none): the
    cause of the session's terminal error if this is the fault that ends it."""


@attrs.frozen
class StageOpened:
    """A stage accepted :class:`~dgr_session.commands.OpenStage` for the epoch."""

    session_id: str
    """Session addressed."""
    epoch: int
    """Epoch of the open command."""
    stage_index: int
    """Stage that opened."""
    next_pos: int = 0
    """The positions the stage holds for the epoch: 0 unless the open named a kept prefix
    (:attr:`~dgr_session.commands.OpenStage.prefix`) the stage had."""


@attrs.frozen(kw_only=True)
class StageOutput:
    """A stage answered :class:`~dgr_session.commands.Forward`.

    A middle stage's answer is its boundary rows (``payload``, opaque to the session: relayed as
    is to the next stage). The last stage's answer is the chosen token id (``token``): the
    driver samples from the logits, the core never does.
    """

    session_id: str
    """Session addressed."""
    epoch: int
    """Epoch of the forward command."""
    step: int
    """Step of the forward command."""
    stage_index: int
    """Stage that answered."""
    payload: object = attrs.field(default=None, repr=False)
    """Boundary rows produced by a middle stage (``None`` from the last stage)."""
    token: int | None = None
    """Token id chosen from the last stage's logits (``None`` from a middle stage, and from the
    last stage when the forward wanted no logits)."""
    tokens: tuple[int, ...] | None = None
    """A verification pass's answer: the session's token of every row's logits, in row order
    (``None`` for any other forward)."""


@attrs.frozen(kw_only=True)
class StageFailed:
    """A stage operation (open or forward) failed."""

    session_id: str
    """Session addressed."""
    epoch: int
    """Epoch of the failed command."""
    stage_index: int | None
    """Stage that failed; ``None``: the route failed and the client cannot tell at which
    stage (``dgr_session.errors.RouteStalled``)."""
    kind: FaultKind
    """What went wrong."""
    detail: str = ""
    """Error text, for the failure report."""
    step: int | None = None
    """Step of the failed forward (``None`` for an open)."""
    retry_after: float | None = None
    """For a busy stage: when to ask again, seconds (the worker's hint; ``None``: none)."""
    error: BaseException | None = attrs.field(default=None, eq=False, repr=False)
    """The transport's exception, if any: the cause of the session's terminal error if this
    is the fault that ends it."""


@attrs.frozen
class Cancel:
    """The caller gives up on the session: close every stage, enter ``cancelled``."""

    session_id: str
    """Session addressed."""
    reason: str = ""
    """Why, for the log and the terminal error."""


#: Every event type the core accepts.
Event = (
    Start
    | ClockTick
    | RouteAssigned
    | RouteUnavailable
    | StageOpened
    | StageOutput
    | StageFailed
    | Cancel
)
