"""The co-batcher's choices (``dgr_engine.worker.engine_access.co_batch``), on a recording
stand-in for ``SessionTable.forward_batch`` (the engine itself is tested in
``test_engine_co_batch.py`` and end to end in ``test_e2e_co_batch.py``): which frames share a
call, in which order, what a frame that queued past its deadline gets, and how a call's time is
split between its frames."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from dgr_engine.errors import ShardDeadlineExceeded, UnknownSession
from dgr_engine.wire.frames import ForwardFrame
from dgr_engine.worker.engine_access.co_batch import CoBatchConfig, CoBatcher, co_batch_rows
from dgr_engine.worker.engine_access.engine_thread import EngineThread
from dgr_engine.worker.lifecycle.sessions import Ran


def frame(session: str, rows: int, step: int = 0) -> ForwardFrame:
    positions = np.arange(rows, dtype=np.int32)
    return ForwardFrame(
        session_id=session,
        epoch=1,
        step=step,
        positions=positions,
        tokens=np.ones(rows, dtype=np.int32),
        rows=None,
        want=None,
    )


class Recorder:
    """Records each call's frames; the first call blocks until released, so that the frames
    submitted meanwhile queue up; a session named ``gone`` is refused."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.native_ns = 0
        """What the fake engine says it spent inside llama.cpp: 1000 ns a row."""
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, frames: Sequence[ForwardFrame]) -> list[object]:
        if not self.calls:
            self.started.set()
            self.release.wait(10.0)
        self.calls.append([f"{f.session_id}:{f.step}" for f in frames])
        self.native_ns += 1000 * sum(f.n_rows for f in frames)
        out: list[object] = []
        for f in frames:
            if f.session_id == "gone":
                out.append(UnknownSession("DGR_E_UNKNOWN_SESSION: gone"))
            else:
                out.append(Ran(np.zeros((f.n_rows, 2), dtype=np.float32), int(f.positions[-1]) + 1))
        return out


async def run_all(
    recorder: Recorder, frames: list[tuple[ForwardFrame, float | None]], max_rows: int = 8
) -> list[object]:
    """Submits the first frame and waits until its call runs (and blocks), submits the rest so
    that they queue behind it, then releases the call; every frame's result or error."""
    thread = EngineThread()
    batcher = CoBatcher(
        CoBatchConfig(max_rows),
        thread,
        recorder,
        sessions_open=lambda: 4,
        native_ns=lambda: recorder.native_ns,
    )
    try:
        first = asyncio.ensure_future(batcher.submit(*frames[0]))
        assert await asyncio.to_thread(recorder.started.wait, 10.0)
        rest = [asyncio.ensure_future(batcher.submit(f, d)) for f, d in frames[1:]]
        await asyncio.sleep(0)  # each submit runs up to its await: queued, in order
        assert batcher.queued == len(rest)
        recorder.release.set()
        return list(await asyncio.gather(first, *rest, return_exceptions=True))
    finally:
        thread.shutdown(5.0)


def test_frames_that_queue_together_share_a_call_one_per_session_first_come_first() -> None:
    recorder = Recorder()
    frames = [
        (frame("a", 1), None),
        (frame("b", 1), None),
        (frame("c", 3), None),
        (frame("b", 1, step=1), None),  # b again: waits for the next call
        (frame("d", 5), None),  # would pass max_rows 8 beside b and c: the next call
        (frame("e", 2), None),
    ]
    results = asyncio.run(asyncio.wait_for(run_all(recorder, frames), 30.0))
    assert recorder.calls == [["a:0"], ["b:0", "c:0", "e:0"], ["b:1", "d:0"]]
    assert all(isinstance(r, tuple) for r in results)


X86 = "x86_64 | AMD EPYC | avx avx2 f16c fma"


def test_a_lane_with_repacked_weights_co_batches_three_rows_a_call() -> None:
    # Gemma 3 270M's Q4_K_M: the CPU backend repacks Q4_K and multiplies four rows at a time
    assert co_batch_rows(64, ("F32", "Q4_K", "Q6_K"), X86) == 3
    assert co_batch_rows(2, ("Q4_K",), X86) == 2  # never above the engine's own batch
    assert co_batch_rows(64, ("F32", "Q4_1", "Q8_0"), X86) == 64  # SmolLM2's: no repacking
    assert co_batch_rows(64, ("Q8_0",), "aarch64 | neon") == 3  # ARM repacks Q8_0 too
    recorder = Recorder()
    frames = [(frame(s, 1), None) for s in "abcde"] + [(frame("f", 2), None)]
    results = asyncio.run(asyncio.wait_for(run_all(recorder, frames, max_rows=3), 30.0))
    assert recorder.calls == [["a:0"], ["b:0", "c:0", "d:0"], ["e:0", "f:0"]]
    assert all(isinstance(r, tuple) for r in results)


def test_a_frame_past_its_deadline_is_refused_and_a_refused_session_hurts_nobody() -> None:
    recorder = Recorder()
    frames = [
        (frame("a", 1), None),
        (frame("late", 1), time.monotonic() - 1.0),
        (frame("gone", 1), None),
        (frame("b", 2), None),
    ]
    results = asyncio.run(asyncio.wait_for(run_all(recorder, frames), 30.0))
    assert isinstance(results[1], ShardDeadlineExceeded)
    assert isinstance(results[2], UnknownSession)
    assert isinstance(results[3], tuple) and results[3][1] == 2
    assert recorder.calls == [["a:0"], ["gone:0", "b:0"]]  # the late frame never ran


def test_a_calls_time_is_split_by_rows_and_the_rest_counts_as_waiting() -> None:
    recorder = Recorder()
    frames = [(frame("a", 1), None), (frame("b", 1), None), (frame("c", 3), None)]
    results = asyncio.run(asyncio.wait_for(run_all(recorder, frames), 30.0))
    b, c = results[1], results[2]
    assert isinstance(b, tuple) and isinstance(c, tuple)
    assert recorder.calls == [["a:0"], ["b:0", "c:0"]]
    # b and c shared one call of 4 rows: c's own share is three times b's (to the ns), and
    # what each spent waiting plus its own share is the same span for both
    assert abs(c[3] - 3 * b[3]) <= 3
    # and so is the call's time inside llama.cpp: 4000 ns for 4 rows
    assert (b[4], c[4]) == (1000, 3000)
    assert c[2] + c[3] == pytest.approx(b[2] + b[3], rel=0.05, abs=2e5)
