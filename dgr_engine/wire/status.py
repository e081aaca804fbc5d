"""The one place that maps dgr failures to gRPC status codes and back: a refusal's code, its
``dgr-status`` and ``dgr-held-epoch`` trailers, and the typed exception a client raises for
them (the table: ``docs/wire.md``)."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from dgr_engine import errors as E
from dgr_session.identifiers import InvalidIdentifier

STATUS_KEY = "dgr-status"
"""Trailing-metadata key of the machine-readable reason."""

RETRY_AFTER_KEY = "dgr-retry-after-ms"
"""Trailing-metadata key of a busy worker's hint: milliseconds after which a new open may find
a free session slot (decimal), sent with a ``DGR_E_CAPACITY`` refusal when the worker knows."""

HELD_EPOCH_KEY = "dgr-held-epoch"
"""Trailing-metadata key of the epoch a worker holds, sent with a ``DGR_E_STALE_EPOCH``
refusal (decimal)."""

CHAIN_HOP_KEY = "dgr-chain-hop"
"""Trailing-metadata key of a chained route's refusal: the index (decimal) of the stage that
refused the frame or was lost (``docs/chain.md``)."""

_C = grpc.StatusCode

_BY_STATUS: dict[str, tuple[grpc.StatusCode, type[E.ShardError]]] = {
    "DGR_E_FRAME": (_C.INVALID_ARGUMENT, E.FrameRejected),
    "DGR_E_UNAUTHENTICATED": (_C.UNAUTHENTICATED, E.GrantUnauthenticated),
    "DGR_E_PERMISSION": (_C.PERMISSION_DENIED, E.GrantDenied),
    "DGR_E_MESSAGE_SIZE": (_C.RESOURCE_EXHAUSTED, E.FrameRejected),
    "DGR_E_EXPECTATION": (_C.INVALID_ARGUMENT, E.ExpectationMismatch),
    "DGR_E_EXPECTATION_SCHEMA": (_C.INVALID_ARGUMENT, E.ExpectationMismatch),
    "DGR_E_EXPECTATION_MODEL": (_C.INVALID_ARGUMENT, E.ExpectationMismatch),
    "DGR_E_EXPECTATION_RANGE": (_C.INVALID_ARGUMENT, E.ExpectationMismatch),
    "DGR_E_EXPECTATION_WIDTH": (_C.INVALID_ARGUMENT, E.ExpectationMismatch),
    "DGR_E_INVALID_ARGUMENT": (_C.INVALID_ARGUMENT, E.InvalidArgument),
    "DGR_E_SHAPE": (_C.INVALID_ARGUMENT, E.ShapeMismatch),
    "DGR_E_STALE_EPOCH": (_C.FAILED_PRECONDITION, E.StaleEpoch),
    "DGR_E_POSITION": (_C.FAILED_PRECONDITION, E.PositionMismatch),
    "DGR_E_UNKNOWN_SESSION": (_C.NOT_FOUND, E.UnknownSession),
    "DGR_E_CAPACITY": (_C.RESOURCE_EXHAUSTED, E.CapacityExceeded),
    "DGR_E_CONTEXT_FULL": (_C.RESOURCE_EXHAUSTED, E.ContextFull),
    "DGR_E_DEADLINE": (_C.DEADLINE_EXCEEDED, E.ShardDeadlineExceeded),
    "DGR_E_SHUTTING_DOWN": (_C.UNAVAILABLE, E.ShardUnavailable),
    "DGR_E_UNAVAILABLE": (_C.UNAVAILABLE, E.ShardUnavailable),
    "DGR_E_DECODE": (_C.INTERNAL, E.DecodeError),
    "DGR_E_NON_FINITE": (_C.INTERNAL, E.NonFiniteOutput),
    "DGR_E_STATE": (_C.INTERNAL, E.StateError),
    "DGR_E_UNSUPPORTED": (_C.INTERNAL, E.UnsupportedFeature),
    "DGR_E_INTERNAL": (_C.INTERNAL, E.InternalError),
}

_BY_CODE: dict[grpc.StatusCode, type[E.ShardError]] = {
    _C.UNAVAILABLE: E.ShardUnavailable,
    _C.CANCELLED: E.ShardUnavailable,
    _C.DEADLINE_EXCEEDED: E.ShardDeadlineExceeded,
}


WORKER_FAULTS = frozenset({"DGR_E_DECODE", "DGR_E_INTERNAL", "DGR_E_NON_FINITE"})
"""Refusals that are the worker's own fault: its engine failed or produced non-finite output, or
it hit an unexpected error. Every other refusal (a malformed frame, an undefined enum value, an
invalid session id, non-finite rows, bad shapes or positions, stale epochs, unknown sessions,
wrong expectations, missing grants or secrets, capacity) is the caller's doing, or routine
around route changes. A frame's deadline passing (``DGR_E_DEADLINE``) is not counted either:
the deadline is the caller's to choose (``timeout_ms=1`` would otherwise let any client make a
healthy worker look faulty); a slow stage shows in the client's failure reports, which carry
the stage and its timings, and the tracker judges from those."""


def is_worker_fault(exc: BaseException) -> bool:
    """Whether refusing ``exc`` counts against the worker's health (its advert's
    ``recent_errors``): only its own faults (:data:`WORKER_FAULTS`) do, and any exception that
    is not a typed refusal (a bug here, so ``DGR_E_INTERNAL``)."""
    return grpc_status_for(exc)[1] in WORKER_FAULTS


def known_statuses() -> Iterable[str]:
    """Every dgr-status a worker may send."""
    return _BY_STATUS.keys()


def grpc_status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC code and dgr-status a worker answers ``exc`` with (an identifier that breaks
    ``dgr_session.identifiers``' rule is a malformed frame)."""
    if isinstance(exc, InvalidIdentifier):
        return _C.INVALID_ARGUMENT, "DGR_E_FRAME"
    if isinstance(exc, E.EngineClosed):
        return _C.UNAVAILABLE, "DGR_E_SHUTTING_DOWN"
    if isinstance(exc, E.ShardError) and exc.status in _BY_STATUS:
        return _BY_STATUS[exc.status][0], exc.status
    return _C.INTERNAL, "DGR_E_INTERNAL"


