"""Per-hop seam overhead of a shard worker over loopback gRPC, in microseconds.

One hop = the client sends a frame (one decode row) to a worker and gets its output back. The
overhead is the client's round trip minus the engine time the worker reports (``compute_us``):
encode, gRPC, loopback, the worker's checks, the hop to the engine thread and back, decode.

Cases (each measured over unary ``Forward`` and over ``ForwardStream``):

* ``dense-64``: a real ``dgr worker`` on the tiny-llama fixture, middle layers [1, 3): a 64-wide
  f32 boundary in and out.
* ``echo-64`` and ``echo-4x4096``: the same worker code (``ShardWorker``) over an engine that
  returns its input rows (no compute), so the 4 x 4096 f32 boundary of DeepSeek V4 (64 KiB per
  row, in and out) is measured without a model that wide. ``echo-64`` checks that the echo
  stand-in measures the same overhead as the real worker.

Workers are separate processes (as across a WAN seam), each on 127.0.0.1. Run::

    python -m benchmarks.seam_overhead [--frames 500] [--threads 1]

Fixture evidence on this machine's CPUs; the absolute numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.engine import ForwardItem
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.tooling.processes import WorkerProcess
from dgr_engine.wire.frames import check_finite_rows

ROOT = Path(__file__).resolve().parent.parent

V4_BOUNDARY = 4 * 4096


# --- the echo worker (a child process of this script) -------------------------------------------


def serve_echo(width: int) -> None:
    """Hosts ``ShardWorker`` over an engine that echoes its rows; prints LISTENING."""
    from dgr_engine.engine import ShardInfo
    from dgr_engine.numerics import Numerics
    from dgr_engine.worker import ShardWorker
    from dgr_engine.worker.reporting.identity import BuildIdentity

    info = ShardInfo(
        arch="echo",
        n_layer=3,
        layer_begin=1,
        layer_end=2,
        n_embd=width,
        n_vocab=256,
        in_width=width,
        out_width=width,
        is_first=False,
        is_last=False,
        needs_token_ids=False,
        mtp_owner=False,
        max_sessions=4,
        n_ctx_per_session=1 << 20,
        n_batch=512,
    )

    class EchoEngine:
        def __init__(self) -> None:
            self.info = info
            self.numerics = Numerics()

        def open_session(self, session_id: int, epoch: int) -> None:
            pass

        def close_session(self, session_id: int, epoch: int) -> None:
            pass

        def forward(
            self,
            session_id: int,
            epoch: int,
            positions: np.ndarray,
            *,
            tokens: np.ndarray | None = None,
            rows: np.ndarray | None = None,
            want: np.ndarray | None = None,
        ) -> np.ndarray:
            return np.array(rows, dtype=np.float32)  # a copy, as the engine writes a new buffer

        def forward_batch(self, items: Sequence[ForwardItem]) -> list[Any]:
            return [np.array(item.rows, dtype=np.float32) for item in items]

        def truncate(self, session_id: int, epoch: int, n_keep: int) -> None:
            raise AssertionError("the echo engine is never asked to drop drafts")

        def save_state(self, session_id: int, epoch: int) -> bytes:
            raise AssertionError("the echo engine is never asked to keep a prefix")

        def load_state(self, session_id: int, epoch: int, state: bytes) -> None:
            raise AssertionError("the echo engine is never asked to keep a prefix")

        def close(self) -> None:
            pass

    build = BuildIdentity(
        model_sha256=bytes(32),
        quant_types=("F32",),
        llama_cpp_commit="echo",
        patch_stack_sha256=b"",
        dgr_version="bench",
        hardware="echo",
    )

    async def main() -> None:
        worker = ShardWorker(EchoEngine(), build)
        print(f"LISTENING {await worker.start()}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await worker.stop()

    asyncio.run(main())


class EchoProcess(WorkerProcess):
    @classmethod
    def spawn_echo(cls, width: int) -> WorkerProcess:
        args = [sys.executable, "-m", "benchmarks.seam_overhead", "--serve-echo", str(width)]
        return cls.launch(args, 60.0, cwd=ROOT)


# --- measurement -------------------------------------------------------------------------------


@attrs.frozen
class Hop:
    """One measured hop, µs: ``overhead`` (rtt - engine) = ``client`` + ``transit`` + ``worker``."""

    overhead: int
    client: int
    """The client's own code (rtt - time inside gRPC)."""
    transit: int
    """Inside gRPC both ways, minus the worker's handler time."""
    worker: int
    """The worker's handler minus its engine time."""


