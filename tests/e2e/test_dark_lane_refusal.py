"""A hand-started worker on SmolLM2 with default options is routed on its certified lane; one
started with another context is refused, and the client's error names the stage, the one lane
part that differs and the command that would certify it. Real ``dgr worker`` processes, the
client's own route provider and transport, over 127.0.0.1. The lane is the one certified in
this run under the run's operator lock (a committed record certifies only machines of its
hardware class: ``tests/worker/test_default_lane.py`` checks the committed one)."""

from __future__ import annotations

import asyncio

from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.verify import LockVerifier
from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.routes import EndpointRouteProvider
from dgr_engine.options import EngineOptions
from dgr_engine.tooling.processes import WorkerProcess
from dgr_session import (
    DarkLane,
    FailurePolicy,
    LaneDifference,
    RouteRefused,
    SessionManager,
    SessionResult,
    SessionState,
)
from tests.harness import RealLane

PROMPT = [1, 2, 3, 4]


def one_session(endpoint: str, lane: RealLane) -> SessionResult:
    async def main() -> SessionResult:
        verifier = LockVerifier(load_lock(lane.lock))  # the client's lock: the operator's
        provider = EndpointRouteProvider([endpoint], certification_verifier=verifier)
        async with GrpcStageTransport(timeout=30.0) as transport:
            manager = SessionManager(transport, provider, policy=FailurePolicy(step_deadline=30))
            result = await manager.start(PROMPT, max_new_tokens=3).wait()
            await manager.aclose()
            return result

    return asyncio.run(asyncio.wait_for(main(), 120))


def test_a_default_worker_routes_and_one_with_another_context_is_refused_saying_why(
    smollm2_lane: RealLane,
) -> None:
    smollm2 = smollm2_lane.model
    trust = ["--evidence", str(smollm2_lane.evidence), "--lock", str(smollm2_lane.lock)]
    with WorkerProcess.spawn(smollm2, (0, 30), options=EngineOptions(), extra_args=trust) as ok:
        result = one_session(ok.address, smollm2_lane)
    assert result.state is SessionState.DONE, result.error  # real-hardware, the default need
    assert len(result.tokens) == 3

    wide = EngineOptions(n_ctx_per_session=512)
    with WorkerProcess.spawn(smollm2, (0, 30), options=wide, extra_args=trust) as dark:
        result = one_session(dark.address, smollm2_lane)
        endpoint = dark.address
    error = result.error
    assert isinstance(error, RouteRefused), error
    refusal = error.refusal
    assert isinstance(refusal, DarkLane)
    assert (refusal.stage_index, refusal.endpoint, refusal.layers) == (0, endpoint, (0, 30))
    assert refusal.nearest is not None
    assert refusal.nearest.differences == (LaneDifference("context_per_session", "512", "256"),)
    command = (
        f"dgr certify --model {smollm2} --ctx 512 --evidence {smollm2_lane.evidence} "
        f"--lock {smollm2_lane.lock}"
    )
    assert refusal.certify_command == command
    message = str(error)
    assert f"stage 0 ({endpoint}) layers [0,30)" in message
    assert "context_per_session 512 (nearest record: 256)" in message
    assert command in message and "not retried" in message
    assert len(result.reports) == 2  # asked once more, refused the same way: not a third time
