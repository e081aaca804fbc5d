"""Typed errors of the shards: one per C status code of the engine, the worker's refusals and the
client's transport failures (which status raises which: ``dgr_engine.status``, the one table).

Every failure of a shard call is a :class:`ShardError`, in two branches that do not overlap:

* :class:`EngineError` (``code``, ``status``): the shard answered and refused the call - its
  engine's C status (``DGR_E_*``, mapped in ``dgr_engine.status``) or its worker's own check (frame,
  expectation, grant: ``code`` -1). Catch it where a refusal is meant.
* :class:`ShardTransportError` (``status`` only, no C status): no such answer - the worker is
  unreachable or gone (:class:`ShardUnavailable`), too slow (:class:`ShardDeadlineExceeded`),
  answered out of protocol (:class:`ShardRpcError`), or this client failed the call before
  sending it (:class:`ClientCallError`). Catch it where a dead or unreachable worker is meant.

``ShardError``, ``EngineError`` and ``StaleEpoch`` are defined in :mod:`dgr_session.errors` (so
that the control plane's ``StaleEpoch`` and the engine's are one class) and re-exported here.

Every class documents what happened to the session's state, as the C header does for its code,
and whether the session lives on: the engine's session, for a caller of ``ShardEngine``; the
route session, which files the error as a fault of the stage (within its failure budget, on a
new route where the stage cannot go on). Every class also declares the fault kind a route
session files it under (``fault_kind``), so transports raise it as it is. Each also inherits
the builtin it resembles, so ``except ValueError`` keeps working for callers that do not know
dgr.
"""

from __future__ import annotations

from dgr_session import errors as session_errors
from dgr_session.errors import EngineError, ShardError, StaleEpoch
from dgr_session.faults import FaultKind

__all__ = [
    "AbiMismatch",
    "CapacityExceeded",
    "ClientCallError",
    "ContextFull",
    "DecodeError",
    "EngineClosed",
    "EngineError",
    "ExpectationMismatch",
    "FrameRejected",
    "GrantDenied",
    "GrantUnauthenticated",
    "InternalError",
    "InvalidArgument",
    "LayerRangeError",
    "ModelLoadError",
    "NonFiniteOutput",
    "PositionMismatch",
    "ShapeMismatch",
    "ShardDeadlineExceeded",
    "ShardError",
    "ShardRpcError",
    "ShardTransportError",
    "ShardUnavailable",
    "StaleEpoch",
    "StateError",
    "UnknownSession",
    "UnsupportedArchitecture",
    "UnsupportedFeature",
]

# -- the engine's C statuses (EngineError's branch) ---------------------------------------------


class InvalidArgument(EngineError, ValueError):
    """An argument is invalid (e.g. a token id outside the vocabulary). Nothing changed: the
    engine's session lives on. A route session files it as a bad request (fault kind
    ``bad_request``): any route of the model would refuse it the same way, so the route
    session ends at once (``RequestRefused``), blaming no stage."""

    code, status = 1, "DGR_E_INVALID_ARGUMENT"
    fault_kind = FaultKind.BAD_REQUEST


class ModelLoadError(EngineError, OSError):
    """The GGUF is missing, truncated or corrupt. No engine was created, so no session: a route
    session files it like a dead stage and lives on elsewhere."""

    code, status = 2, "DGR_E_MODEL_LOAD"
    fault_kind = FaultKind.DEAD  # an OSError: no engine, as if its worker had died


class UnsupportedArchitecture(EngineError, ValueError):
    """The GGUF's architecture is not covered by the range-ownership patches. No engine was
    created, so no session."""

    code, status = 3, "DGR_E_UNSUPPORTED_ARCH"


class LayerRangeError(EngineError, ValueError):
    """The layer range is empty or outside [0, n_layer). No engine was created, so no
    session."""

    code, status = 4, "DGR_E_LAYER_RANGE"


class UnknownSession(EngineError, KeyError):
    """No open session has this id, or its epoch has not been opened. Nothing changed; a route
    session lives on: it re-prefills on a new epoch (a cache miss, no stage blamed)."""

    code, status = 5, "DGR_E_UNKNOWN_SESSION"
    fault_kind = FaultKind.STATE_LOST  # a cache miss on a healthy stage: re-prefill

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


# StaleEpoch (C status 6, DGR_E_STALE_EPOCH) is dgr_session's, imported above: one class.


class CapacityExceeded(EngineError, session_errors.StageBusy):
    """Every session slot is taken. Nothing changed; close a session or use another shard. A
    route session lives on: it waits and asks again within its admission budget.

    Load, not a fault (:class:`dgr_session.errors.StageBusy`): ``retry_after`` is the worker's
    hint, seconds, when it sent one."""

    code, status = 7, "DGR_E_CAPACITY"
    fault_kind = FaultKind.BUSY


class PositionMismatch(EngineError, ValueError):
    """The positions do not continue the session's KV exactly. Nothing changed: the session
    lives on."""

    code, status = 8, "DGR_E_POSITION"


class ShapeMismatch(EngineError, ValueError):
    """Rows missing or unexpected, wrong row width, too many rows, output too small.
    Nothing changed: the session lives on."""

    code, status = 9, "DGR_E_SHAPE"


class ContextFull(EngineError):
    """The session's context has no room for these rows. Nothing changed: the session lives on
    at its position (a route session, on a new route within its failure budget)."""

    code, status = 10, "DGR_E_CONTEXT_FULL"


class DecodeError(EngineError):
    """llama_decode failed. The rows of the call were rolled back: the session keeps its
    previous state and position - except where the state cannot drop a tail (DeepSeek V4),
    where the session is emptied (next position 0) and the message says so. Other sessions are
    untouched; the session lives on."""

    code, status = 11, "DGR_E_DECODE"


