"""Sessions over the relay, a chained route and a ring of in-process workers ask the last
stage for their tokens (``ForwardRequest.sampled_tokens``, ``docs/sampling.md``): greedy ones
take the whole model's tokens, seeded ones the tokens dgr's sampler takes of the in-process
engines' logits, with speculation on and off, and the last stage ships a token per row instead
of a logits row. A worker that ignores the field answers logits, and the session samples them
itself: the same tokens. In-process workers, but slow: the sessions need the run's certified
fixture lanes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dgr_engine import ShardEngine
from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.routes import EndpointRouteProvider
from dgr_engine.engine.sampling import SeededSampler
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_greedy
from dgr_engine.testing import EngineTransport
from dgr_engine.wire import frames
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_session import EvidenceClass, FailurePolicy, SessionManager, SessionState
from dgr_session.drafts import DraftLength, NgramDrafter
from dgr_session.sampling import GREEDY
from dgr_session.speculation import Speculation
from dgr_session.testing import ScriptedRouteProvider, fixture_identity, make_route, run_virtual
from tests import harness

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
KW: dict[str, Any] = OPTIONS.engine_kwargs()
PROMPT = [11, 42, 7, 99, 11, 42, 7, 99, 11, 42]  # repeats itself: prompt lookup drafts
N_TOKENS = 12
N_VOCAB = 256
SAMPLER = SeededSampler.of(seed=3, temperature=2.0, top_p=0.9, presence_penalty=0.5)

pytestmark = pytest.mark.slow  # certified lanes: `dgr certify` runs once for the whole run


def transport_of(kind: str) -> Any:
    if kind == "relay":
        return GrpcStageTransport(timeout=10.0, close_timeout=2.0)
    return ChainStageTransport(timeout=10.0, close_timeout=2.0, ring=kind == "ring")


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[int]:
    (tokens,) = whole_model_greedy(tiny_llama, [PROMPT], N_TOKENS, OPTIONS)
    return tokens


@pytest.fixture(scope="module")
def sampled(tiny_llama: Path) -> tuple[int, ...]:
    """What ``SAMPLER`` takes of the logits over in-process engines (no wire at all)."""
    engines = EngineTransport(lambda a, b: ShardEngine(tiny_llama, layers=(a, b), **KW))
    engines.start("a", (0, 2))
    engines.start("b", (2, 4))
    route = make_route(["a", "b"], [2], identity=fixture_identity(4), width=64)

    async def main() -> tuple[int, ...]:
        manager = SessionManager(
            engines, ScriptedRouteProvider([route]), required_evidence=EvidenceClass.FIXTURE
        )
        tokens = await manager.generate(PROMPT, max_new_tokens=N_TOKENS, sampler=SAMPLER)
        await manager.aclose()
        return tokens

    try:
        return run_virtual(main)
    finally:
        engines.shutdown()


@pytest.fixture()
def workers(tiny_llama: Path, fixture_evidence: Path) -> list[ShardWorker]:
    """Two in-process stages, [0, 2) and [2, 4), on the run's certified lanes (started and
    stopped by :func:`run_sessions`)."""
    config = WorkerConfig(evidence_dir=fixture_evidence)
    return [ShardWorker.load(tiny_llama, r, **KW, config=config) for r in ((0, 2), (2, 4))]


def run_sessions(
    workers: list[ShardWorker], kind: str, sessions: list[tuple[str, dict[str, Any]]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs the sessions one after the other; their results, and the last stage's usage
    record of each."""

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        addresses = [await w.start() for w in workers]
        results, usage = {}, {}
        try:
            async with transport_of(kind) as transport:
                manager = SessionManager(
                    transport,
                    EndpointRouteProvider(addresses),
                    policy=FailurePolicy(step_deadline=10.0, backoff=(0.0,)),
                    required_evidence=EvidenceClass.FIXTURE,
                )
                for sid, options in sessions:
                    handle = manager.start(
                        PROMPT, max_new_tokens=N_TOKENS, session_id=sid, **options
                    )
                    results[sid] = await handle.wait()
                    records = await transport.client(addresses[1]).usage(sid)
                    assert records, (sid, results[sid].error, results[sid].reports)
                    (usage[sid],) = records
                await manager.aclose()
        finally:
            for w in workers:
                await w.stop()
        return results, usage

    return harness.run(scenario(), 90.0)


def ngram() -> Speculation:
    return Speculation(NgramDrafter(), DraftLength(k_max=4, k_start=4))


@pytest.mark.parametrize("kind", ["relay", "chain", "ring"])
def test_sessions_take_their_tokens_from_the_last_stage_on_every_route_mode(
    workers: list[ShardWorker], reference: list[int], sampled: tuple[int, ...], kind: str
) -> None:
    sessions: list[tuple[str, dict[str, Any]]] = [
        ("plain", {}),
        ("spec", {"speculation": ngram()}),
        ("sampling", {"sampler": SAMPLER}),
        ("sampling-spec", {"sampler": SAMPLER, "speculation": ngram()}),
    ]
    results, usage = run_sessions(workers, kind, sessions)
    for sid, _options in sessions:
        result = results[sid]
        assert result.state is SessionState.DONE, (sid, result.error)
        want = sampled if sid.startswith("sampling") else tuple(reference)
        assert tuple(result.tokens) == want, (kind, sid)
        # a token per row: a few bytes a reply, where a logits row alone is 1 KB
        record = usage[sid]
        assert record.bytes_out < record.forwards * 200, (kind, sid, record)
        # the stage's record states the session's own sampler, billed alike
        assert record.sampling == (SAMPLER.sampling if sid.startswith("sampling") else GREEDY)
    assert sessions[1][1]["speculation"].drafted > 0  # passes were verified from the tokens


@pytest.mark.parametrize("kind", ["relay", "chain"])
def test_a_worker_that_ignores_the_field_still_serves_every_session(
    workers: list[ShardWorker],
    reference: list[int],
    sampled: tuple[int, ...],
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decode = frames.decode_forward

    def older(request: pb.ForwardRequest, *args: Any) -> frames.ForwardFrame:
        request.ClearField("sampled_tokens")  # as a worker that never heard of field 22
        return decode(request, *args)

    monkeypatch.setattr(frames, "decode_forward", older)
    speculation = ngram()
    results, usage = run_sessions(
        workers,
        kind,
        [
            ("plain", {}),
            ("spec", {"speculation": speculation}),
            ("sampling", {"sampler": SAMPLER, "speculation": ngram()}),
        ],
    )
    for sid in ("plain", "spec", "sampling"):
        assert results[sid].state is SessionState.DONE, results[sid].error
        want = sampled if sid == "sampling" else tuple(reference)
        assert tuple(results[sid].tokens) == want, (kind, sid)
        assert usage[sid].bytes_out > N_TOKENS * N_VOCAB * 4 // 2  # the logits came
    assert speculation.drafted > 0
