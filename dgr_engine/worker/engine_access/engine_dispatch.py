"""Where a worker's engine calls run (``docs/worker.md``): on the one engine thread, in arrival
order; a small frame on the event loop itself while the engine thread is idle and such frames
are short; with co-batching, forward frames of different sessions together in one call
(``worker/engine_access/co_batch.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from dgr_engine.wire.frames import ForwardFrame
from dgr_engine.worker.engine_access.co_batch import CoBatchConfig, CoBatcher, FrameResult
from dgr_engine.worker.engine_access.engine_thread import EngineThread, expired_in_queue
from dgr_engine.worker.lifecycle.sessions import SessionTable
from dgr_engine.worker.reporting.load import LoadMeter

_T = TypeVar("_T")


class EngineDispatch:
    """Runs a worker's engine jobs and forward frames; used from one event loop only.

    ``inline_max_rows`` / ``inline_max_ms``: frames of at most that many rows run on the loop
    while the last such frame took at most that long in the engine (``WorkerConfig``'s
    fields of those names). ``co_batch``: co-batch forward frames so (``None``: one frame per
    call); ``on_call(frames, rows)`` is told the size of each co-batched call (metrics)."""

    def __init__(
        self,
        table: SessionTable,
        meter: LoadMeter,
        *,
        inline_max_rows: int,
        inline_max_ms: float,
        co_batch: CoBatchConfig | None = None,
        on_call: Callable[[int, int], None] = lambda frames, rows: None,
    ) -> None:
        self._table = table
        self._meter = meter
        self.inline_max_rows = inline_max_rows
        self.inline_max_ms = inline_max_ms
        self.engine_thread = EngineThread()
        self.small_frame_ns: float = float("inf")
        """Engine time of the last frame of at most ``inline_max_rows`` rows (none yet: inf)."""
        self.co_batcher: CoBatcher | None = None
        """Co-batches forward frames; ``None``: one per call."""
        if co_batch is not None:
            self.co_batcher = CoBatcher(
                co_batch,
                self.engine_thread,
                table.forward_batch,
                sessions_open=lambda: table.snapshot().sessions_open,
                on_call=on_call,
                started=meter.started,
                stopped=meter.stopped,
                native_ns=lambda: table.native_ns,
            )

    async def run_forward(self, frame: ForwardFrame, deadline: float | None) -> FrameResult:
        """Runs one decoded frame on the engine (thread, or the loop: ``inline_max_rows``);
        returns its output rows, the session's next position, and the ns it queued and
        computed. Raises the engine's refusal, or ``DGR_E_DEADLINE`` when the deadline passed
        while it queued. With co-batching, the frame runs in the next engine call together with
        other sessions' frames: its compute is its share of the call by rows, and the rest of
        the call counts as queueing (``worker/engine_access/co_batch.py``)."""
        if self.co_batcher is not None:
            return await self.co_batcher.submit(frame, deadline)
        small = frame.n_rows <= self.inline_max_rows
        result = await self.run_on_engine(
            self._forward_job,
            frame,
            deadline,
            time.perf_counter_ns(),
            inline_ok=small and self.small_frame_ns <= self.inline_max_ms * 1e6,
        )
        if small:
            self.small_frame_ns = result.compute_ns
        return result

    def _forward_job(
        self, frame: ForwardFrame, deadline: float | None, enqueued_ns: int
    ) -> FrameResult:
        """On the engine thread: run the frame unless its deadline has passed."""
        started = time.perf_counter_ns()
        if deadline is not None and time.monotonic() >= deadline:
            raise expired_in_queue()
        self._meter.started()
        native = self._table.native_ns
        try:
            ran = self._table.forward(frame)
        finally:
            self._meter.stopped()
        return FrameResult(
            ran.rows,
            ran.next_pos,
            started - enqueued_ns,
            time.perf_counter_ns() - started,
            self._table.native_ns - native,
            ran.sampled,
        )

    async def run_on_engine(
        self, job: Callable[..., _T], *args: Any, inline_ok: bool = False
    ) -> _T:
        """Runs ``job(*args)`` on the engine thread (queued behind earlier calls); with
        ``inline_ok``, on the calling loop instead when the engine thread is idle (nothing can
        be queued ahead of it then, and nothing can be queued while it runs: the loop is the
        only submitter)."""
        if inline_ok and self.engine_thread.idle:
            return job(*args)
        return await self.engine_thread.run(job, *args)

    def shutdown(self) -> None:
        """Lets queued jobs finish, then ends the engine thread (idempotent)."""
        self.engine_thread.shutdown()
