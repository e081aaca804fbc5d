"""Speculative decoding on DeepSeek V4 shards is exact (``docs/speculative.md``, "DeepSeek V4:
dropping rejected drafts"): a verification pass of the newest token and up to 16 drafts gives
every row the logits plain one-row decoding gives, bit for bit; dropping the rejected drafts
(llama.cpp's n_rs_seq snapshots of the compressor and indexer state) leaves each stage's state
as plain decoding leaves it, so every later row is bit-identical too; route sessions with
speculation over 2, 3 and 12 V4 stages produce plain greedy's tokens; a worker takes V4 frames
with draft rows.

The prompts reach past tiny-v4's sliding window (32), past its CSA blocks (ratio 4, indexer
top 8) and its first HCA block (ratio 128), so rejected drafts complete compressed blocks that
the rollback must undo.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine._binding import lib
from dgr_engine.fixtures import FIXTURES, ensure_fixture
from dgr_engine.reference import InProcessRoute
from dgr_engine.testing import EngineTransport
from dgr_engine.wire.frames import MAX_DRAFT_ROWS, Expectations, decode_forward, encode_forward
from dgr_engine.worker.lifecycle.sessions import SessionTable
from dgr_session import EvidenceClass, FailurePolicy, SessionManager, SessionState
from dgr_session.drafts import DraftLength
from dgr_session.identity import ModelIdentity
from dgr_session.speculation import Speculation
from dgr_session.testing import ScriptedRouteProvider, make_route, run_virtual

N_VOCAB = FIXTURES["tiny-v4"].n_vocab
PROMPT = [int(t) for t in np.random.default_rng(4).integers(0, N_VOCAB, 300)]
SESSION_PROMPT = tuple(PROMPT[:150])
N_DECODE = 32
N_SESSION = 24
KW: dict[str, Any] = {"max_sessions": 3, "n_ctx_per_session": 512, "n_threads": 1, "n_batch": 512}
POLICY = FailurePolicy(step_deadline=5.0, session_deadline=60.0, max_route_changes=2)

Plain = tuple[list[int], list[np.ndarray]]


def stages(path: Path, cut: Sequence[int]) -> list[ShardEngine]:
    return [ShardEngine(path, layers=r, **KW) for r in zip(cut[:-1], cut[1:], strict=True)]


def plain_greedy(path: Path, prompt: Sequence[int], n: int) -> Plain:
    """Tokens and per-step logits (``[n_vocab]`` each) of plain one-row greedy decoding."""
    with ShardEngine(path, **KW) as whole:
        chain = InProcessRoute([whole])
        chain.open(1, 0)
        tokens, logits = chain.greedy(1, 0, prompt, n, all_prefill_logits=False)
    return tokens, [row[-1] for row in logits]


@pytest.fixture(scope="module")
def tiny_v4() -> Path:
    return ensure_fixture("tiny-v4")


@pytest.fixture(scope="module")
def v4_12() -> Path:
    return ensure_fixture("v4-12")


def drafts_for(truth: Sequence[int], wrong: float, rng: random.Random) -> list[int]:
    """``truth`` with each token replaced by another with probability ``wrong``."""
    return [(t + 1) % N_VOCAB if rng.random() < wrong else t for t in truth]


def speculate(chain: InProcessRoute, plain: Plain, k: int, wrong: float) -> tuple[list[int], int]:
    """Greedy decoding of PROMPT by verification passes of ``k`` drafts, each stage dropping
    the rejected ones; asserts that every row whose drafts so far are right has plain
    decoding's logits bit for bit. Returns the tokens and the passes run."""
    tokens, logits = plain
    rng = random.Random(k * 100 + int(wrong * 10))
    chain.open(2, 0)
    try:
        first = chain.forward(2, 0, PROMPT, 0)[-1]
        assert np.array_equal(first, logits[0])
        out, pos, passes = [int(np.argmax(first))], len(PROMPT), 0
        while len(out) < N_DECODE:
            n = len(out)
            drafts = drafts_for(tokens[n : n + k], wrong, rng)
            rows = chain.forward(2, 0, [out[-1], *drafts], pos, all_logits=True)
            passes += 1
            kept = 0
            for i in range(len(drafts) + 1):  # row i follows the newest token and i drafts
                assert np.array_equal(rows[i], logits[n + i]), f"pass {passes} row {i} differs"
                if i == len(drafts) or drafts[i] != int(np.argmax(rows[i])):
                    break
                kept += 1
            pos += 1 + kept
            for engine in chain.engines:
                engine.truncate(2, 0, pos)
            out += [*drafts[:kept], int(np.argmax(rows[kept]))]
        return out[:N_DECODE], passes
    finally:
        chain.close(2, 0)


