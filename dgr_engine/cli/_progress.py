"""Progress of slow steps on stderr, silenced by ``--quiet``.

Every ``dgr`` command that does something slower than about a second says what it is doing
here, never on stdout (which holds results): :func:`say` writes one line,
:func:`progress_printer` a byte count (a tqdm bar on a terminal, a line every 10 % elsewhere)
and :func:`timed` a step that says when it starts and how long it took.

The switch is :func:`quiet_progress`, used around a command's ``run(args)`` with
``args.quiet`` (every subcommand has ``--quiet``). It sets a context variable and restores it
on exit, so nothing leaks between tests; asyncio tasks and ``asyncio.to_thread`` see it
(they copy the context). A printer or sayer made under it keeps its answer, so a callback
called later from another thread stays as quiet as the command that made it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TextIO

from tqdm import tqdm

_QUIET: ContextVar[bool] = ContextVar("dgr_progress_quiet", default=False)

LINE_EVERY_PERCENT = 1
"""Off a terminal, a byte count prints a line each time it crosses this many percent."""


@contextmanager
def quiet_progress(quiet: bool) -> Iterator[None]:
    """Progress printed in this block (and the tasks and threads it starts through asyncio)
    is silenced when ``quiet``."""
    token = _QUIET.set(bool(quiet))
    try:
        yield
    finally:
        _QUIET.reset(token)


def is_quiet() -> bool:
    """Whether progress is silenced here (``--quiet``)."""
    return _QUIET.get()


def sayer(prefix: str = "", stream: TextIO | None = None) -> Callable[[str], None]:
    """``say(text)``: one line ``PREFIX TEXT`` on ``stream`` (default: stderr at the time of
    writing), or nothing when progress is silenced where the sayer is made."""
    quiet = is_quiet()

    def say(text: str) -> None:
        if quiet:
            return
        out = stream if stream is not None else sys.stderr
        out.write(f"{prefix}{text}\n")
        out.flush()

    return say


def say(text: str, stream: TextIO | None = None) -> None:
    """One progress line on stderr (nothing under ``--quiet``)."""
    sayer(stream=stream)(text)


@contextmanager
def timed(what: str, say_line: Callable[[str], None] | None = None) -> Iterator[None]:
    """``WHAT ...`` when the step starts, ``WHAT: N.N s`` when it ends (``WHAT: failed after
    N.N s`` when it raises)."""
    out = say_line if say_line is not None else sayer()
    began = time.perf_counter()
    out(f"{what} ...")
    try:
        yield
    except BaseException:
        out(f"{what}: failed after {time.perf_counter() - began:.1f} s")
        raise
    out(f"{what}: {time.perf_counter() - began:.1f} s")


def progress_printer(
    verb: str, stream: TextIO | None = None
) -> tuple[Callable[[str, int, int], None], Callable[[], None]]:
    """``(report, finish)``: ``report(name, done, total)`` after each step of a byte count,
    ``finish()`` at the end. On a terminal a tqdm bar (``VERB NAME``, rate, time left);
    elsewhere a line ``VERB NAME PCT% DONE/TOTAL bytes`` (exact: logs and scripts read them)
    every :data:`LINE_EVERY_PERCENT` % and at the end. Nothing at all under ``--quiet``."""
    if is_quiet():
        return (lambda _name, _done, _total: None), (lambda: None)
    out = stream if stream is not None else sys.stderr
    if out.isatty():
        return _bar(verb, out)
    return _lines(verb, out)


def _bar(verb: str, out: TextIO) -> tuple[Callable[[str, int, int], None], Callable[[], None]]:
    bars: dict[str, tqdm[None]] = {}

    def report(name: str, done: int, total: int) -> None:
        bar = bars.get(name)
        if bar is None:
            for old in bars.values():  # one bar at a time: the previous file is done
                old.close()
            bar = bars[name] = tqdm(
                total=total or None,
                desc=f"{verb} {name[:40]}",
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=out,
                dynamic_ncols=True,
            )
        if total and bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    def finish() -> None:
        for bar in bars.values():
            bar.close()
        bars.clear()

    return report, finish


def _lines(verb: str, out: TextIO) -> tuple[Callable[[str, int, int], None], Callable[[], None]]:
    printed: dict[str, int] = {}  # name -> the last step printed

    def report(name: str, done: int, total: int) -> None:
        percent = 100 * done // total if total else 100
        step = percent // LINE_EVERY_PERCENT
        if printed.get(name) == step:
            return
        printed[name] = step
        out.write(
            f"{verb} {name} {percent}% {done}/{total} bytes\n"
            if total
            else f"{verb} {name} {done} bytes\n"
        )
        out.flush()

    return report, lambda: None
