"""Load and health counters of one worker, for the advert (thread-safe, O(window) memory).

In flight = forwards admitted and not yet answered; queued = those not yet running in the
engine. Rows per second and recent errors are counted over a sliding window.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import attrs


@attrs.frozen
class LoadSnapshot:
    in_flight: int
    queued: int
    rows_per_second: float
    recent_errors: int
    total_errors: int
    uptime_seconds: float
    window_seconds: float


class LoadMeter:
    """Counts forwards, rows and errors; ``clock`` is injectable for tests."""

    def __init__(
        self, window_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window_seconds
        self._now = clock
        self._lock = threading.Lock()
        self._started = self._now()
        self._in_flight = 0
        self._running = 0
        self._rows: deque[tuple[float, int]] = deque()
        self._errors: deque[float] = deque()
        self._total_errors = 0

    def admitted(self) -> None:
        with self._lock:
            self._in_flight += 1

    def started(self) -> None:
        """An admitted forward reached the engine."""
        with self._lock:
            self._running += 1

    def stopped(self) -> None:
        """It left the engine."""
        with self._lock:
            self._running -= 1

    def finished(self, rows: int) -> None:
        """One admitted forward is answered (``rows`` forwarded, 0 if refused)."""
        now = self._now()
        with self._lock:
            self._in_flight -= 1
            if rows:
                self._rows.append((now, rows))
            self._trim(now)

    def error(self) -> None:
        """One fault of the worker's own (never a caller's refusal: the servicers count only
        what ``dgr_engine.status.is_worker_fault`` says is one)."""
        now = self._now()
        with self._lock:
            self._errors.append(now)
            self._total_errors += 1
            self._trim(now)

    def snapshot(self) -> LoadSnapshot:
        now = self._now()
        with self._lock:
            self._trim(now)
            span = min(self.window, max(now - self._started, 1e-9))
            return LoadSnapshot(
                in_flight=self._in_flight,
                queued=self._in_flight - self._running,
                rows_per_second=sum(r for _, r in self._rows) / span,
                recent_errors=len(self._errors),
                total_errors=self._total_errors,
                uptime_seconds=now - self._started,
                window_seconds=self.window,
            )

    def _trim(self, now: float) -> None:
        horizon = now - self.window
        while self._rows and self._rows[0][0] < horizon:
            self._rows.popleft()
        while self._errors and self._errors[0] < horizon:
            self._errors.popleft()
