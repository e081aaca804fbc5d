"""Closes, published: the session table tells every listener each ``(session, epoch)`` it
closed, whatever closed it, so that what the worker keeps per session beside the table (the
chain hub's links and output streams, the grant gate's secrets, the per-client limits' owners
and frame budgets) is forgotten when the session is, and nothing has to look for closed
sessions lazily.

The table publishes after the close is done and outside its lock; a listener that raises is
logged with the session, epoch and cause, and the close, the other listeners and the caller
go on. The table runs on the engine thread (and, for a small frame, on the event loop): a
listener that lives on the loop is registered through :class:`OnLoop`, which hands it each
close on the loop's thread, ahead of the engine call's own result (so whoever awaited the call
that closed a session finds its listeners told).
"""

from __future__ import annotations

import asyncio
import enum
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import attrs
from loguru import logger

if TYPE_CHECKING:
    from loguru import Logger


class CloseCause(enum.StrEnum):
    """Why a session's epoch was closed."""

    CLIENT = "client"
    """Its client closed it (``CloseSession``), or a close of a newer epoch named it."""
    SUPERSEDED = "superseded"
    """An open of a newer epoch discarded it: the session is still held, at that epoch."""
    LEASE = "lease"
    """Nobody used it for the session lease."""
    STALL = "stall"
    """Unused since before a stall of the worker, and not used within the resume grace."""
    ABANDONED = "abandoned"
    """A call of that epoch was cancelled by its caller (a dgr client never reuses it)."""
    NON_FINITE = "non-finite"
    """The engine produced NaN or infinity for it: its KV holds them too."""
    SHUTDOWN = "shutdown"
    """The worker stopped."""


@attrs.frozen
class SessionClosed:
    """One close the session table made."""

    session_id: str
    epoch: int
    """The epoch closed (a close of a newer epoch closes the older one held)."""
    cause: CloseCause

    @property
    def still_held(self) -> bool:
        """Whether the session lives on here at a newer epoch (only after ``SUPERSEDED``)."""
        return self.cause is CloseCause.SUPERSEDED


class CloseListener(Protocol):
    """Told of every close (``SessionTable(listeners=...)``)."""

    def session_closed(self, closed: SessionClosed) -> None: ...


def notify(listeners: Iterable[CloseListener], closed: SessionClosed, log: Logger) -> None:
    """Tells each listener of ``closed``; one that raises is logged, and the rest are told."""
    for listener in listeners:
        try:
            listener.session_closed(closed)
        except Exception as exc:  # noqa: BLE001 - a listener never breaks a close
            log.bind(session=closed.session_id, epoch=closed.epoch).opt(exception=exc).error(
                "telling {} of a close ({}) failed: {!r}",
                type(listener).__name__,
                closed.cause.value,
                exc,
            )


class OnLoop:
    """A listener that lives on an event loop, told of closes on that loop's thread.

    Until :meth:`bind` names the loop (the worker's ``start``) and after the loop is gone, it
    is told at once, on the closing thread (nothing else runs then). A close made on the
    loop's own thread is told at once too."""

    def __init__(self, listener: CloseListener, log: Logger | None = None) -> None:
        self.listener = listener
        self._log = log if log is not None else logger
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Tells the listener of closes on ``loop`` from now on (call on that loop)."""
        self._loop, self._loop_thread = loop, threading.get_ident()

    def session_closed(self, closed: SessionClosed) -> None:
        loop = self._loop
        if loop is None or self._loop_thread == threading.get_ident() or loop.is_closed():
            self.listener.session_closed(closed)
            return
        loop.call_soon_threadsafe(notify, (self.listener,), closed, self._log)
