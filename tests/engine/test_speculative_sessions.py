"""Speculative decoding through route sessions over in-process engines (``docs/speculative.md``):
whatever the drafts (n-gram, the model as its own draft, always wrong, right at random), at
every draft length, the tokens are those of plain greedy decoding; a stage lost in the middle of
a verification pass ends the epoch and the re-prefill replays accepted tokens only; under seeded
sampling the tokens are plain seeded sampling's, and a sampler the stages cannot apply is
refused. Time is the virtual clock, so nothing waits."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from dgr_engine import ShardEngine
from dgr_engine.engine.sampling import SeededSampler
from dgr_engine.reference import InProcessRoute
from dgr_engine.speculative import ModelDrafter
from dgr_engine.testing import EngineTransport
from dgr_session import EvidenceClass, FailurePolicy, FaultKind, SessionManager, SessionState
from dgr_session.drafts import DraftLength, NgramDrafter
from dgr_session.errors import SpeculationNeedsSampling
from dgr_session.speculation import MAX_DRAFTS, Speculation
from dgr_session.testing import ScriptedRouteProvider, fixture_identity, make_route, run_virtual

PROMPT = (17, 4, 99, 230, 5, 61, 17, 4, 99)
N_TOKENS = 24
KW: dict[str, Any] = {"max_sessions": 4, "n_ctx_per_session": 96, "n_threads": 1, "n_batch": 32}
POLICY = FailurePolicy(step_deadline=5.0, session_deadline=60.0, max_route_changes=2)


@pytest.fixture()
def transport(tiny_llama: Path) -> Iterator[EngineTransport]:
    t = EngineTransport(lambda a, b: ShardEngine(tiny_llama, layers=(a, b), **KW))
    for name, layers in [("a", (0, 1)), ("b", (1, 3)), ("c", (1, 3)), ("d", (3, 4))]:
        t.start(name, layers)
    yield t
    t.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama: Path) -> tuple[int, ...]:
    with ShardEngine(tiny_llama, **KW) as whole:
        chain = InProcessRoute([whole])
        chain.open(1, 0)
        tokens, _ = chain.greedy(1, 0, PROMPT, N_TOKENS, all_prefill_logits=False)
    return tuple(tokens)


def route(*endpoints: str):
    return make_route(endpoints, [1, 3], identity=fixture_identity(4), width=64)


class Oracle:
    """Drafts the true continuation, each draft replaced by a wrong token with probability
    ``wrong`` (seeded): acceptance anywhere from 1 to 0."""

    name = "oracle"

    def __init__(self, truth: Sequence[int], wrong: float, seed: int = 1) -> None:
        self.truth, self.wrong, self.rng = tuple(truth), wrong, random.Random(seed)

    def propose(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        n = len(history) - len(PROMPT)
        out = list(self.truth[n : n + k])
        return tuple(3 if self.rng.random() < self.wrong else t for t in out)

    def close(self) -> None:
        pass


def run_session(
    transport: EngineTransport, spec: Speculation | None, *routes: Any, **kw: Any
) -> Any:
    async def main() -> Any:
        provider = ScriptedRouteProvider(list(routes) or [route("a", "b", "d")])
        manager = SessionManager(
            transport, provider, policy=POLICY, required_evidence=EvidenceClass.FIXTURE
        )
        result = await manager.start(PROMPT, max_new_tokens=N_TOKENS, speculation=spec, **kw).wait()
        await manager.aclose()
        return result

    return run_virtual(main)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, MAX_DRAFTS])
@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
def test_tokens_equal_plain_greedy_at_every_draft_length(transport, expected, k, wrong) -> None:
    spec = Speculation(Oracle(expected, wrong), DraftLength(k_max=k, k_start=k))
    result = run_session(transport, spec)
    assert result.state is SessionState.DONE, result.error
    assert result.tokens == expected
    assert spec.passes > 0 and spec.drafted > 0
    if wrong == 0.0:  # every draft right: several tokens a pass
        assert spec.accepted == spec.drafted
        assert spec.passes < N_TOKENS - 1
    if wrong == 1.0:
        assert spec.accepted == 0
    assert all(e.stats().open_sessions == 0 for e in transport.engines().values())


def test_ngram_drafts_and_the_model_as_its_own_draft(transport, expected, tiny_llama) -> None:
    ngram = Speculation(NgramDrafter(), DraftLength(k_max=8))
    result = run_session(transport, ngram)
    assert result.tokens == expected and ngram.drafted > 0
    with ModelDrafter(tiny_llama, target_n_vocab=256) as own:
        itself = Speculation(own, DraftLength(k_max=8, k_start=8))
        result = run_session(transport, itself)
    assert result.tokens == expected
    assert itself.accepted == itself.drafted > 0  # the mechanism's ceiling: acceptance 1.0


def test_a_stage_lost_in_a_verification_pass_replays_accepted_tokens_only(
    transport, expected
) -> None:
    """The middle stage dies while a pass of 4 drafts is on its way: the epoch ends (fault
    ``dead`` on that stage), the new route re-prefills the prompt and the accepted tokens, never
    a draft, and the tokens are plain greedy's."""
    spec = Speculation(Oracle(expected, 0.3), DraftLength(k_max=4, k_start=4))
    accepted: list[int] = []

    def on_token(token: int) -> None:
        accepted.append(token)
        if len(accepted) == 3:
            transport.kill("b")  # the next forward, a verification pass, finds it gone

    result = run_session(
        transport, spec, route("a", "b", "d"), route("a", "c", "d"), on_token=on_token
    )
    assert result.state is SessionState.DONE, result.error
    assert result.tokens == expected
    (report,) = result.reports
    assert report.fault is FaultKind.DEAD and report.endpoint == "b"
    assert report.step >= 3  # the pass that found it gone came after the third token
    # the replacement replayed the prompt and the accepted tokens (one batched call), no draft
    (replay,) = [u for u in result.usage if u.epoch == 2 and u.endpoint == "c"]
    assert replay.rows_replay == len(PROMPT) + report.step


