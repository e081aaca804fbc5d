"""What observability costs per frame on a worker and per call on a client: the metrics
(counters and histograms), the usage record, the session-bound debug log line (at the default
INFO level: not written), and the session metadata a client attaches to a call. Timed
in-process over many frames, beside one measured seam hop (a forward of one row through a
1-layer range of the tiny fixture on a real worker, client round trip included).

    python -m benchmarks.observability [--frames 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np
from loguru import logger

from dgr_engine.cli._logs import log_to_stderr
from dgr_engine.client.shard_client import ShardClient, expectations_of, session_metadata
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_engine.worker.reporting.metrics import WorkerMetrics
from dgr_engine.worker.reporting.usage import UsageBook


def per_call_us(fn: Any, n: int) -> float:
    began = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - began) / n * 1e6


async def hop_us(n: int = 200) -> float:
    """Median round trip of a one-row forward to a real worker (1 layer of the tiny fixture)."""
    worker = ShardWorker.load(
        ensure_fixture("tiny-llama"),
        (0, 1),
        config=WorkerConfig(),
        max_sessions=1,
        n_ctx_per_session=512,
        n_threads=1,
        n_batch=8,
    )
    address = await worker.start()
    try:
        async with ShardClient(address, timeout=20.0) as client:
            expect = expectations_of(await client.describe())
            await client.open("hop", 1, expect)
            times = []
            for step in range(min(n, 500)):
                began = time.perf_counter()
                await client.forward("hop", 1, step, expect, [step], tokens=[step % 200])
                times.append(time.perf_counter() - began)
            await client.close("hop", 1)
    finally:
        await worker.stop()
    return float(np.median(times[10:])) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=20_000)
    args = parser.parse_args(argv)
    n = args.frames
    metrics = WorkerMetrics(sessions_open=lambda: 0, slots=lambda: 4, waiting=lambda: 0)
    usage = UsageBook((0, 1))
    log_to_stderr("INFO")  # the programs' default: debug lines are not written
    log = logger.bind(stage="0:1")
    request = pb.ForwardRequest(session_id="s", epoch=1, step=3)
    rows = {
        "metrics (counters + 2 histograms)": per_call_us(
            lambda i: metrics.forwarded("decode", 1, 0.001, 0.002, 120, 4200), n
        ),
        "usage record": per_call_us(
            lambda i: usage.forwarded(f"s{i % 64}", 1, "decode", 1, 120, 4200, 0.001), n
        ),
        "session-bound debug log (INFO level)": per_call_us(
            lambda i: log.bind(session="s", epoch=1, step=i).debug("forward {} rows", 1), n
        ),
        "client: session metadata": per_call_us(lambda i: session_metadata(request), n),
    }
    logger.remove()
    hop = asyncio.run(hop_us())
    total = sum(rows.values())
    print(f"per frame, over {n} frames (in-process, this machine):")
    for name, us in rows.items():
        print(f"  {name:<40} {us:8.2f} us")
    print(f"  {'all of them':<40} {total:8.2f} us")
    print(
        f"one seam hop (a 1-row forward on a real worker, round trip): {hop:.0f} us; "
        f"observability adds {total / hop:.1%} of it per stage and token"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
