"""The worker's engine thread: runs blocking engine calls one at a time, in arrival order, and
says when it is idle (``docs/worker.md``: why not ``run_in_executor``)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from dgr_engine.errors import ShardDeadlineExceeded

_T = TypeVar("_T")


def expired_in_queue() -> ShardDeadlineExceeded:
    """The refusal of a frame whose deadline passed before its engine call began: not run."""
    return ShardDeadlineExceeded(
        "DGR_E_DEADLINE: the deadline passed while queued; not run", status="DGR_E_DEADLINE"
    )


_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class EngineThread:
    """One daemon thread; ``await run(fn, *args)`` from the event loop."""

    def __init__(self, name: str = "dgr-engine") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._closed = False
        # one writer each (the loop thread submits, this thread finishes): plain ints suffice
        self._submitted = 0
        self._finished = 0

    @property
    def idle(self) -> bool:
        """No job is queued or running (read from the loop thread, the only submitter)."""
        return self._finished == self._submitted

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Runs ``fn(*args)`` on the thread after every earlier job; its result or exception."""
        if self._closed:
            raise RuntimeError("the engine thread is shut down")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        self._submitted += 1
        self._jobs.put((loop, future, fn, args))
        return await future

    def shutdown(self, timeout: float | None = None) -> None:
        """Lets queued jobs finish, then ends the thread (idempotent)."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        self._thread.join(timeout)

    def _main(self) -> None:
        # each job is counted finished before its caller can see the outcome: a caller that
        # resumes (and may submit its next job at once, or run one inline) finds the thread idle
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            if future.cancelled():
                self._finished += 1
                continue
            try:
                result = fn(*args)
            except BaseException as exc:
                self._finished += 1
                _deliver(loop, future, _set_exception, exc)
            else:
                self._finished += 1
                _deliver(loop, future, _set_result, result)


def _deliver(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    setter: Callable[[asyncio.Future[Any], Any], None],
    value: Any,
) -> None:
    try:
        loop.call_soon_threadsafe(setter, future, value)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
