"""SIGTERM handled like Ctrl-C by the programs that start worker processes."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``KeyboardInterrupt`` (like Ctrl-C) while inside; main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