async def measure(address: str, width: int, frames: int, streaming: bool) -> list[Hop]:
    """The hops of ``frames`` one-row forwards after a warm-up."""
    async with ShardClient(address, streaming=streaming) as client:
        expect = expectations_of(await client.describe())
        rows = np.random.default_rng(0).standard_normal((1, width)).astype(np.float32)
        hops: list[Hop] = []
        epoch = 0
        await client.open("bench", epoch, expect)
        pos = 0
        for i in range(frames + 50):
            if pos >= 480:  # stay inside the context: a new epoch starts at position 0
                epoch += 1
                await client.open("bench", epoch, expect)
                pos = 0
            result = await client.forward("bench", epoch, i, expect, [pos], boundary=rows)
            pos += 1
            if i >= 50:
                t = result.timings
                hops.append(
                    Hop(
                        overhead=result.rtt_us - t.compute_us,
                        client=result.rtt_us - result.wire_us,
                        transit=result.wire_us - t.total_us,
                        worker=t.total_us - t.compute_us,
                    )
                )
        await client.close("bench", epoch)
    return hops


PARTS = ("client", "transit", "worker")
"""The parts of a hop's overhead, in the order printed."""


def part_medians(hops: list[Hop]) -> dict[str, float]:
    """The median of each of :data:`PARTS` over ``hops`` (µs)."""
    return {k: float(statistics.median(getattr(h, k) for h in hops)) for k in PARTS}


def summary(values: list[int]) -> tuple[float, float, float]:
    ordered = sorted(values)
    n = len(ordered)
    return statistics.median(ordered), ordered[n // 10], ordered[(9 * n) // 10]


def finite_check_us(width: int, rows: int, repeats: int = 2000) -> float:
    """Median µs of the worker's finite-values check (``check_finite_rows``) on one frame."""
    frame = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32)
    times = []
    for _ in range(repeats):
        began = time.perf_counter_ns()
        check_finite_rows(frame, "boundary")
        times.append(time.perf_counter_ns() - began)
    return float(np.median(times)) / 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1, help="engine threads (dense case)")
    parser.add_argument("--serve-echo", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_echo is not None:
        serve_echo(args.serve_echo)
        return 0

    tiny = ensure_fixture("tiny-llama")
    cases: list[tuple[str, int, WorkerProcess]] = []
    try:
        cases.append(
            (
                "dense-64 (tiny-llama [1,3))",
                64,
                WorkerProcess.spawn(
                    tiny,
                    (1, 3),
                    extra_args=["--threads", str(args.threads), "--log-level", "ERROR"],
                ),
            )
        )
        cases.append(("echo-64", 64, EchoProcess.spawn_echo(64)))
        cases.append(("echo-4x4096", V4_BOUNDARY, EchoProcess.spawn_echo(V4_BOUNDARY)))
        print("finite-values check per hop, µs (median; the same process, before the engine)")
        for width in (64, V4_BOUNDARY):
            for rows in (1, 64):
                print(f"  width {width:>5} x {rows:>2} rows: {finite_check_us(width, rows):8.2f}")
        print(f"per-hop seam overhead, µs (rtt - worker compute), {args.frames} one-row frames")
        print(
            f"{'case':<30} {'mode':<7} {'median':>8} {'p10':>8} {'p90':>8}   medians: "
            f"{'client':>6} {'transit':>7} {'worker':>6}"
        )
        for name, width, worker in cases:
            for streaming in (False, True):
                began = time.monotonic()
                hops = asyncio.run(measure(worker.address, width, args.frames, streaming))
                med, p10, p90 = summary([h.overhead for h in hops])
                mode = "stream" if streaming else "unary"
                parts = part_medians(hops)
                print(
                    f"{name:<30} {mode:<7} {med:8.0f} {p10:8.0f} {p90:8.0f}   {'':8}"
                    f"{parts['client']:>6.0f} {parts['transit']:>7.0f} {parts['worker']:>6.0f}"
                    f"   ({time.monotonic() - began:.1f} s)"
                )
    finally:
        for _, _, worker in cases:
            worker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
