"""A hand-started worker on SmolLM2 with default options is routed on the committed
real-hardware record; one started with another context is refused, and the client's error names
the stage, the one lane part that differs and the command that would certify it. Real ``dgr
worker`` processes, the client's own route provider and transport, over 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.routes import EndpointRouteProvider
from dgr_engine.models import resolve_model
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

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "evidence"
SMOLLM2 = "smollm2-135m-instruct"
PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_model(SMOLLM2)  # fetched and verified once, as a user would


def one_session(endpoint: str) -> SessionResult:
    async def main() -> SessionResult:
        provider = EndpointRouteProvider([endpoint])
        async with GrpcStageTransport(timeout=30.0) as transport:
            manager = SessionManager(transport, provider, policy=FailurePolicy(step_deadline=30))
            result = await manager.start(PROMPT, max_new_tokens=3).wait()
            await manager.aclose()
            return result

    return asyncio.run(asyncio.wait_for(main(), 120))


def test_a_default_worker_routes_and_one_with_another_context_is_refused_saying_why(
    smollm2: Path,
) -> None:
    evidence = ["--evidence", str(COMMITTED)]
    with WorkerProcess.spawn(smollm2, (0, 30), options=EngineOptions(), extra_args=evidence) as ok:
        result = one_session(ok.address)
    assert result.state is SessionState.DONE, result.error  # real-hardware, the default need
    assert len(result.tokens) == 3

    wide = EngineOptions(n_ctx_per_session=512)
    with WorkerProcess.spawn(smollm2, (0, 30), options=wide, extra_args=evidence) as dark:
        result = one_session(dark.address)
        endpoint = dark.address
    error = result.error
    assert isinstance(error, RouteRefused), error
    refusal = error.refusal
    assert isinstance(refusal, DarkLane)
    assert (refusal.stage_index, refusal.endpoint, refusal.layers) == (0, endpoint, (0, 30))
    assert refusal.nearest is not None
    assert refusal.nearest.differences == (LaneDifference("context_per_session", "512", "256"),)
    command = f"dgr certify --model {smollm2} --ctx 512 --evidence {COMMITTED}"
    assert refusal.certify_command == command
    message = str(error)
    assert f"stage 0 ({endpoint}) layers [0,30)" in message
    assert "context_per_session 512 (nearest record: 256)" in message
    assert command in message and "not retried" in message
    assert len(result.reports) == 2  # asked once more, refused the same way: not a third time
