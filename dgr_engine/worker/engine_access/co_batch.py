"""Co-batching: frames of different sessions that wait for the engine together run in one engine
call (``ShardEngine.forward_batch``: one ``llama_decode`` carrying one sequence per session).

A worker started with ``--co-batch`` hands every forward frame to a :class:`CoBatcher` instead
of running it alone. Frames queue in arrival order; whenever the engine thread is free, the
batcher takes from the head of the queue as many frames as fit ``max_rows`` rows together, at
most one per session (a session's later frame waits for the next call), and runs them in one
call. So frames that arrive while the engine computes run together next, and a frame never
waits behind one that came after it (first come, first served; the head is always taken).

``wait_seconds`` (``--co-batch-wait-ms``) lets a call wait that long for more frames while
fewer frames queue than sessions are open, to fill it; 0 (the default) never waits: batches
form only from frames that queued while the engine was busy.

Numerics: ``dgr_forward_batch`` keeps each co-batched ``llama_decode`` under 32 rows, where
llama.cpp computes each row's matmuls on their own (patch 0010), and runs larger frames alone;
so a session's rows come out in the same bits as when it runs alone (tested bit for bit on the
fixtures). Weight types that llama.cpp repacks for the CPU (``Q4_K`` and ``Q4_0`` on x86, among
others: ``dgr_session.speculation.REPACKED_TYPES``) are multiplied four rows at a time by other
kernels than fewer rows: there a call carries at most ``REPACKED_PASS_ROWS`` (3) rows of one or
more sessions (:func:`co_batch_rows`), the rule verification passes follow too; measured on
Gemma 3 270M (``Q4_K_M``), four sessions co-batched one row each gave two of them logits up to
2.8 away from alone, three gave each its own bits. Co-batching stays part of the worker's lane
(``LaneKey.batching``): a certification record made without it does not certify a worker
running with it, and each lane's exactness is checked on its own.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import attrs

from dgr_engine.wire.frames import FloatRows, ForwardFrame
from dgr_engine.worker.engine_access.engine_thread import EngineThread, expired_in_queue
from dgr_engine.worker.lifecycle.sessions import Ran
from dgr_session.speculation import REPACKED_PASS_ROWS, verify_rows


class FrameResult(NamedTuple):
    """What a frame's run on the engine gives."""

    rows: FloatRows
    """Its output rows."""
    next_pos: int
    """The session's next position."""
    queue_ns: int
    """Nanoseconds it waited: in the queue (and, co-batched, in its call while other sessions'
    rows ran)."""
    compute_ns: int
    """Nanoseconds of engine time that were its own (co-batched: the call's time times its
    share of the call's rows)."""
    native_ns: int = 0
    """Of ``compute_ns``, the nanoseconds inside llama.cpp (co-batched: its share, likewise)."""
    sampled: tuple[int, ...] | None = None
    """A last stage's tokens of the output's logits rows (``SessionTable``'s ``Ran``)."""


RunBatch = Callable[[Sequence[ForwardFrame]], list[Ran | Exception]]


@attrs.define
class _Waiting:
    frame: ForwardFrame
    deadline: float | None
    enqueued_ns: int
    future: asyncio.Future[FrameResult]


def co_batch_rows(n_batch: int, quant_types: Sequence[str], hardware: str) -> int:
    """Rows one co-batched engine call may carry on a worker of ``hardware`` (its lane's
    hardware class) serving weights of ``quant_types``: the engine's ``n_batch``, or at most
    ``REPACKED_PASS_ROWS`` where the CPU backend repacks one of those types, whose kernels take
    four rows or more in another order than one (``dgr_session.speculation.verify_rows``). A
    frame with more rows than that still runs, alone."""
    if verify_rows(quant_types, hardware) <= REPACKED_PASS_ROWS:
        return min(n_batch, REPACKED_PASS_ROWS)
    return n_batch


@attrs.frozen
class CoBatchConfig:
    """How a worker co-batches."""

    max_rows: int
    """Rows one engine call may carry (:func:`co_batch_rows`: the engine's ``n_batch``, or 3
    where weights are repacked)."""
    wait_seconds: float = 0.0
    """How long a call may wait for more frames to fill it (0: never)."""


