"""A greedy session says so in every forward (``Forward.greedy``): its transport may answer the
last stage's greedy tokens (``Logits.greedy``) instead of logits, and the manager takes them;
a transport that answers logits (an older worker) gives the same tokens. A sampling session
never asks, and samples the logits. Greedy tokens that do not match the rows asked are the
stage's protocol fault. Over the fake transport, on virtual time."""

from __future__ import annotations

from typing import Any

import pytest

from dgr_session import (
    EvidenceClass,
    FailurePolicy,
    FaultKind,
    Forward,
    Logits,
    SeededSampler,
    SessionManager,
    SessionState,
    StageResult,
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

MODEL = FakeModel(n_layer=6, vocab=32)
IDENTITY = fixture_identity(MODEL.n_layer)
POLICY = FailurePolicy(step_deadline=2.0, session_deadline=60.0, max_route_changes=3)
PROMPT = (3, 1, 4, 1, 5)


class Answering(FakeTransport):
    """Answers a greedy forward's last stage with its greedy tokens (no logits at all), unless
    ``tokens`` is False (an older worker: the logits); ``bad`` answers the wrong count."""

    def __init__(self, *, tokens: bool, bad: str = "") -> None:
        super().__init__(MODEL)
        self.tokens, self.bad = tokens, bad
        self.seen: list[Forward] = []

    async def forward(self, call: Forward) -> StageResult:
        result = await super().forward(call)
        self.seen.append(call)
        if not (call.final and call.greedy and call.wants_logits and self.tokens):
            return result
        assert isinstance(result, Logits)
        if call.stage.endpoint == self.bad:
            return Logits.greedy_tokens((), result.cost)
        return Logits.greedy_tokens((greedy(result.values),), result.cost)


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


@pytest.mark.parametrize("tokens", [True, False], ids=["greedy-tokens", "logits-only"])
def test_a_greedy_session_takes_the_stages_greedy_tokens_or_its_logits(tokens: bool) -> None:
    transport = Answering(tokens=tokens)
    result = run_session(transport, (("c", (2, 4)),))
    assert result.state is SessionState.DONE, result.error
    assert result.tokens == MODEL.reference(PROMPT, 6)
    assert transport.seen and all(call.greedy for call in transport.seen)


def test_a_sampling_session_never_asks_for_greedy_tokens() -> None:
    sampler = SeededSampler(seed=7, temperature=300_000.0)
    transport = Answering(tokens=True)
    result = run_session(transport, (("c", (2, 4)),), sampler=sampler)
    assert result.state is SessionState.DONE, result.error
    assert not any(call.greedy for call in transport.seen)
    assert result.tokens != MODEL.reference(PROMPT, 6)  # it sampled the logits


def test_greedy_tokens_not_one_per_row_are_the_stages_protocol_fault() -> None:
    transport = Answering(tokens=True, bad="bad")
    result = run_session(transport, (("bad", (2, 4)), ("c", (2, 4))))
    assert result.state is SessionState.DONE, result.error
    assert result.tokens == MODEL.reference(PROMPT, 6)
    (report,) = result.reports
    assert report.fault is FaultKind.PROTOCOL and report.endpoint == "bad"
    assert "greedy token" in report.detail
