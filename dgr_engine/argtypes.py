"""Argument types that refuse out-of-range values in the parser (one line, exit status 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An ``int`` type accepting ``low <= value <= high``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(low: float, high: float) -> Callable[[str], float]:
    """A finite ``float`` type accepting ``low <= value <= high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}], got {text}")
        return value

    parse.__name__ = "number"
    return parse


def layer_range(text: str) -> tuple[int, int]:
    """``A:B``: main layers ``[A, B)``; ``A:`` reads ``(A, -1)``, "to the last layer"."""
    begin, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(begin), int(end) if end else -1
    except ValueError:
        message = f"expected A:B (or A: for 'to the end'), got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad command line in one line (``PROG: error: ...``) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