class CoBatcher:
    """Runs queued frames of different sessions together on one engine thread.

    ``run_batch`` runs on the engine thread (``SessionTable.forward_batch``); ``sessions_open``
    says how many sessions could still send a frame; ``on_call(frames, rows)`` is told the size
    of every engine call (metrics); ``started``/``stopped`` bracket each call (the load meter);
    ``native_ns`` reads the engine's time inside llama.cpp so far (``SessionTable.native_ns``).
    Used from one event loop only.
    """

    def __init__(
        self,
        config: CoBatchConfig,
        engine_thread: EngineThread,
        run_batch: RunBatch,
        *,
        sessions_open: Callable[[], int],
        on_call: Callable[[int, int], None] = lambda frames, rows: None,
        started: Callable[[], None] = lambda: None,
        stopped: Callable[[], None] = lambda: None,
        native_ns: Callable[[], int] = lambda: 0,
    ) -> None:
        self.config = config
        self._native_ns = native_ns
        self._engine_thread = engine_thread
        self._run_batch = run_batch
        self._sessions_open = sessions_open
        self._on_call = on_call
        self._started = started
        self._stopped = stopped
        self._queue: collections.deque[_Waiting] = collections.deque()
        self._draining: asyncio.Task[None] | None = None
        self._arrived: asyncio.Event | None = None
        self.calls = 0
        """Engine calls made."""
        self.frames = 0
        """Frames run (a call runs one or more)."""

    @property
    def queued(self) -> int:
        """Frames waiting for an engine call."""
        return len(self._queue)

    async def submit(self, frame: ForwardFrame, deadline: float | None) -> FrameResult:
        """Queues ``frame`` and returns its result once a call ran it; raises its refusal
        (``DGR_E_DEADLINE`` when ``deadline`` passed before its call began)."""
        loop = asyncio.get_running_loop()
        waiting = _Waiting(frame, deadline, time.perf_counter_ns(), loop.create_future())
        self._queue.append(waiting)
        if self._arrived is not None:
            self._arrived.set()
        if self._draining is None:
            self._draining = loop.create_task(self._drain(), name="dgr-co-batch")
        return await waiting.future

    async def _drain(self) -> None:
        batch: list[_Waiting] = []
        try:
            while self._queue:
                if self.config.wait_seconds > 0:
                    await self._fill()
                batch = self._take()
                if not batch:
                    continue
                try:
                    results = await self._engine_thread.run(self._run, batch)
                except Exception as exc:  # the engine thread is gone: nobody runs these
                    results = [exc] * len(batch)
                for waiting, result in zip(batch, results, strict=True):
                    _settle(waiting.future, result)
                batch = []
        finally:
            self._draining = None
            for waiting in (*batch, *self._queue):  # only when cancelled (worker stopping)
                _settle(waiting.future, asyncio.CancelledError())
            self._queue.clear()

    async def _fill(self) -> None:
        """Waits (bounded) for more frames while fewer queue than sessions are open."""
        if self._arrived is None:
            self._arrived = asyncio.Event()
        loop = asyncio.get_running_loop()
        until = loop.time() + self.config.wait_seconds
        while len(self._queue) < self._sessions_open():
            left = until - loop.time()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    def _take(self) -> list[_Waiting]:
        """From the head of the queue: the frames of one call (one per session, rows within
        ``max_rows``; the head always). The rest keep their order."""
        batch: list[_Waiting] = []
        kept: collections.deque[_Waiting] = collections.deque()
        sessions: set[str] = set()
        rows = 0
        while self._queue:
            waiting = self._queue.popleft()
            if waiting.future.done():  # its caller gave up
                continue
            n = waiting.frame.n_rows
            fits = not batch or rows + n <= self.config.max_rows
            if fits and waiting.frame.session_id not in sessions:
                batch.append(waiting)
                sessions.add(waiting.frame.session_id)
                rows += n
            else:
                kept.append(waiting)
        self._queue = kept
        return batch

    def _run(self, batch: list[_Waiting]) -> list[FrameResult | Exception]:
        """On the engine thread: one call for the frames whose deadline has not passed."""
        began = time.perf_counter_ns()
        now = time.monotonic()
        results: list[FrameResult | Exception | None] = [None] * len(batch)
        due: list[int] = []
        for index, waiting in enumerate(batch):
            if waiting.deadline is not None and now >= waiting.deadline:
                results[index] = expired_in_queue()
            else:
                due.append(index)
        if due:
            self._started()
            native = self._native_ns()
            try:
                outs = self._run_batch([batch[index].frame for index in due])
            finally:
                self._stopped()
            took = time.perf_counter_ns() - began
            native = self._native_ns() - native
            total_rows = sum(batch[index].frame.n_rows for index in due)
            self.calls += 1
            self.frames += len(due)
            self._on_call(len(due), total_rows)
            for index, out in zip(due, outs, strict=True):
                if isinstance(out, Exception):
                    results[index] = out
                    continue
                # the frame's share of the call, by rows, is its compute (usage, metrics); the
                # rest of the call it spent waiting on other sessions' rows counts as queueing
                share = took * batch[index].frame.n_rows // total_rows
                queued = began - batch[index].enqueued_ns + took - share
                native_share = native * batch[index].frame.n_rows // total_rows
                results[index] = FrameResult(
                    out.rows, out.next_pos, queued, share, native_share, out.sampled
                )
        return [result for result in results if result is not None]


def _settle(future: asyncio.Future[FrameResult], result: FrameResult | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        if isinstance(result, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(result)
    else:
        future.set_result(result)
