"""End to end on the DeepSeek V4 lane: a route of tiny-v4 workers over gRPC loses a stage.

tiny-v4 has 6 layers, hash-routed layers 0-2, hc 4 (a 4 x n_embd f32 boundary). The route is
cut inside the hash-routed layers (at 1) and right after them (at 3): stage [1, 3) routes its
experts by token id, so its frames carry the token-id sideband; stage [3, 6) needs none. The
prompt and decode cross the sliding window (32). Real ``dgr worker`` processes on 127.0.0.1;
every wait bounded; every process stopped in teardown.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from dgr_engine.client.relay import GrpcStageTransport, StageStats
from dgr_engine.fixtures import FIXTURES, ensure_fixture
from dgr_engine.fixtures.deepseek4 import Deepseek4Spec
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_reference
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    SessionHandle,
    SessionManager,
    SessionResult,
    SessionState,
)
from tests.harness import run
from tests.recorder import LogitsRecorder

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("certified_fixtures")]

T = TypeVar("T")
_SPEC = FIXTURES["tiny-v4"]
assert isinstance(_SPEC, Deepseek4Spec)
SPEC: Deepseek4Spec = _SPEC
LAYOUT = ((0, 1), (1, 3), (3, 6))
N_TOKENS = 16
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
PROMPTS = [[int(t) for t in np.random.default_rng(40 + s).integers(0, 256, 24)] for s in range(2)]
BOUNDARY_BYTES = 4 * SPEC.n_embd * 4  # hc 4 streams of n_embd f32 per token


@pytest.fixture(scope="module")
def tiny_v4() -> Path:
    return ensure_fixture("tiny-v4")


def test_v4_route_over_grpc_survives_a_killed_hash_layer_stage(tiny_v4: Path) -> None:
    assert SPEC.hash_layer_count == 3 and SPEC.hc_mult == 4
    expected = whole_model_reference(tiny_v4, PROMPTS, N_TOKENS, OPTIONS)

    recorders = [LogitsRecorder(len(p)) for p in PROMPTS]

    provider = LoopbackRouteProvider(tiny_v4, LAYOUT, spares=[(1, 3)], options=OPTIONS)
    killed: list[str] = []
    handles: list[SessionHandle] = []

    def on_token(token: int) -> None:
        if not killed and len(handles[0].tokens) == 7:
            route = handles[0].core.route
            assert route is not None
            killed.append(provider.kill(route.stages[1].endpoint).endpoint)

    async def scenario() -> tuple[list[SessionResult], dict[str, StageStats]]:
        await provider.start()
        try:
            async with GrpcStageTransport(timeout=10.0) as transport:
                manager = SessionManager(
                    transport,
                    provider,
                    policy=FailurePolicy(replay="exact"),  # bit for bit after recovery
                    required_evidence=EvidenceClass.FIXTURE,
                )
                for i, prompt in enumerate(PROMPTS):
                    handles.append(
                        manager.start(
                            prompt,
                            max_new_tokens=N_TOKENS,
                            session_id=f"v4-{i}",
                            on_token=on_token if i == 0 else None,
                            sampler=recorders[i],
                        )
                    )
                results = [await h.wait() for h in handles]
                await manager.aclose()
                return results, transport.stats()
        finally:
            await provider.aclose()

    results, stats = run(scenario())
    spare = next(w for w in provider.workers if w.role == "spare")
    for result, handle, logits, (tokens, want) in zip(
        results, handles, [r.logits for r in recorders], expected, strict=True
    ):
        assert result.state is SessionState.DONE, result.error
        assert list(result.tokens) == tokens
        assert sorted(logits) == list(range(N_TOKENS))
        for step, row in enumerate(want):  # bit for bit, across the route change
            assert np.array_equal(logits[step], row), f"logits differ at step {step}"
        assert (result.epoch, result.route_changes) == (2, 1)
        (report,) = result.reports
        assert (report.fault, report.endpoint) == (FaultKind.DEAD, killed[0])
        assert handle.core.route is not None and handle.core.route.endpoints[1] == spare.endpoint

    # the seam as the advert states it: 4 x n_embd f32 per token, + 4 bytes position, + 4 bytes
    # token id where the receiving stage owns hash-routed layers (and on the first and last)
    by_range = {w.layers: w.advert for w in provider.workers if w.role == "primary"}
    first, hashed, plain = (by_range[r] for r in LAYOUT)
    assert (first.span.needs_token_ids, hashed.span.needs_token_ids) == (True, True)
    assert plain.span.needs_token_ids is False
    assert first.seam.width_out == hashed.seam.width_in == 4 * SPEC.n_embd
    assert first.seam.bytes_per_token_in == 4 + 4
    for advert in (first, hashed):
        assert advert.seam.bytes_per_token_out == BOUNDARY_BYTES
    assert hashed.seam.bytes_per_token_in == BOUNDARY_BYTES + 4 + 4
    assert plain.seam.bytes_per_token_in == BOUNDARY_BYTES + 4 + 4  # its sampler's history
    assert plain.seam.bytes_per_token_out == 4 * SPEC.n_vocab

    # and what the transport actually sent matches it, row for row
    for endpoint, s in stats.items():
        advert = provider.worker(endpoint).advert
        assert s.bytes_sent == s.rows * advert.seam.bytes_per_token_in, endpoint
    assert stats[spare.endpoint].rows > 0
