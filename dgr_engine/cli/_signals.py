"""SIGTERM handled like Ctrl-C by the programs that start worker processes."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM interrupts as Ctrl-C does while inside; main thread only.

    It goes through SIGINT's own handler: inside ``asyncio.run`` (or an ``asyncio.Runner``)
    that handler cancels the main task from the event loop, which then raises
    ``KeyboardInterrupt``. An exception raised by this handler itself could be lost: a signal's
    handler runs wherever the main thread is, and an exception raised in a finalizer or a
    weakref callback is only printed ("Exception ignored in ..."), so the program would go on
    as if never told (seen: a SIGTERMed demo that ran to its end). Where SIGINT is ignored, or
    has no Python handler, SIGTERM raises ``KeyboardInterrupt`` itself."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        if not callable(signal.getsignal(signal.SIGINT)):
            raise KeyboardInterrupt(f"signal {signum}")
        signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
