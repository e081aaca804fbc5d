"""End to end: seeded sampling over real ``dgr worker`` processes on 127.0.0.1
(``docs/sampling.md``), on the tiny fixture and on SmolLM2. For a given seed the tokens are
those dgr's sampler takes of the whole model's logits, on the relay, a chain, a ring over gRPC
and frame links, a native ring and a sealed native ring over mutual TLS, and through a middle
stage SIGKILLed mid-answer (the epoch ends blaming that stage; the re-prefill on a new route
replays the accepted tokens and every later position draws what it would have drawn). Every
wait is bounded; the provider stops every process it started."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.verify import LockVerifier
from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.engine.sampling import SeededSampler
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_sampled
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.throwaway_ca import local_pki
from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    SessionHandle,
    SessionManager,
    SessionResult,
    SessionState,
)
from dgr_session.sampling import Sampling
from tests import harness
from tests.harness import RealLane

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("certified_fixtures")]

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
LAYOUT = ((0, 1), (1, 2), (2, 3), (3, 4))
N_TOKENS = 120  # a native ring runs ahead of the client: long enough to be killed mid-answer
SAMPLINGS = (
    Sampling(seed=1234, temperature=0.8, top_p=0.9),
    Sampling(seed=99, temperature=1.1, top_k=40, min_p=0.02, presence_penalty=0.4),
)
WAYS = {  # how the session reaches the route: (ring, data path), None for the relay
    "relay": None,
    "chain": (False, "frame"),
    "ring-grpc": (True, "grpc"),
    "ring-frame": (True, "frame"),
    "native-ring": (True, "native"),
    "sealed-native-ring": (True, "native"),
}


def prompts(n_vocab: int = 256) -> list[list[int]]:
    return [[int(t) for t in np.random.default_rng(s).integers(0, n_vocab, 16)] for s in (7, 8)]


def sampled(
    path: Path,
    prompt_list: Sequence[Sequence[int]],
    sampling: Sampling,
    options: EngineOptions = OPTIONS,
    n_tokens: int = N_TOKENS,
) -> list[list[int]]:
    """What dgr's sampler takes of the whole model's logits for each prompt's session."""
    samplers = [SeededSampler(_seeded(sampling, i)) for i in range(len(prompt_list))]
    return whole_model_sampled(path, prompt_list, n_tokens, options, samplers)


async def drive(
    provider: LoopbackRouteProvider,
    way: str,
    sampling: Sampling,
    tls: Any,
    session_prompts: Sequence[Sequence[int]],
    n_tokens: int = N_TOKENS,
) -> tuple[list[SessionResult], list[str], int]:
    """A session a prompt with ``sampling`` (each its own seed) over ``way``; the middle stage
    of the first one's route is killed at its fifth token."""
    handles: list[SessionHandle] = []
    killed: list[str] = []

    def on_token(_token: int) -> None:
        if not killed and len(handles[0].tokens) == 5:
            route = handles[0].core.route
            assert route is not None
            killed.append(provider.kill(route.stages[1].endpoint).endpoint)

    shape = WAYS[way]
    transport: GrpcStageTransport
    if shape is None:
        transport = GrpcStageTransport(timeout=10.0, close_timeout=2.0, tls=tls)
    else:
        ring, data_path = shape
        transport = ChainStageTransport(
            timeout=10.0, close_timeout=2.0, ring=ring, data_path=data_path, tls=tls
        )
    await provider.start()
    try:
        async with transport:
            manager = SessionManager(
                transport,
                provider,
                policy=FailurePolicy(step_deadline=10.0, backoff=(0.0,)),
                required_evidence=EvidenceClass.FIXTURE,
            )
            for i, prompt in enumerate(session_prompts):
                handles.append(
                    manager.start(
                        prompt,
                        max_new_tokens=n_tokens,
                        session_id=f"sampled-{i}",
                        sampler=SeededSampler(_seeded(sampling, i)),
                        on_token=on_token if i == 0 else None,
                    )
                )
            results = [await h.wait() for h in handles]
            await manager.aclose()
    finally:
        await provider.aclose()
    native = transport.chain_stats.native_epochs if shape is not None else 0
    return results, killed, native


def _seeded(sampling: Sampling, index: int) -> Sampling:
    return Sampling(
        sampling.seed + index,
        sampling.temperature,
        sampling.top_k,
        sampling.top_p,
        sampling.min_p,
        sampling.presence_penalty,
        sampling.frequency_penalty,
        sampling.repetition_penalty,
        sampling.penalty_last_n,
    )


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["top-p", "top-k-min-p-presence"])
@pytest.mark.parametrize("way", list(WAYS))
def test_seeded_tokens_are_the_same_on_every_route_and_path_through_a_stage_lost(
    way: str, sampling: Sampling, tmp_path: Path
) -> None:
    path = ensure_fixture("tiny-llama")
    want = sampled(path, prompts(), sampling)
    tls, worker_args = None, []
    if way.startswith("sealed"):
        pki = local_pki(tmp_path)
        tls = pki.client_tls()
        worker_args = [*pki.worker_args(), *pki.chain_args()]
    provider = LoopbackRouteProvider(
        path,
        LAYOUT,
        spares=[(1, 2)],
        options=OPTIONS,
        worker_args=worker_args,
        client_tls=tls,
    )
    run = drive(provider, way, sampling, tls, prompts())
    results, killed, native = harness.run(run, 180.0)
    assert len(killed) == 1
    for result, tokens in zip(results, want, strict=True):
        assert result.state is SessionState.DONE, (result.error, result.reports)
        assert list(result.tokens) == tokens, way
    assert want[0] != want[1]  # each session its own seed
    # the session it was killed under lost its epoch to it, blamed as dead
    assert results[0].route_changes == 1, results[0].reports
    report = results[0].reports[0]
    assert (report.fault, report.endpoint, report.stage_index) == (FaultKind.DEAD, killed[0], 1)
    if "native" in way:  # the epochs took native links, the new route's too
        assert native >= 3


SMOLLM2_LAYOUT = ((0, 8), (8, 16), (16, 24), (24, 30))


@pytest.mark.parametrize("way", ["relay", "chain", "ring-frame", "native-ring"])
def test_smollm2_seeded_tokens_are_the_same_on_every_route_through_a_stage_lost(
    way: str, smollm2_lane: RealLane
) -> None:
    """The real model, its lane certified in this run: the same seed gives the same tokens on
    every route kind, through a middle stage killed mid-answer."""
    sampling = Sampling(seed=2026, temperature=0.7, top_p=0.9)
    options, n_tokens = EngineOptions(), 40
    session_prompts = prompts(49_152)
    want = sampled(smollm2_lane.model, session_prompts, sampling, options, n_tokens)
    provider = LoopbackRouteProvider(
        smollm2_lane.model,
        SMOLLM2_LAYOUT,
        spares=[(8, 16)],
        options=options,
        worker_args=["--lock", str(smollm2_lane.lock), "--evidence", str(smollm2_lane.evidence)],
        certification_verifier=LockVerifier(load_lock(smollm2_lane.lock)),
    )
    run = drive(provider, way, sampling, None, session_prompts, n_tokens)
    results, killed, _ = harness.run(run, 300.0)
    assert len(killed) == 1
    for result, tokens in zip(results, want, strict=True):
        assert result.state is SessionState.DONE, (result.error, result.reports)
        assert list(result.tokens) == tokens, way
    assert results[0].route_changes == 1, results[0].reports
