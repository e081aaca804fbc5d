"""End to end: speculative decoding over real ``dgr worker`` processes on 127.0.0.1, over the
relay, a chained route and a ring (``docs/speculative.md``).

Whatever drafts a session takes (prompt lookup over its own tokens, the model as its own draft,
drafts that are always wrong) its tokens are plain greedy decoding's; on a ring, prompt lookup
drafts are made by the last stage, which sends each next pass to the first stage itself; a
middle stage SIGKILLed while passes are on their way ends the epoch and the session re-prefills
its accepted tokens on a new route; the workers' usage records count the drafted and rejected
rows. Every wait is bounded; the provider stops every process it started.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from dgr_engine.client.chained import ChainStageTransport
from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_greedy
from dgr_engine.speculative import ModelDrafter
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_session import EvidenceClass, FailurePolicy, FaultKind, SessionManager, SessionState
from dgr_session.drafts import DraftLength, NgramDrafter
from dgr_session.speculation import Speculation
from tests import harness

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("certified_fixtures")]

N_TOKENS = 20
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
LAYOUT = ((0, 1), (1, 3), (3, 4))
# a prompt that repeats itself, so prompt lookup finds drafts; and one that does not
PROMPTS = ([11, 42, 7, 99, 11, 42, 7, 99, 11, 42, 7, 99, 11, 42], [3, 141, 59, 26, 5, 35])


class Wrong:
    """Drafts that are never the greedy token (a token the model never picks here)."""

    name = "wrong"

    def __init__(self, reference: Sequence[int], prompt: Sequence[int]) -> None:
        self.avoid, self.n_prompt = set(reference), len(prompt)

    def propose(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        token = next(t for t in range(256) if t not in self.avoid)
        return (token,) * k

    def close(self) -> None:
        pass


def make_transport(kind: str) -> Any:
    if kind == "relay":
        return GrpcStageTransport(timeout=10.0, close_timeout=2.0)
    return ChainStageTransport(timeout=10.0, close_timeout=2.0, ring=kind == "ring")


drafters: list[str] = []
"""The draft source each session of the last ``drive`` ran with (its transport's answer)."""


async def drive(
    provider: LoopbackRouteProvider,
    kind: str,
    specs: Sequence[Speculation],
    *,
    kill_at: int | None = None,
) -> tuple[list[Any], list[str], list[Any]]:
    killed: list[str] = []
    handles: list[Any] = []
    drafters.clear()

    def on_token(_token: int) -> None:
        if kill_at is not None and not killed and len(handles[0].tokens) >= kill_at:
            route = handles[0].core.route
            killed.append(provider.kill(route.stages[1].endpoint).endpoint)

    await provider.start()
    usage: list[Any] = []
    try:
        async with make_transport(kind) as transport:
            manager = SessionManager(
                transport,
                provider,
                policy=FailurePolicy(step_deadline=10.0, backoff=(0.0,)),
                required_evidence=EvidenceClass.FIXTURE,
            )
            for i, spec in enumerate(specs):
                handles.append(
                    manager.start(
                        PROMPTS[i % 2],
                        max_new_tokens=N_TOKENS,
                        session_id=f"spec-{kind}-{i}",
                        speculation=spec,
                        on_token=on_token if i == 0 else None,
                    )
                )
            results = [await h.wait() for h in handles]
            drafters.extend(h.core.speculation.drafter.name for h in handles)
            if kill_at is None:
                for i, h in enumerate(handles):
                    route = h.core.route
                    for stage in route.stages:
                        records = await transport.client(stage.endpoint).usage(f"spec-{kind}-{i}")
                        usage.append((i, stage.layer_begin, records))
            await manager.aclose()
    finally:
        await provider.aclose()
    for worker in provider.workers:
        assert not worker.running, f"{worker} still running"
    return results, killed, usage


@pytest.mark.parametrize("kind", ["relay", "chain", "ring"])
def test_tokens_equal_plain_greedy_with_every_draft_source(kind: str) -> None:
    path = ensure_fixture("tiny-llama")
    reference = whole_model_greedy(path, PROMPTS, N_TOKENS, OPTIONS)
    provider = LoopbackRouteProvider(path, LAYOUT, options=OPTIONS)
    with ModelDrafter(path, target_n_vocab=256) as itself:
        specs = [
            Speculation(NgramDrafter(), DraftLength(k_max=8)),
            Speculation(itself, DraftLength(k_max=6, k_start=6)),
            Speculation(Wrong(reference[0], PROMPTS[0]), DraftLength(k_max=3, k_start=3)),
        ]
        results, _, usage = harness.run(drive(provider, kind, specs), 120.0)
    for i, (result, spec) in enumerate(zip(results, specs, strict=True)):
        assert result.state is SessionState.DONE, result.error
        assert list(result.tokens) == reference[i % 2], (kind, i)
        assert spec.passes > 0 and spec.drafted > 0, (kind, i, spec)
    ngram, own, wrong = specs
    # on a ring, prompt lookup drafts came from its last stage, with every pass it sent: the
    # session ran with the ring's drafts in place of the caller's, which stays as it was
    assert drafters[0] == "ngram"  # on a ring, the last stage's prompt lookup
    assert ngram.drafter.name == "ngram"
    assert own.accepted == own.drafted  # the model as its own draft: acceptance 1.0
    assert wrong.accepted == 0
    # every stage counted the rows it verified, and those it dropped; the last stage answered
    # greedy tokens (a few bytes a reply), never a logits row (1 KB)
    for i, spec in enumerate(specs):
        for _i, begin, records in [u for u in usage if u[0] == i]:
            (record,) = records
            assert record.rows_draft == spec.drafted, (kind, i)
            assert record.rows_rejected == spec.drafted - spec.accepted, (kind, i)
            if begin == LAYOUT[-1][0]:
                assert record.bytes_out < record.forwards * 200, (kind, i, record)


@pytest.mark.parametrize("kind", ["relay", "ring"])
def test_a_middle_stage_killed_between_passes_costs_no_token(kind: str) -> None:
    path = ensure_fixture("tiny-llama")
    reference = whole_model_greedy(path, PROMPTS[:1], N_TOKENS, OPTIONS)
    provider = LoopbackRouteProvider(path, LAYOUT, spares=[(1, 3)], options=OPTIONS)
    spec = Speculation(NgramDrafter(), DraftLength(k_max=4, k_start=4))
    results, killed, _ = harness.run(drive(provider, kind, [spec], kill_at=4), 120.0)
    (result,) = results
    assert result.state is SessionState.DONE, result.error
    assert list(result.tokens) == reference[0]
    assert len(killed) == 1
    (report,) = result.reports
    assert report.fault is FaultKind.DEAD and report.endpoint == killed[0]
