"""The workers' busy hints reach ``Retry-After``: :class:`BusyHints` keeps the hint a real
worker (in-process, over gRPC on loopback) answers an open with when it has no free slot."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.routes import describe
from dgr_engine.serve.hints import BusyHints
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_engine.worker.admission import RETRY_HINT_PER_WAITER
from dgr_session.errors import StageBusy
from tests.harness import run


def test_a_busy_workers_hint_is_kept_per_session_until_forgotten(converted_model: Path) -> None:
    config = WorkerConfig(port=0, admission_wait_seconds=0.2)
    worker = ShardWorker.load(
        converted_model,
        (0, 3),
        max_sessions=1,
        n_ctx_per_session=64,
        n_threads=1,
        n_batch=32,
        n_ubatch=32,
        config=config,
    )

    async def scenario() -> tuple[float | None, float | None, float | None]:
        address = await worker.start()
        try:
            stage = (await describe(address)).stage_spec(address)
            async with GrpcStageTransport(timeout=10.0) as inner:
                hints = BusyHints(inner)
                await hints.open(stage, "first", 1)  # takes the only slot
                with pytest.raises(StageBusy) as busy:
                    await hints.open(stage, "second", 1)
                kept = hints.retry_after("second")
                hints.forget("second")
                await hints.close(stage, "first", 1)
                return busy.value.retry_after, kept, hints.retry_after("second")
        finally:
            await worker.stop()

    answered, kept, forgotten = run(scenario())
    assert answered == RETRY_HINT_PER_WAITER  # alone in line: one waiter's hint
    assert kept == answered and forgotten is None
