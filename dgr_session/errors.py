"""Typed errors of dgr.

Every error dgr raises derives from :class:`DgrError`; the data plane (``dgr_engine``) defines its
own subclasses by importing this base. A failed call to a shard is a :class:`ShardError`: a
refusal (:class:`EngineError`, :class:`StaleEpoch` among them, defined here so that the control
plane and the engine share the one class) or a transport failure (``dgr_engine.errors``). Each
docstring says whether the route session that met the error lives on:

* *lives on*: the session is still usable (for faults: it moves to a new route within its
  failure budget);
* *ends*: the session is in an absorbing state (``failed`` or ``cancelled``) and will never emit
  another token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from dgr_session.faults import FaultKind, last_stage_fault

if TYPE_CHECKING:
    from dgr_session.faults import FailureReport
    from dgr_session.identity import NearestRecord


class DgrError(Exception):
    """Base of every dgr error."""


class InvalidTransition(DgrError):
    """An event the session's state does not allow (a missing entry in the transition table).

    This is a bug in whoever feeds the session (the driver), not a remote fault. The event was
    not applied and the state is unchanged: the session lives on.
    """

    def __init__(self, message: str, *, state: str, event: str) -> None:
        super().__init__(message)
        #: State the session was in.
        self.state = state
        #: Name of the refused event or trigger.
        self.event = event


# --------------------------------------------------------------------------------------------
# Route validation


class RouteInvalid(DgrError, ValueError):
    """A route is malformed: not an exact contiguous cover of ``[0, n_layer)``, or empty.

    Names the offending stage (``stage_index``, ``endpoint`` and ``layers``; ``None`` when the
    fault is the route as a whole). Every refusal of route validation is deterministic: the
    same route is refused the same way again. A session handed such a route refuses it and
    asks its provider for another, within its failure budget: it lives on, unless the
    provider offers a route refused the same way again, which ends it (:class:`RouteRefused`).
    """

    def __init__(
        self,
        message: str,
        *,
        stage_index: int | None = None,
        endpoint: str | None = None,
        layers: tuple[int, int] | None = None,
    ) -> None:
        if stage_index is None:
            where = "route"
        elif layers is None:
            where = f"stage {stage_index} ({endpoint})"
        else:
            where = f"stage {stage_index} ({endpoint}) layers [{layers[0]},{layers[1]})"
        super().__init__(f"{where}: {message}")
        #: What is wrong, without the stage (equal for equal refusals of different workers).
        self.reason = message
        #: Index of the offending stage in the route, or ``None``.
        self.stage_index = stage_index
        #: Endpoint of the offending stage, or ``None``.
        self.endpoint = endpoint
        #: Layer range ``[begin, end)`` of the offending stage, or ``None``.
        self.layers = layers


class RouteIncompatible(RouteInvalid):
    """A stage serves another model identity or recipe than the route (or the session) needs, or
    its context cannot hold the session. The session refuses the route and lives on."""


class BoundaryMismatch(RouteInvalid):
    """Neighbouring stages disagree on the boundary width (or the first/last stage has a width
    where tokens/logits are due). The session refuses the route and lives on."""


class DarkLane(RouteInvalid):
    """A stage runs on a lane that is not certified (compiled is not certified). Dark lanes are
    unroutable; there is no opt-in. A certification refusal: the message names the lane parts
    that differ from the nearest record the worker has (:attr:`nearest`) and the command that
    would certify the lane (:attr:`certify_command`), when the worker's advert says them. The
    session refuses the route and asks for another, as for any :class:`RouteInvalid`."""

    def __init__(
        self,
        message: str,
        *,
        stage_index: int | None = None,
        endpoint: str | None = None,
        layers: tuple[int, int] | None = None,
        nearest: NearestRecord | None = None,
        certify_command: str = "",
    ) -> None:
        super().__init__(message, stage_index=stage_index, endpoint=endpoint, layers=layers)
        #: The nearest record at the required class and how the lane differs from it, or
        #: ``None`` (the worker found none, or did not say).
        self.nearest = nearest
        #: The command that would certify the lane on the worker's machine (``""``: not said).
        self.certify_command = certify_command


class InsufficientEvidence(DarkLane):
    """A stage's lane is certified, but by evidence of a lower class than the route requires
    (e.g. fixture evidence where real-hardware is required): for this route it is dark."""


class UnverifiedCertification(DarkLane):
    """A stage's advert says its lane is certified, but the certification does not check out
    against the client's own trust (its lock): no signed record, a record of another lane or
    class, a key the lock does not trust for that class, a record edited after it was signed.
    For this client the lane is dark. The session refuses the route and lives on."""


# --------------------------------------------------------------------------------------------
# Route providers


class NoRoute(DgrError):
    """A route provider has no route for the session now, and says why: a provider raises it
    from ``assign`` (rather than return ``None``) so that the reason reaches the session's
    failure report and its terminal error. ``stage_index`` and ``endpoint`` name the stage it
    could not use, when one is to blame (``None`` otherwise). The session files it as a
    ``no_route`` fault and asks again within its failure budget: it lives on (if the budget
    runs out, its :class:`NoRouteAvailable` has this error as its ``__cause__``)."""

    def __init__(
        self, message: str, *, stage_index: int | None = None, endpoint: str | None = None
    ) -> None:
        super().__init__(message)
        #: Index of the stage the provider could not use, or ``None``.
        self.stage_index = stage_index
        #: Its endpoint, or ``None``.
        self.endpoint = endpoint


class StageUnreachable(NoRoute, ConnectionError):
    """A route provider could not reach a stage's worker: nothing listens at its endpoint,
    it does not answer, or it answers that it is not serving. The message names the stage and
    the endpoint. A worker may come back, so the session asks again within its failure budget:
    it lives on."""


# --------------------------------------------------------------------------------------------
# Stage faults (what transports raise; the session survives them within its budget)


class ShardError(DgrError):
    """Base of a failed call to one shard (a stage's worker or engine), in two branches:

    * :class:`EngineError` - the shard answered and refused the call with a dgr status (its
      engine's C status, or its worker's own check): the shard is there;
    * ``dgr_engine.errors.ShardTransportError`` - the call got no such answer: the worker is
      unreachable or too slow, answered out of protocol, or the client failed the call itself.

    ``status`` is the stable name of what happened; ``fault_kind`` how a route session files
    it. Whether the session lives on is each class's to say (most: it lives on, on a new route
    within its failure budget).
    """

    status: str = "DGR_E_UNKNOWN_STATUS"
    fault_kind: ClassVar[FaultKind] = FaultKind.ENGINE_ERROR

    def __init__(self, message: str, *, status: str | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class EngineError(ShardError):
    """A shard refused a call with a dgr status: its engine's C status (``code``, mapped in one
    place: ``dgr_engine.errors.error_for_status``), or its worker's own refusal (``code`` -1).
    ``status`` is the status's stable name. The subclasses (``dgr_engine.errors``) say what
    changed; a route session files an unclassified one as the stage's engine fault and moves to
    a new route within its failure budget: it lives on.

    Defined here, beside :class:`StaleEpoch` (the one refusal the control plane raises too), and
    re-exported by ``dgr_engine.errors``, where every other engine error lives.
    """

    code: int = -1

    def __init__(self, message: str, *, code: int | None = None, status: str | None = None) -> None:
        super().__init__(message, status=status)
        if code is not None:
            self.code = code


class StaleEpoch(EngineError):
    """A message names an epoch older than the one the receiver holds for that session.

    Raised by stages, their engines (``DGR_E_STALE_EPOCH``, C status 6) and transports when
    asked to act for an old epoch: nothing changed, and the newer epoch's state is untouched (it
    lives on). The session core never raises it: it drops stale events and counts them. One
    class: ``dgr_engine.errors.StaleEpoch`` is this class.
    """

    code, status = 6, "DGR_E_STALE_EPOCH"
    fault_kind = FaultKind.PROTOCOL

    def __init__(
        self,
        message: str,
        *,
        code: int | None = None,
        status: str | None = None,
        session_id: str | None = None,
        epoch: int | None = None,
        held_epoch: int | None = None,
    ) -> None:
        super().__init__(message, code=code, status=status)
        #: Session the message belonged to, or ``None`` when the refusing side did not say.
        self.session_id = session_id
        #: Epoch the message named, or ``None`` when the refusing side did not say.
        self.epoch = epoch
        #: Newer epoch the receiver holds (for the engine: ``dgr_last_held_epoch()``), or
        #: ``None`` when it did not say.
        self.held_epoch = held_epoch


class StageDead(DgrError, ConnectionError):
    """A stage is unreachable or its worker died (its per-session state is gone).

    Transports raise it; the session moves to a new route within its failure budget: it lives on.
    The worker client's ``dgr_engine.errors.ShardUnavailable`` is this class too.
    """

    fault_kind: ClassVar[FaultKind] = FaultKind.DEAD


class StageBusy(DgrError):
    """A stage is healthy but every session slot is taken (and stayed taken for as long as the
    worker let the open wait): load, not a fault.

    Transports raise it when an open is refused for capacity; the session closes the epoch's
    other stages, waits ``retry_after`` (the worker's hint, seconds; ``None``: none given) and
    asks its provider again, within the policy's admission budget. It lives on. The worker
    client's ``dgr_engine.errors.CapacityExceeded`` is this class too.
    """

    fault_kind: ClassVar[FaultKind] = FaultKind.BUSY
    retry_after: float | None = None


class NonFiniteLogits(DgrError, ValueError):
    """A sampler was given logits holding NaN or infinity: no token can be chosen from them.

    The last stage's engine produced them; the session files it as that stage's engine fault
    and re-prefills on a new route within its failure budget. It lives on."""

    fault_kind: ClassVar[FaultKind] = FaultKind.ENGINE_ERROR


class SpeculationNeedsSampling(DgrError, ValueError):
    """A session was asked to decode speculatively with a sampler that states no
    :class:`~dgr_session.sampling.Sampling` (one only its caller knows): a verification pass
    keeps a draft when it is dgr's sampler's token at its position, which such a sampler is
    not. Refused before anything was asked of a route; nothing started."""


class StepDeadlineExceeded(DgrError, TimeoutError):
    """A step (route request, stage opening, or one forward through the route) ran past the
    policy's per-step deadline. The waited-on stage is reported as faulty and the session moves
    to a new route within its failure budget: it lives on. Attached as ``__cause__`` of the
    terminal error when the deadline was the fault that spent the budget."""

    fault_kind: ClassVar[FaultKind] = FaultKind.DEADLINE

    def __init__(self, message: str, *, stage_index: int | None, deadline: float) -> None:
        super().__init__(message)
        #: Stage that did not answer in time, or ``None`` for a route request.
        self.stage_index = stage_index
        #: The per-step deadline in seconds.
        self.deadline = deadline


class RouteStalled(DgrError, TimeoutError):
    """A step along a chained route got no answer in time, and the client cannot tell which
    stage held it: every stage answered a probe (or none did: the client's own link), so no
    stage is named. A transport raises it from any stage's forward; the session reports the
    fault with no stage (a wrong blame is worse than none) and moves on within its failure
    budget."""

    fault_kind: ClassVar[FaultKind] = FaultKind.DEADLINE


# --------------------------------------------------------------------------------------------
# Terminal reasons


class SessionFailed(DgrError):
    """Base of the reasons a session enters ``failed``. The session ends.

    Carries where it ended and what it had spent, so a caller can tell a flaky provider from an
    exhausted budget without parsing messages.
    """

    def __init__(
        self,
        message: str,
        *,
        session_id: str,
        epoch: int,
        step: int,
        stage_index: int | None,
        endpoint: str | None,
        fault: FaultKind | None,
        attempts: int,
        route_changes: int,
        reports: Sequence[FailureReport] = (),
    ) -> None:
        super().__init__(message)
        #: The session that failed.
        self.session_id = session_id
        #: Epoch in force when it failed.
        self.epoch = epoch
        #: Step (number of accepted tokens) it was working on.
        self.step = step
        #: Stage of the last fault, or ``None`` (route request, session deadline).
        self.stage_index = stage_index
        #: Endpoint of that stage, or ``None``.
        self.endpoint = endpoint
        #: Kind of the last fault, or ``None`` when no fault preceded (session deadline).
        self.fault = fault
        #: Attempts made at ``step`` (1 + faults at that step).
        self.attempts = attempts
        #: Route changes made over the whole session.
        self.route_changes = route_changes
        #: Every failure report of the session, oldest first.
        self.reports = tuple(reports)


class FailureBudgetExhausted(SessionFailed):
    """A fault happened with no budget left (attempts per step or route changes).

    Names the stage, the fault and the attempts. The session ends.
    """


class NoRouteAvailable(FailureBudgetExhausted):
    """The route provider had no usable route (none, refused, or too late) and the budget for
    asking again is spent. The session ends.

    Its ``fault`` is the last request's (``no_route``); :attr:`lost` is the stage fault that
    cost the session its route (which stage and endpoint, what fault), and the message names it
    too, so the dead stage is named even when no spare was left to replace it."""

    @property
    def lost(self) -> FailureReport | None:
        """The newest report naming a stage's fault (``None``: no stage ever failed, the
        provider never had a route)."""
        return last_stage_fault(self.reports)


class ClientFailure(SessionFailed):
    """A call of the session failed in this client before anything reached a stage: an
    invalid argument the client built (a session id that cannot be gRPC metadata), a local
    gRPC error, the client's own channel closed. Any route would fail the same way and no stage
    is to blame: no report reaches the route provider, no worker is excluded, ``stage_index``
    and ``endpoint`` are ``None`` (the message says which call it was) and ``fault`` is
    ``client``. The session ends."""


class RouteRefused(SessionFailed):
    """Route validation refused a route (a dark lane, a context too small for the session,
    another model or build, a bad cover: a :class:`RouteInvalid`), and the provider then
    offered one refused the same way again (the same stage, the same reason). Validation is
    deterministic, so asking again would spend the attempts for nothing: the session ends at
    once. :attr:`refusal` (also the ``__cause__``) is the validation error, which names the
    stage; a :class:`DarkLane` also says which lane parts differ from the nearest record and
    how to certify the lane. The session ends."""

    @property
    def refusal(self) -> RouteInvalid | None:
        """The validation error that refused the route."""
        cause = self.__cause__
        return cause if isinstance(cause, RouteInvalid) else None


class RequestRefused(SessionFailed):
    """A stage refused the session's request itself as invalid (fault kind ``bad_request``:
    a token id outside the model's vocabulary). Any route of the model would refuse it the
    same way, so the session ends at once instead of trying other routes; the stage is named
    (``stage_index``, ``endpoint``) but not blamed, and no provider hears of it. The stage's
    error is the ``__cause__``. The session ends."""


class AdmissionTimeout(SessionFailed):
    """Every route offered stayed busy (no free session slot) for longer than the policy's
    admission budget. No stage is blamed. The session ends.

    ``retry_after`` is the busy stage's last hint (seconds to wait before asking again; ``None``
    when it gave none): what a server in front of the route tells its own clients."""

    def __init__(self, message: str, *, retry_after: float | None = None, **where: Any) -> None:
        super().__init__(message, **where)
        #: The busy stage's last hint (seconds), or ``None``.
        self.retry_after = retry_after


class SessionDeadlineExceeded(SessionFailed):
    """The session ran past the policy's session deadline. The session ends."""


class SessionCancelled(DgrError):
    """The session was cancelled; every stage of its epoch was closed. The session ends."""
