"""The workers' busy hints reach ``Retry-After``: a session whose admission budget runs out
against a real worker (in-process, over gRPC on loopback) with no free slot ends with an
:class:`~dgr_session.errors.AdmissionTimeout` carrying that worker's hint, and the server's
answer to it is a 503 whose ``Retry-After`` is that hint rounded up."""

from __future__ import annotations

import math
from pathlib import Path

import attrs

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.routes import describe
from dgr_engine.serve.errors import RouteOverloaded, error_for_failure
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_engine.worker.lifecycle.admission import RETRY_HINT_PER_WAITER
from dgr_session import EvidenceClass, FailurePolicy, SessionManager
from dgr_session.errors import AdmissionTimeout
from dgr_session.route import Route
from dgr_session.testing import FixedRouteProvider, fixture_lane
from tests.harness import run


def test_an_admission_timeout_carries_the_busy_workers_hint(converted_model: Path) -> None:
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

    async def scenario() -> BaseException | None:
        address = await worker.start()
        try:
            stage = (await describe(address)).stage_spec(address)
            async with GrpcStageTransport(timeout=10.0) as transport:
                await transport.open(stage, "holder", 1)  # takes the only slot
                # the worker's word for a fixture lane (the route's lane is not what is tested)
                route = Route(stages=(attrs.evolve(stage, lane=fixture_lane()),))
                manager = SessionManager(
                    transport,
                    FixedRouteProvider(route),
                    policy=FailurePolicy(admission_budget=0.3, busy_retry=0.05),
                    required_evidence=EvidenceClass.FIXTURE,
                )
                result = await manager.start([1, 2, 3], max_new_tokens=1).wait()
                await manager.aclose()
                await transport.close(stage, "holder", 1)
                return result.error
        finally:
            await worker.stop()

    error = run(scenario())
    assert isinstance(error, AdmissionTimeout), error
    assert error.retry_after == RETRY_HINT_PER_WAITER  # alone in line: one waiter's hint
    answer = error_for_failure(error, retry_after=error.retry_after)
    assert isinstance(answer, RouteOverloaded)
    assert answer.headers()["Retry-After"] == str(max(1, math.ceil(RETRY_HINT_PER_WAITER)))
