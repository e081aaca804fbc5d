"""Progress of long work on stderr: a redrawn bar on a terminal, else a line per percent."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def progress_printer(
    verb: str, stream: TextIO | None = None
) -> tuple[Callable[[str, int, int], None], Callable[[], None]]:
    """``(report, finish)``: ``report(name, done, total)`` after each step, ``finish()`` at the
    end (ends the bar's line). Lines read ``VERB NAME PCT% DONE/TOTAL bytes``."""
    out = stream or sys.stderr
    tty = out.isatty()
    last = [-1, 0.0]
    began = time.monotonic()

    def report(name: str, done: int, total: int) -> None:
        percent = 100 * done // total if total else 100
        now = time.monotonic()
        if tty:
            if now - last[1] < 0.1 and done < total:
                return
            width = 30
            filled = width * done // total if total else width
            rate = done / max(now - began, 1e-6) / 2**20
            bar = "#" * filled + "." * (width - filled)
            out.write(f"\r{verb} [{bar}] {percent:3d}% {rate:7.1f} MiB/s {name[:40]:<40}")
        elif percent != last[0] or done >= total:
            out.write(f"{verb} {name} {percent}% {done}/{total} bytes\n")
        else:
            return
        last[0], last[1] = percent, now
        out.flush()

    def finish() -> None:
        if tty and last[0] >= 0:
            out.write("\n")
            out.flush()

    return report, finish
