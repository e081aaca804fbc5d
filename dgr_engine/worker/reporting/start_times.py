"""Where a worker's start-up seconds went, phase by phase: the line a worker logs when it
listens (``ready in 0.40 s: header 0.09 s, hash 0.00 s, engine 0.31 s, serve 0.00 s``), and
the reading of that line back from a log (``benchmarks.worker_start``): one format, written and
read here."""

from __future__ import annotations

import re
import time

_READY = re.compile(r"ready in (?P<total>[\d.]+) s: (?P<parts>.*)$")
_PART = re.compile(r"(?P<phase>\w+) (?P<seconds>[\d.]+) s")


class StartTimes:
    """A stopwatch of named phases, each ended by :meth:`lap`."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    def lap(self, phase: str) -> None:
        """Ends ``phase`` now."""
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def text(self) -> str:
        """E.g. ``ready in 1.21 s: header 0.02 s, hash 0.00 s, engine 1.02 s, serve 0.17 s``."""
        total = sum(seconds for _, seconds in self.phases)
        parts = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.phases)
        return f"ready in {total:.2f} s: {parts}"


def phases_in(log: str) -> tuple[tuple[str, float], ...]:
    """The phases of the first ``ready in`` line of a worker's log (empty: no such line)."""
    for line in log.splitlines():
        found = _READY.search(line)
        if found is not None:
            return tuple((m["phase"], float(m["seconds"])) for m in _PART.finditer(found["parts"]))
    return ()
