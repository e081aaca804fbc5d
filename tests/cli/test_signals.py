"""SIGTERM interrupts a command as Ctrl-C does (``cli/_signals.py``), even when the signal lands
inside a finalizer, where an exception raised by a signal handler is only printed and lost
(a SIGTERMed demo once ran to its end so)."""

from __future__ import annotations

import asyncio
import os
import signal
import weakref

import pytest

from dgr_engine.cli._signals import sigterm_as_interrupt


class _Finalized:
    """An object whose finalizer sends this process SIGTERM: the signal's handler runs inside
    the finalizer."""


async def _terminated_inside_a_finalizer() -> str:
    doomed = _Finalized()
    weakref.finalize(doomed, os.kill, os.getpid(), signal.SIGTERM)
    del doomed  # the finalizer runs here, and SIGTERM's handler within it
    for _ in range(100):  # bounded: 5 s at most
        await asyncio.sleep(0.05)
    return "ran to its end"


def test_sigterm_inside_a_finalizer_still_interrupts_an_asyncio_program() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt):
        asyncio.run(_terminated_inside_a_finalizer())
    assert signal.getsignal(signal.SIGTERM) is before  # restored on the way out


def test_sigterm_raises_itself_where_sigint_is_ignored() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt, match="signal 15"):
            signal.raise_signal(signal.SIGTERM)
            for _ in range(100):  # the handler runs at the next bytecode: bounded anyway
                pass
    finally:
        signal.signal(signal.SIGINT, previous)
