"""Typed errors of the shard engine, one per C status code, and the one place that maps codes.

Every class documents what happened to the session's state, as the C header does for its code,
and declares the fault kind a route session files it under (``fault_kind``), so transports raise
it as it is. Each also inherits the builtin it resembles, so ``except ValueError`` keeps working
for callers that do not know dgr.
"""

from __future__ import annotations

from typing import ClassVar

from dgr_session import errors as session_errors
from dgr_session.errors import DgrError
from dgr_session.faults import FaultKind


class EngineError(DgrError):
    """A shard engine call failed. ``code`` is the C status, ``status`` its stable name."""

    code: int = -1
    status: str = "DGR_E_UNKNOWN_STATUS"
    fault_kind: ClassVar[FaultKind] = FaultKind.ENGINE_ERROR

    def __init__(self, message: str, *, code: int | None = None, status: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class InvalidArgument(EngineError, ValueError):
    """An argument is invalid (e.g. a token id outside the vocabulary). Nothing changed."""

    code, status = 1, "DGR_E_INVALID_ARGUMENT"


class ModelLoadError(EngineError, OSError):
    """The GGUF is missing, truncated or corrupt. No engine was created."""

    code, status = 2, "DGR_E_MODEL_LOAD"
    fault_kind = FaultKind.DEAD  # an OSError: no engine, as if its worker had died


class UnsupportedArchitecture(EngineError, ValueError):
    """The GGUF's architecture is not covered by the range-ownership patches. No engine."""

    code, status = 3, "DGR_E_UNSUPPORTED_ARCH"


class LayerRangeError(EngineError, ValueError):
    """The layer range is empty or outside [0, n_layer). No engine was created."""

    code, status = 4, "DGR_E_LAYER_RANGE"


class UnknownSession(EngineError, KeyError):
    """No open session has this id, or its epoch has not been opened. Nothing changed."""

    code, status = 5, "DGR_E_UNKNOWN_SESSION"
    fault_kind = FaultKind.STATE_LOST  # a cache miss on a healthy stage: re-prefill

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class StaleEpoch(EngineError, session_errors.StaleEpoch):
    """The epoch is older than the session's current one. Nothing changed; the newer epoch's
    state is untouched. The caller's session lives on under its newer epoch.

    The engine's side of :class:`dgr_session.errors.StaleEpoch`: ``held_epoch`` is the epoch the
    refusing engine holds (from the C ABI, or the worker's refusal); ``session_id`` and ``epoch``
    name the refused call where the raiser knows them. Each is ``None`` when unknown."""

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
        # EngineError's super() reaches dgr_session's StaleEpoch with the message only
        super().__init__(message, code=code, status=status)
        self.session_id = session_id
        self.epoch = epoch
        self.held_epoch = held_epoch


class CapacityExceeded(EngineError, session_errors.StageBusy):
    """Every session slot is taken. Nothing changed; close a session or use another shard.

    Load, not a fault (:class:`dgr_session.errors.StageBusy`): ``retry_after`` is the worker's
    hint, seconds, when it sent one."""

    code, status = 7, "DGR_E_CAPACITY"
    fault_kind = FaultKind.BUSY


class PositionMismatch(EngineError, ValueError):
    """The positions do not continue the session's KV exactly. Nothing changed."""

    code, status = 8, "DGR_E_POSITION"


class ShapeMismatch(EngineError, ValueError):
    """Rows missing or unexpected, wrong row width, too many rows, output too small.
    Nothing changed."""

    code, status = 9, "DGR_E_SHAPE"


class ContextFull(EngineError):
    """The session's context has no room for these rows. Nothing changed."""

    code, status = 10, "DGR_E_CONTEXT_FULL"


class DecodeError(EngineError):
    """llama_decode failed. The rows of the call were rolled back: the session keeps its
    previous state and position - except where the state cannot drop a tail (DeepSeek V4),
    where the session is emptied (next position 0) and the message says so. Other sessions are
    untouched."""

    code, status = 11, "DGR_E_DECODE"


class NonFiniteOutput(EngineError):
    """The engine produced NaN or infinity (a worker's check of every output). The session's
    state on that stage is unusable: the worker closed it. A route session files it as the
    stage's engine fault and re-prefills elsewhere."""

    code, status = -1, "DGR_E_NON_FINITE"


class StateError(EngineError, ValueError):
    """A saved state does not fit this engine (nothing changed), or llama.cpp refused it (the
    session is emptied: next position 0)."""

    code, status = 12, "DGR_E_STATE"


class UnsupportedFeature(EngineError):
    """The feature is reserved and off (MTP). Nothing changed."""

    code, status = 13, "DGR_E_UNSUPPORTED"


class InternalError(EngineError):
    """An unexpected failure inside the engine; see the message."""

    code, status = 14, "DGR_E_INTERNAL"


class EngineClosed(EngineError):
    """The engine handle was closed; it cannot be used any more. A stage whose engine is closed
    is dead: the route session moves to a new route."""

    fault_kind = FaultKind.DEAD


# -- refusals of the gRPC worker and its client (no C status of their own) --------------------


class FrameRejected(EngineError, ValueError):
    """A frame is malformed: wrong dtype, shape or byte length, missing or unexpected rows or
    token ids, non-contiguous positions, or over the message size limit. The worker changed
    nothing; the session lives on and may resend a correct frame."""

    status = "DGR_E_FRAME"


class ExpectationMismatch(EngineError, ValueError):
    """The frame was meant for another worker: its model hash, layer range, boundary width or
    schema version differs from what the worker serves (the ``status`` says which). Nothing
    changed; the route is wrong, not the data: ask for another route."""

    status = "DGR_E_EXPECTATION"


class ShardUnavailable(EngineError, session_errors.StageDead):
    """The worker is unreachable or shutting down; its sessions' state is gone or going. The
    route session must move to a new route (re-prefill under a new epoch): it lives on.

    The worker client's side of :class:`dgr_session.errors.StageDead` (a ``ConnectionError``)."""

    status = "DGR_E_UNAVAILABLE"
    fault_kind = FaultKind.DEAD


class ShardDeadlineExceeded(EngineError, TimeoutError):
    """The call's deadline passed. With ``DGR_E_DEADLINE`` the engine never ran (nothing
    changed); without it (the client gave up) the state may have advanced: treat the stage as
    faulty and re-prefill under a new epoch."""

    status = "DGR_E_DEADLINE"
    fault_kind = FaultKind.DEADLINE


class GrantUnauthenticated(EngineError, PermissionError):
    """The open carried no route grant, or one that is malformed, badly signed or signed by a
    key the worker does not know; or a frame, close, link, output stream or usage request
    carried no or the wrong session secret (every session has one, with or without grants).
    Nothing changed. A route session cannot use this stage: ask for another route."""

    status = "DGR_E_UNAUTHENTICATED"
    fault_kind = FaultKind.PROTOCOL


class GrantDenied(EngineError, PermissionError):
    """A validly signed route grant that does not permit this open: another session, epoch,
    stage, model or lane, expired, used before, or issued before the worker started; or a
    ``Link`` to a stage the grant does not name as next (without grants: one that does not
    confirm it holds the session); or, without grants, an open of a session another client
    holds. Nothing changed. A route session cannot use this stage: ask for another route."""

    status = "DGR_E_PERMISSION"
    fault_kind = FaultKind.PROTOCOL


class ClientCallError(EngineError):
    """A call failed in this client before anything reached the worker: gRPC refused to start
    it (invalid metadata, a message that cannot be serialised) or the client's own channel is
    closed. The worker saw nothing and changed nothing; it is not to blame (fault kind
    ``client``): a route session ends with ``ClientFailure`` and no worker is excluded."""

    status = "DGR_E_CLIENT"
    fault_kind = FaultKind.CLIENT


class ShardRpcError(EngineError):
    """A gRPC failure without a dgr reason (``status`` is ``GRPC_<CODE>``), or a reply out of
    protocol (``DGR_E_PROTOCOL``). Treat the stage as faulty."""

    status = "DGR_E_RPC"


class AbiMismatch(ImportError):
    """The compiled native module does not match this Python package's ABI version."""


_BY_CODE: dict[int, type[EngineError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        ModelLoadError,
        UnsupportedArchitecture,
        LayerRangeError,
        UnknownSession,
        StaleEpoch,
        CapacityExceeded,
        PositionMismatch,
        ShapeMismatch,
        ContextFull,
        DecodeError,
        StateError,
        UnsupportedFeature,
        InternalError,
    )
}


def error_for_status(
    code: int, status: str, message: str, *, held_epoch: int | None = None
) -> EngineError:
    """The typed exception for a failed C call (the one place that maps status codes); a
    stale epoch carries ``held_epoch``, the epoch the engine holds (``dgr_last_held_epoch()``;
    ``None`` or negative: unknown)."""
    cls = _BY_CODE.get(code, EngineError)
    text = f"{status}: {message}"
    if cls is StaleEpoch:
        held = held_epoch if held_epoch is not None and held_epoch >= 0 else None
        return StaleEpoch(text, code=code, status=status, held_epoch=held)
    return cls(text, code=code, status=status)
