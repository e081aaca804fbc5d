"""dgr's one status vocabulary: every status a shard call can end with, and the one table from
each to its C code (``native/include/dgr_shard.h``), its gRPC code (where a worker sends it over
gRPC), the exception class a caller raises for it, and through that class its fault kind (how a
route session files it).

Every data path speaks these statuses and nothing else: the C engine and native links as C codes
(a native link's ``FAILED`` message carries the code, never a name in its text), gRPC and the
frame link as the ``dgr-status`` trailer (``wire/status.py``, the gRPC side of this table). The
table is tested against the C header, so the two cannot drift (``tests/wire/test_status_table``).

gRPC codes are named here as strings (``"INVALID_ARGUMENT"``): only the gRPC side resolves them,
so this module (and whatever imports it) needs no gRPC.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs

from dgr_engine import errors as E
from dgr_session.faults import FaultKind
from dgr_session.identifiers import InvalidIdentifier

__all__ = [
    "STATUSES",
    "Status",
    "StatusRule",
    "error_for",
    "error_for_code",
    "is_worker_fault",
    "status_of",
]


class Status(enum.StrEnum):
    """Every status a shard call can end with (the value is its stable name)."""

    INVALID_ARGUMENT = "DGR_E_INVALID_ARGUMENT"
    MODEL_LOAD = "DGR_E_MODEL_LOAD"
    UNSUPPORTED_ARCH = "DGR_E_UNSUPPORTED_ARCH"
    LAYER_RANGE = "DGR_E_LAYER_RANGE"
    UNKNOWN_SESSION = "DGR_E_UNKNOWN_SESSION"
    STALE_EPOCH = "DGR_E_STALE_EPOCH"
    CAPACITY = "DGR_E_CAPACITY"
    POSITION = "DGR_E_POSITION"
    SHAPE = "DGR_E_SHAPE"
    CONTEXT_FULL = "DGR_E_CONTEXT_FULL"
    DECODE = "DGR_E_DECODE"
    STATE = "DGR_E_STATE"
    UNSUPPORTED = "DGR_E_UNSUPPORTED"
    INTERNAL = "DGR_E_INTERNAL"
    LINK_LOST = "DGR_E_LINK_LOST"
    FRAME = "DGR_E_FRAME"
    UNAUTHENTICATED = "DGR_E_UNAUTHENTICATED"
    NON_FINITE = "DGR_E_NON_FINITE"
    PERMISSION = "DGR_E_PERMISSION"
    EXPECTATION = "DGR_E_EXPECTATION"
    EXPECTATION_SCHEMA = "DGR_E_EXPECTATION_SCHEMA"
    EXPECTATION_MODEL = "DGR_E_EXPECTATION_MODEL"
    EXPECTATION_RANGE = "DGR_E_EXPECTATION_RANGE"
    EXPECTATION_WIDTH = "DGR_E_EXPECTATION_WIDTH"
    MESSAGE_SIZE = "DGR_E_MESSAGE_SIZE"
    DEADLINE = "DGR_E_DEADLINE"
    SHUTTING_DOWN = "DGR_E_SHUTTING_DOWN"
    UNAVAILABLE = "DGR_E_UNAVAILABLE"
    # the client's own: no worker sends them
    PROTOCOL = "DGR_E_PROTOCOL"
    RPC = "DGR_E_RPC"
    CLIENT = "DGR_E_CLIENT"
    RING_MISMATCH = "DGR_E_RING_MISMATCH"
    UNKNOWN_STATUS = "DGR_E_UNKNOWN_STATUS"


@attrs.frozen
class StatusRule:
    """What one status is on every path."""

    c_code: int | None
    """Its C code (``dgr_status``), or ``None`` for the client's own statuses."""
    grpc_code: str | None
    """The gRPC code a worker refuses a call with for it (the name of gRPC's status code), or
    ``None`` for statuses no worker sends over gRPC."""
    error: type[E.ShardError]
    """The exception a caller raises for it."""
    worker_fault: bool = False
    """Whether a worker refusing with it counts against the worker's own health (its engine
    failed, produced non-finite output, or it hit an unexpected error); every other refusal is
    the caller's doing or routine around route changes."""

    @property
    def fault_kind(self) -> FaultKind:
        """How a route session files it: the exception class's declared kind."""
        return self.error.fault_kind


S, R = Status, StatusRule