def test_the_native_rollback_covers_every_draft_a_pass_may_carry() -> None:
    assert int(lib.DGR_V4_ROLLBACK_ROWS) >= MAX_DRAFT_ROWS


@pytest.mark.parametrize(
    "cut", [(0, 6), (0, 3, 6), (0, 2, 4, 6)], ids=lambda c: "-".join(map(str, c))
)
@pytest.mark.parametrize(("k", "wrong"), [(1, 0.5), (4, 0.0), (4, 0.3), (4, 1.0), (16, 0.3)])
def test_verification_rows_and_every_later_row_are_plain_decodings_bits(
    tiny_v4: Path, cut: tuple[int, ...], k: int, wrong: float
) -> None:
    plain = plain_greedy(tiny_v4, PROMPT, N_DECODE)
    engines = stages(tiny_v4, cut)
    try:
        tokens, passes = speculate(InProcessRoute(engines), plain, k, wrong)
    finally:
        for engine in engines:
            engine.close()
    assert tokens == plain[0]
    if wrong == 0.0:
        assert passes <= -(-N_DECODE // (k + 1))
    if wrong == 1.0:
        assert passes == N_DECODE - 1


def test_twelve_v4_stages_verify_bit_for_bit(v4_12: Path) -> None:
    plain = plain_greedy(v4_12, PROMPT, N_DECODE)
    engines = stages(v4_12, range(13))
    try:
        for k, wrong in [(4, 0.3), (16, 0.2)]:
            tokens, _ = speculate(InProcessRoute(engines), plain, k, wrong)
            assert tokens == plain[0]
    finally:
        for engine in engines:
            engine.close()


# --- route sessions over in-process V4 engines -------------------------------------------------


class Oracle:
    """Drafts the true continuation, each draft wrong with probability ``wrong`` (seeded)."""

    name = "oracle"

    def __init__(self, truth: Sequence[int], wrong: float) -> None:
        self.truth, self.wrong, self.rng = tuple(truth), wrong, random.Random(7)

    def propose(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        n = len(history) - len(SESSION_PROMPT)
        return tuple(drafts_for(self.truth[n : n + k], self.wrong, self.rng))

    def close(self) -> None:
        pass


def v4_identity(n_layer: int) -> ModelIdentity:
    return ModelIdentity(content_hash=bytes(32), arch="deepseek4", n_layer=n_layer)


@pytest.fixture(scope="module", params=["tiny-v4/2", "tiny-v4/3", "v4-12/12"])
def v4_route(request: pytest.FixtureRequest) -> Iterator[tuple[EngineTransport, Any, list[int]]]:
    """An EngineTransport holding one V4 route, the route and plain greedy's tokens."""
    name, n_stages = request.param.split("/")
    path = ensure_fixture(name)
    n_layer = FIXTURES[name].n_layer
    bounds = [round(i * n_layer / int(n_stages)) for i in range(int(n_stages) + 1)]
    transport = EngineTransport(lambda a, b: ShardEngine(path, layers=(a, b), **KW))
    names = [f"s{i}" for i in range(int(n_stages))]
    for endpoint, layers in zip(names, zip(bounds[:-1], bounds[1:], strict=True), strict=True):
        transport.start(endpoint, layers)
    route = make_route(names, bounds[1:-1], identity=v4_identity(n_layer), width=256)
    tokens, _ = plain_greedy(path, SESSION_PROMPT, N_SESSION)
    yield transport, route, tokens
    transport.shutdown()


@pytest.mark.parametrize(("k", "wrong"), [(4, 0.0), (4, 0.4), (8, 1.0), (MAX_DRAFT_ROWS, 0.2)])
def test_v4_route_sessions_with_speculation_give_plain_greedys_tokens(
    v4_route: tuple[EngineTransport, Any, list[int]], k: int, wrong: float
) -> None:
    transport, route, expected = v4_route
    spec = Speculation(Oracle(expected, wrong), DraftLength(k_max=k, k_start=k))

    async def main() -> Any:
        manager = SessionManager(
            transport,
            ScriptedRouteProvider([route]),
            policy=POLICY,
            required_evidence=EvidenceClass.FIXTURE,
        )
        result = await manager.start(
            SESSION_PROMPT, max_new_tokens=N_SESSION, speculation=spec
        ).wait()
        await manager.aclose()
        return result

    result = run_virtual(main)
    assert result.state is SessionState.DONE, result.error
    assert list(result.tokens) == expected
    assert spec.passes > 0 and spec.drafted > 0
    if wrong == 0.0:
        assert spec.accepted == spec.drafted and spec.passes < N_SESSION - 1
    if wrong == 1.0:
        assert spec.accepted == 0
    assert all(e.stats().open_sessions == 0 for e in transport.engines().values())


# --- worker frames -----------------------------------------------------------------------------


def test_a_v4_worker_takes_draft_rows_and_drops_the_rejected_ones(tiny_v4: Path) -> None:
    """A whole-model V4 worker's session table runs a verification pass of 4 drafts (2 right),
    the frame keeping 2, then a pass of 16 wrong drafts and the frame keeping none (the deepest
    rollback): every compared row has plain decoding's logits bit for bit."""
    tokens, logits = plain_greedy(tiny_v4, PROMPT, 8)
    with ShardEngine(tiny_v4, **KW) as engine:
        info = engine.info
        mine = Expectations.of_shard(bytes(32), info)
        table = SessionTable(engine)
        table.open("v", 0)

        def frame(step: int, start: int, ids: Sequence[int], **kw: Any) -> Any:
            positions = range(start, start + len(ids))
            return decode_forward(
                encode_forward("v", 0, step, mine, positions, tokens=ids, **kw), mine, info
            )

        table.forward(frame(0, 0, PROMPT))
        p = len(PROMPT)
        drafts = [tokens[1], tokens[2], (tokens[3] + 1) % N_VOCAB, tokens[4]]
        verify = frame(1, p, [tokens[0], *drafts], logit_rows=range(5), drafts=4)
        assert verify.drafts == 4
        rows, next_pos, _ = table.forward(verify)
        assert next_pos == p + 5 and rows.shape == (5, N_VOCAB)
        for i in range(3):
            assert np.array_equal(rows[i], logits[i + 1])
        assert int(np.argmax(rows[2])) == tokens[3] != drafts[2]
        wrong = [(t + 1) % N_VOCAB for t in tokens[5:8]] * 6
        rows, next_pos, _ = table.forward(
            frame(
                2, p + 3, [tokens[3], *wrong[:16]], logit_rows=range(17), drafts=16, kept_drafts=2
            )
        )
        assert next_pos == p + 20 and np.array_equal(rows[0], logits[4])
        out, next_pos, _ = table.forward(frame(3, p + 4, [tokens[4]], kept_drafts=0))
        assert next_pos == p + 5 and np.array_equal(out[-1], logits[5])
        assert engine.next_pos(1, 0) == p + 5