def refusal_trailers(exc: BaseException, status: str) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a worker refuses a call with: the dgr-status, the epoch it holds
    for a stale-epoch refusal, and its retry hint for a busy one."""
    trailers: tuple[tuple[str, str], ...] = ((STATUS_KEY, status),)
    held = exc.held_epoch if isinstance(exc, E.StaleEpoch) else None
    if held is not None:
        trailers += ((HELD_EPOCH_KEY, str(held)),)
    retry = exc.retry_after if isinstance(exc, E.CapacityExceeded) else None
    if retry is not None:
        trailers += ((RETRY_AFTER_KEY, str(round(retry * 1000))),)
    return trailers


def error_from_trailers(
    code: grpc.StatusCode, trailers: Iterable[tuple[str, str | bytes]] | None, details: str
) -> E.ShardError:
    """The typed exception for a failed call, from its code, trailing metadata and details
    (see :func:`error_from_rpc`); a stale-epoch refusal carries the worker's held epoch."""
    found: dict[str, str] = {}
    for key, value in trailers or ():
        if key in (STATUS_KEY, HELD_EPOCH_KEY, RETRY_AFTER_KEY):
            found[key] = value if isinstance(value, str) else value.decode()
    error = error_from_rpc(code, found.get(STATUS_KEY), details)
    held = found.get(HELD_EPOCH_KEY, "")
    if isinstance(error, E.StaleEpoch) and held.isdigit():
        error.held_epoch = int(held)
    retry = found.get(RETRY_AFTER_KEY, "")
    if isinstance(error, E.CapacityExceeded) and retry.isdigit():
        error.retry_after = int(retry) / 1000
    return error


def error_from_rpc(code: grpc.StatusCode, status: str | None, details: str) -> E.ShardError:
    """The typed exception for a failed call: by dgr-status when the worker sent one, else by
    gRPC code (connection failures, deadlines, gRPC's own size limit)."""
    if status is not None and status in _BY_STATUS:
        return _BY_STATUS[status][1](details, status=status)
    if code == _C.RESOURCE_EXHAUSTED and "larger than max" in details:
        return E.FrameRejected(details, status="DGR_E_MESSAGE_SIZE")
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(details)
    return E.ShardRpcError(details, status=status or f"GRPC_{code.name}")