STATUSES: Mapping[Status, StatusRule] = {
    S.INVALID_ARGUMENT: R(1, "INVALID_ARGUMENT", E.InvalidArgument),
    S.MODEL_LOAD: R(2, "INTERNAL", E.ModelLoadError),
    S.UNSUPPORTED_ARCH: R(3, "INTERNAL", E.UnsupportedArchitecture),
    S.LAYER_RANGE: R(4, "INTERNAL", E.LayerRangeError),
    S.UNKNOWN_SESSION: R(5, "NOT_FOUND", E.UnknownSession),
    S.STALE_EPOCH: R(6, "FAILED_PRECONDITION", E.StaleEpoch),
    S.CAPACITY: R(7, "RESOURCE_EXHAUSTED", E.CapacityExceeded),
    S.POSITION: R(8, "FAILED_PRECONDITION", E.PositionMismatch),
    S.SHAPE: R(9, "INVALID_ARGUMENT", E.ShapeMismatch),
    S.CONTEXT_FULL: R(10, "RESOURCE_EXHAUSTED", E.ContextFull),
    S.DECODE: R(11, "INTERNAL", E.DecodeError, worker_fault=True),
    S.STATE: R(12, "INTERNAL", E.StateError),
    S.UNSUPPORTED: R(13, "INTERNAL", E.UnsupportedFeature),
    S.INTERNAL: R(14, "INTERNAL", E.InternalError, worker_fault=True),
    S.LINK_LOST: R(15, "UNAVAILABLE", E.ShardUnavailable),
    S.FRAME: R(16, "INVALID_ARGUMENT", E.FrameRejected),
    S.UNAUTHENTICATED: R(17, "UNAUTHENTICATED", E.GrantUnauthenticated),
    S.NON_FINITE: R(18, "INTERNAL", E.NonFiniteOutput, worker_fault=True),
    S.PERMISSION: R(19, "PERMISSION_DENIED", E.GrantDenied),
    S.EXPECTATION: R(20, "INVALID_ARGUMENT", E.ExpectationMismatch),
    S.EXPECTATION_SCHEMA: R(21, "INVALID_ARGUMENT", E.ExpectationMismatch),
    S.EXPECTATION_MODEL: R(22, "INVALID_ARGUMENT", E.ExpectationMismatch),
    S.EXPECTATION_RANGE: R(23, "INVALID_ARGUMENT", E.ExpectationMismatch),
    S.EXPECTATION_WIDTH: R(24, "INVALID_ARGUMENT", E.ExpectationMismatch),
    S.MESSAGE_SIZE: R(25, "RESOURCE_EXHAUSTED", E.FrameRejected),
    S.DEADLINE: R(26, "DEADLINE_EXCEEDED", E.ShardDeadlineExceeded),
    S.SHUTTING_DOWN: R(27, "UNAVAILABLE", E.ShardUnavailable),
    S.UNAVAILABLE: R(28, "UNAVAILABLE", E.ShardUnavailable),
    S.PROTOCOL: R(None, None, E.ShardRpcError),
    S.RPC: R(None, None, E.ShardRpcError),
    S.CLIENT: R(None, None, E.ClientCallError),
    S.RING_MISMATCH: R(None, None, E.ShardRpcError),
    S.UNKNOWN_STATUS: R(None, None, E.EngineError),
}

del S, R

_BY_C_CODE: Mapping[int, Status] = {
    rule.c_code: status for status, rule in STATUSES.items() if rule.c_code is not None
}

_NAMES = frozenset(Status)


def error_for(
    status: Status,
    message: str,
    *,
    code: int | None = None,
    held_epoch: int | None = None,
    retry_after: float | None = None,
) -> E.ShardError:
    """The typed exception for ``status`` (a stale epoch carries ``held_epoch``, the epoch the
    refusing side holds; a busy refusal its ``retry_after`` hint, seconds)."""
    cls = STATUSES[status].error
    if issubclass(cls, E.StaleEpoch):
        return cls(message, code=code, status=status, held_epoch=held_epoch)
    error = (
        cls(message, code=code, status=status)
        if issubclass(cls, E.EngineError)
        else cls(message, status=status)
    )
    if isinstance(error, E.CapacityExceeded) and retry_after is not None:
        error.retry_after = retry_after
    return error


def error_for_code(code: int, message: str, *, held_epoch: int | None = None) -> E.ShardError:
    """The typed exception for a C status code (the engine's, or a native link's ``FAILED``),
    its message led by the status's name; a code outside the table is an
    :class:`~dgr_engine.errors.EngineError` of status ``DGR_E_UNKNOWN_STATUS``. ``held_epoch``
    < 0 means unknown."""
    status = _BY_C_CODE.get(code, Status.UNKNOWN_STATUS)
    held = held_epoch if held_epoch is not None and held_epoch >= 0 else None
    return error_for(status, f"{status}: {message}", code=code, held_epoch=held)


def status_of(exc: BaseException) -> Status:
    """The status a worker answers ``exc`` with: a typed refusal's own (an identifier that
    breaks ``dgr_session.identifiers``' rule is a malformed frame; a closed engine a worker
    shutting down); anything else (a bug) is ``DGR_E_INTERNAL``."""
    if isinstance(exc, InvalidIdentifier):
        return Status.FRAME
    if isinstance(exc, E.EngineClosed):
        return Status.SHUTTING_DOWN
    if isinstance(exc, E.ShardError) and exc.status in _NAMES:
        status = Status(exc.status)
        if STATUSES[status].grpc_code is not None:
            return status
    return Status.INTERNAL


def is_worker_fault(exc: BaseException) -> bool:
    """Whether refusing ``exc`` counts against the worker's health (its advert's
    ``recent_errors``): only its own faults (``StatusRule.worker_fault``) do, and any exception
    that is not a typed refusal (a bug here, so ``DGR_E_INTERNAL``). A frame's deadline passing
    (``DGR_E_DEADLINE``) is not counted: the deadline is the caller's to choose (``timeout_ms=1``
    would otherwise let any client make a healthy worker look faulty)."""
    return STATUSES[status_of(exc)].worker_fault
