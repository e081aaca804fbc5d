"""A session with dgr's sampler (one that states its ``Sampling``) hands it to every stage at
open and says so in every forward (``Forward.sampled``): its transport may answer the last
stage's tokens (``Logits.sampled``) instead of logits, and the manager takes them; a transport
that answers logits gives the same tokens (the manager samples them with the session's sampler,
at the token's position, after the tokens before it). A session whose sampler states no
``Sampling`` never asks, and samples the logits. Tokens that do not match the rows asked are the
stage's protocol fault. Over the fake transport, on virtual time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from dgr_session import (
    GREEDY,
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    Forward,
    Logits,
    Sampling,
    SessionManager,
    SessionState,
    StageResult,
    StageSpec,
    greedy,
)
from dgr_session.testing import (
    FakeModel,
    FakeTransport,
    ScriptedRouteProvider,
    fixture_identity,
    make_route,
    run_virtual,
)
from tests import reference_sampler
from tests.reference_sampler import DocumentedSampler

MODEL = FakeModel(n_layer=6, vocab=32)
IDENTITY = fixture_identity(MODEL.n_layer)
POLICY = FailurePolicy(step_deadline=2.0, session_deadline=60.0, max_route_changes=3)
PROMPT = (3, 1, 4, 1, 5)
HOT = Sampling(seed=7, temperature=300_000.0, presence_penalty=0.5)  # the fake's logits are huge


@attrs.frozen
class Private:
    """A sampler only its caller knows: it states no ``Sampling``."""

    sampling = None

    def __call__(self, logits: Any, position: int, history: Sequence[int] = ()) -> int:
        return (greedy(logits) + position) % len(logits)


class Answering(FakeTransport):
    """Answers a sampled forward's last stage with the tokens its sampler (the one the open
    carried) takes, no logits at all, unless ``tokens`` is False (the logits); ``bad``
    answers the wrong count."""

    def __init__(self, *, tokens: bool, bad: str = "") -> None:
        super().__init__(MODEL)
        self.tokens, self.bad = tokens, bad
        self.seen: list[Forward] = []
        self.opened: list[Sampling | None] = []
        self.history: list[int] = []

    async def open(
        self, stage: StageSpec, session_id: str, epoch: int, sampling: Sampling | None = None
    ) -> None:
        self.opened.append(sampling)
        await super().open(stage, session_id, epoch, sampling)

    async def forward(self, call: Forward) -> StageResult:
        result = await super().forward(call)
        self.seen.append(call)
        if call.final:
            del self.history[call.positions.start :]
            self.history.extend(call.token_ids)
        if not (call.final and call.sampled and call.wants_logits and self.tokens):
            return result
        assert isinstance(result, Logits)
        if call.stage.endpoint == self.bad:
            return Logits.sampled_tokens((), result.cost)
        sampling = self.opened[-1] or GREEDY
        position = call.positions.stop
        token = reference_sampler.sample(sampling, list(result.values), position, self.history)
        return Logits.sampled_tokens((token,), result.cost)


def run_session(transport: Answering, cuts: Any = ((2, 4),), **kw: Any) -> Any:
    routes = [make_route(["a", "b", e], list(c), identity=IDENTITY) for e, c in cuts]

    async def main() -> Any:
        manager = SessionManager(
            transport,
            ScriptedRouteProvider(routes),
            policy=POLICY,
            required_evidence=EvidenceClass.FIXTURE,
        )
        result = await manager.start(PROMPT, max_new_tokens=6, **kw).wait()
        await manager.aclose()
        return result

    return run_virtual(main)


@pytest.mark.parametrize("tokens", [True, False], ids=["stage-tokens", "logits-only"])
def test_a_greedy_session_takes_the_stages_tokens_or_its_logits(tokens: bool) -> None:
    transport = Answering(tokens=tokens)
    result = run_session(transport, (("c", (2, 4)),))
    assert result.state is SessionState.DONE, result.error
    assert result.tokens == MODEL.reference(PROMPT, 6)
    assert transport.seen and all(call.sampled for call in transport.seen)
    assert set(transport.opened) == {GREEDY}


@pytest.mark.parametrize("tokens", [True, False], ids=["stage-tokens", "logits-only"])
def test_a_seeded_session_hands_its_sampler_to_the_stages_and_gets_the_same_tokens(
    tokens: bool,
) -> None:
    transport = Answering(tokens=tokens)
    result = run_session(transport, (("c", (2, 4)),), sampler=DocumentedSampler(HOT))
    assert result.state is SessionState.DONE, result.error
    assert set(transport.opened) == {HOT} and all(call.sampled for call in transport.seen)
    # the same seed: the same tokens whether the stage or the manager took them
    again = run_session(
        Answering(tokens=not tokens), (("c", (2, 4)),), sampler=DocumentedSampler(HOT)
    )
    assert again.tokens == result.tokens
    assert result.tokens != MODEL.reference(PROMPT, 6)  # it sampled


def test_a_session_with_a_private_sampler_never_asks_for_the_stages_tokens() -> None:
    transport = Answering(tokens=True)
    result = run_session(transport, (("c", (2, 4)),), sampler=Private())
    assert result.state is SessionState.DONE, result.error
    assert not any(call.sampled for call in transport.seen)
    assert set(transport.opened) == {None}
    assert result.tokens != MODEL.reference(PROMPT, 6)  # its own choice, at each position


def test_tokens_not_one_per_row_are_the_stages_protocol_fault() -> None:
    transport = Answering(tokens=True, bad="bad")
    result = run_session(transport, (("bad", (2, 4)), ("c", (2, 4))))
    assert result.state is SessionState.DONE, result.error
    assert result.tokens == MODEL.reference(PROMPT, 6)
    (report,) = result.reports
    assert report.fault is FaultKind.PROTOCOL and report.endpoint == "bad"
    assert "no token" in report.detail
