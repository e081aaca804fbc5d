"""An asyncio loop whose clock jumps to the next timer whenever nothing is ready, so deadlines
fire without real waiting and runs are deterministic."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class _AutojumpSelector(selectors.BaseSelector):
    """Delegates to a real selector, but never blocks: when the loop would wait ``timeout``
    seconds for a timer, the virtual clock jumps by ``timeout`` instead."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        self._inner = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._inner.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("deadlock: the event loop would wait forever (nothing scheduled)")
        self._loop.advance(timeout)
        return ready

    def close(self) -> None:
        self._inner.close()

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.get_key(fileobj)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._inner.get_map()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time that jumps to the next timer whenever nothing is ready.

    Work that is ready always runs before time moves, so "let ``dt`` seconds pass" is
    ``loop.run_until_complete(asyncio.sleep(dt))``. A wait with nothing scheduled raises
    ``RuntimeError`` (a deadlock) instead of hanging.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._virtual_now = start
        super().__init__(selector=_AutojumpSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        if seconds > 0:
            self._virtual_now += seconds


async def settle(limit: int = 100_000) -> None:
    """Let every task that can run, run, without moving the clock: return once nothing but the
    caller is ready. (Peeks at the loop's ready queue, a CPython implementation detail.)"""
    loop = asyncio.get_running_loop()
    for _ in range(limit):
        await asyncio.sleep(0)
        if not loop._ready:  # type: ignore[attr-defined]
            return
    raise RuntimeError(f"still busy after {limit} iterations (livelock?)")


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]] | Coroutine[Any, Any, T]) -> T:
    """Run a coroutine (or a coroutine function) to completion on a fresh
    :class:`VirtualClockLoop`; then cancel what is left (like :func:`asyncio.run`) and close."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main() if callable(main) else main)
    finally:
        close_loop(loop)


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task left on ``loop``, let them finish, and close it (like the end of
    :func:`asyncio.run`)."""
    try:
        leftover = asyncio.all_tasks(loop)
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