SAMPLED = SeededSampler.of(seed=2024, temperature=0.7, top_p=0.9, presence_penalty=0.3)


@pytest.mark.parametrize("drafter", ["oracle", "wrong", "ngram", "draft-model"])
def test_speculative_sampling_equals_plain_sampling_token_for_token(
    transport, tiny_llama, drafter
) -> None:
    """A pass keeps a draft when it is the seeded sampler's token at its position
    (``docs/sampling.md``): whatever the drafts, the tokens are plain seeded sampling's."""
    plain = run_session(transport, None, sampler=SAMPLED)
    assert plain.state is SessionState.DONE, plain.error
    truth = plain.tokens
    with ModelDrafter(tiny_llama, target_n_vocab=256) as own:
        source = {
            "oracle": Oracle(truth, 0.0),
            "wrong": Oracle(truth, 0.5),
            "ngram": NgramDrafter(),
            "draft-model": own,
        }[drafter]
        spec = Speculation(source, DraftLength(k_max=4, k_start=4))
        result = run_session(transport, spec, sampler=SAMPLED)
    assert result.state is SessionState.DONE, result.error
    assert result.tokens == truth
    if drafter != "ngram":  # (a sampled text may repeat nothing prompt lookup finds)
        assert spec.drafted > 0
    if drafter == "oracle":
        assert spec.accepted == spec.drafted > 0  # every draft the sampler's: all kept
    other = run_session(transport, None, sampler=SeededSampler.of(seed=2025, temperature=0.7))
    assert other.tokens != truth  # another seed, other tokens: the seed is what decides


def test_a_private_sampler_is_refused_before_anything_starts(transport) -> None:
    spec = Speculation(NgramDrafter(), DraftLength())

    class Private:
        sampling = None

        def __call__(self, logits: Any, position: int, history: Any = ()) -> int:
            return 0

    async def main() -> None:
        manager = SessionManager(
            transport,
            ScriptedRouteProvider([route("a", "b", "d")]),
            required_evidence=EvidenceClass.FIXTURE,
        )
        with pytest.raises(SpeculationNeedsSampling, match="states no Sampling"):
            manager.start(PROMPT, max_new_tokens=4, speculation=spec, sampler=Private())
        await manager.aclose()

    run_virtual(main)
    assert all(e.stats().open_sessions == 0 for e in transport.engines().values())


def test_a_replay_in_chunks_carries_no_drafts(transport, expected) -> None:
    """Stages that take 8 rows a forward: after a stage loss the re-prefill replays prompt and
    accepted tokens in chunks of 8, the last of them past the prompt and ending at the newest
    token. Drafts ride only on a one-token decode forward, never on a replay chunk."""
    spec = Speculation(Oracle(expected, 0.3), DraftLength(k_max=4, k_start=4))
    accepted: list[int] = []

    def on_token(token: int) -> None:
        accepted.append(token)
        if len(accepted) == 12:
            transport.kill("b")

    def small(r: Any) -> Any:
        return attrs.evolve(r, stages=tuple(attrs.evolve(s, max_rows=8) for s in r.stages))

    result = run_session(
        transport,
        spec,
        small(route("a", "b", "d")),
        small(route("a", "c", "d")),
        on_token=on_token,
    )
    assert result.state is SessionState.DONE, result.error
    assert result.tokens == expected
    assert [r.fault for r in result.reports] == [FaultKind.DEAD]
