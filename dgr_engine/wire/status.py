"""The gRPC side of dgr's status table (``dgr_engine.status``): a refusal's gRPC code, its
``dgr-status`` and ``dgr-held-epoch`` trailers, and the typed exception a client raises for
them (``docs/wire.md``)."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from dgr_engine import errors as E
from dgr_engine.status import STATUSES, Status, error_for, status_of

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

_CODE_OF: dict[Status, grpc.StatusCode] = {
    status: grpc.StatusCode[rule.grpc_code]
    for status, rule in STATUSES.items()
    if rule.grpc_code is not None
}
"""The gRPC code of every status a worker sends (``dgr_engine.status.STATUSES``)."""

_BY_CODE: dict[grpc.StatusCode, type[E.ShardError]] = {
    _C.UNAVAILABLE: E.ShardUnavailable,
    _C.CANCELLED: E.ShardUnavailable,
    _C.DEADLINE_EXCEEDED: E.ShardDeadlineExceeded,
}
"""A failed call without a dgr-status: gRPC's own failures (no worker answered)."""


def known_statuses() -> Iterable[str]:
    """Every dgr-status a worker may send."""
    return _CODE_OF.keys()


def grpc_status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC code and dgr-status a worker answers ``exc`` with (``status_of``)."""
    status = status_of(exc)
    return _CODE_OF[status], status.value


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
    if status is not None and status in _CODE_OF:
        return error_for(Status(status), details)
    if code == _C.RESOURCE_EXHAUSTED and "larger than max" in details:
        return E.FrameRejected(details, status="DGR_E_MESSAGE_SIZE")
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(details)
    return E.ShardRpcError(details, status=status or f"GRPC_{code.name}")


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def grpc_code(number: int) -> grpc.StatusCode:
    """The gRPC code of ``number`` (what a frame link ``STATUS`` carries); ``UNKNOWN`` for a
    number that is no code."""
    return _CODES.get(number, _C.UNKNOWN)


def error_from_number(
    number: int, trailers: Iterable[tuple[str, str | bytes]] | None, details: str
) -> E.ShardError:
    """:func:`error_from_trailers` for a call whose code came as its number (the frame
    link)."""
    return error_from_trailers(grpc_code(number), trailers, details)


def chain_hop_of(trailers: Iterable[tuple[str, str | bytes]] | None, default: int) -> int:
    """The stage a chained call's refusal names (``dgr-chain-hop``), else ``default``."""
    for key, value in trailers or ():
        if key == CHAIN_HOP_KEY:
            text = value if isinstance(value, str) else bytes(value).decode()
            return int(text) if text.isdigit() else default
    return default