class NonFiniteOutput(EngineError):
    """The engine produced NaN or infinity (a worker's check of every output). The session's
    state on that stage is unusable: the worker closed it. A route session files it as the
    stage's engine fault and re-prefills elsewhere: it lives on."""

    code, status = -1, "DGR_E_NON_FINITE"


class StateError(EngineError, ValueError):
    """A saved state does not fit this engine (nothing changed), or llama.cpp refused it (the
    session is emptied: next position 0). Either way the session lives on."""

    code, status = 12, "DGR_E_STATE"


class UnsupportedFeature(EngineError):
    """The feature is not there: MTP asked of a shard that does not own the MTP block, of a
    model without one, or of an engine that did not load it (or of a session whose MTP inputs
    were lost); or the architecture cannot do it (truncating DeepSeek V4 state to a non-zero
    length). Nothing changed: the engine and its sessions live on."""

    code, status = 13, "DGR_E_UNSUPPORTED"


class InternalError(EngineError):
    """An unexpected failure inside the engine; see the message. A route session files it as
    the stage's engine fault and lives on, on a new route within its failure budget."""

    code, status = 14, "DGR_E_INTERNAL"


class EngineClosed(EngineError):
    """The engine handle was closed; it cannot be used any more. A stage whose engine is closed
    is dead: the route session moves to a new route (it lives on)."""

    fault_kind = FaultKind.DEAD


# -- refusals of the gRPC worker (EngineError's branch: a dgr status, no C status) -----------


class FrameRejected(EngineError, ValueError):
    """A frame is malformed: wrong dtype, shape or byte length, missing or unexpected rows or
    token ids, non-contiguous positions, or over the message size limit. The worker changed
    nothing; the session lives on and may resend a correct frame."""

    status = "DGR_E_FRAME"


class ExpectationMismatch(EngineError, ValueError):
    """The frame was meant for another worker: its model hash, layer range, boundary width or
    schema version differs from what the worker serves (the ``status`` says which). Nothing
    changed; the route is wrong, not the data: the session lives on, on another route."""

    status = "DGR_E_EXPECTATION"


class GrantUnauthenticated(EngineError, PermissionError):
    """The open carried no route grant, or one that is malformed, badly signed or signed by a
    key the worker does not know; or a frame, close, link, output stream or usage request
    carried no or the wrong session secret (every session has one, with or without grants).
    Nothing changed. A route session cannot use this stage: it lives on, on another route."""

    status = "DGR_E_UNAUTHENTICATED"
    fault_kind = FaultKind.PROTOCOL


class GrantDenied(EngineError, PermissionError):
    """A validly signed route grant that does not permit this open: another session, epoch,
    stage, model or lane, expired, used before, or issued before the worker started; or a
    ``Link`` to a stage the grant does not name as next (without grants: one that does not
    confirm it holds the session); or, without grants, an open of a session another client
    holds. Nothing changed. A route session cannot use this stage: it lives on, on another
    route."""

    status = "DGR_E_PERMISSION"
    fault_kind = FaultKind.PROTOCOL


# -- the client's transport failures (ShardTransportError's branch: no C status) ---------------


class ShardTransportError(ShardError):
    """A call to a shard got no dgr refusal: the worker is unreachable, gone or too slow, it
    answered out of protocol, or this client failed the call before sending it. No engine
    status came back (``status`` names what the client saw). Each subclass says what the
    worker may have changed; the route session lives on (on a new route, within its failure
    budget) except after :class:`ClientCallError`, which ends it blaming no stage."""


class ShardUnavailable(ShardTransportError, session_errors.StageDead):
    """The worker is unreachable or shutting down; its sessions' state is gone or going. The
    route session must move to a new route (re-prefill under a new epoch): it lives on.

    The worker client's side of :class:`dgr_session.errors.StageDead` (a ``ConnectionError``)."""

    status = "DGR_E_UNAVAILABLE"
    fault_kind = FaultKind.DEAD


class ShardDeadlineExceeded(ShardTransportError, TimeoutError):
    """The call's deadline passed. With ``DGR_E_DEADLINE`` the worker answered that the frame's
    deadline passed in its queue and the engine never ran (nothing changed); without it (the
    client gave up) the state may have advanced. Either way the stage is faulty: the route
    session re-prefills under a new epoch within its failure budget (it lives on)."""

    status = "DGR_E_DEADLINE"
    fault_kind = FaultKind.DEADLINE


class ClientCallError(ShardTransportError):
    """A call failed in this client before anything reached the worker: gRPC refused to start
    it (invalid metadata, a message that cannot be serialised) or the client's own channel is
    closed. The worker saw nothing and changed nothing; it is not to blame (fault kind
    ``client``): a route session ends with ``ClientFailure`` and no worker is excluded."""

    status = "DGR_E_CLIENT"
    fault_kind = FaultKind.CLIENT


class ShardRpcError(ShardTransportError):
    """A gRPC failure without a dgr reason (``status`` is ``GRPC_<CODE>``), or a reply out of
    protocol (``DGR_E_PROTOCOL``). What the worker changed is unknown: the route session treats
    the stage as faulty and moves to a new route within its failure budget (it lives on)."""

    status = "DGR_E_RPC"


# -- the native module -------------------------------------------------------------------------


class AbiMismatch(ImportError):
    """The compiled native module does not match this Python package's ABI version. Nothing
    can be loaded: no engine, no session (an ``ImportError``, not a ``DgrError``)."""
