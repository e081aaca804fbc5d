"""Chained shards equal the whole model bit for bit (np.array_equal), on the real engine."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine.reference import InProcessRoute
from tests.harness import PARITY_PROMPT

N_LAYER = 4
PROMPT = PARITY_PROMPT
N_DECODE = 32
ENGINE_KW = {"max_sessions": 4, "n_ctx_per_session": 256, "n_threads": 2, "n_batch": 64}


def all_cuts(n_layer: int) -> list[tuple[int, ...]]:
    """Every way to cut [0, n_layer) into 1..n_layer contiguous stages, as boundary tuples."""
    cuts = []
    for n_inner in range(n_layer):
        for inner in itertools.combinations(range(1, n_layer), n_inner):
            cuts.append((0, *inner, n_layer))
    return cuts


class EnginePool:
    """One engine per distinct range, shared by every cut (ranges repeat across cuts)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.engines: dict[tuple[int, int], ShardEngine] = {}

    def chain(self, cut: tuple[int, ...]) -> InProcessRoute:
        stages = []
        for rng in zip(cut[:-1], cut[1:], strict=True):
            if rng not in self.engines:
                self.engines[rng] = ShardEngine(self.path, layers=rng, **ENGINE_KW)
            stages.append(self.engines[rng])
        return InProcessRoute(stages)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-llama-tied", "tiny-qwen2"])
def pool(request: pytest.FixtureRequest) -> Iterator[EnginePool]:
    path = request.getfixturevalue(request.param.replace("-", "_"))
    p = EnginePool(path)
    yield p
    p.close()


@pytest.fixture(scope="module")
def reference(pool: EnginePool) -> tuple[list[int], list[np.ndarray]]:
    whole = pool.chain((0, N_LAYER))
    whole.open(999, 0)
    tokens, logits = whole.greedy(999, 0, PROMPT, N_DECODE)
    whole.close(999, 0)
    return tokens, logits


def test_all_cuts_enumerated() -> None:
    assert len(all_cuts(4)) == 8
    assert (0, 4) in all_cuts(4) and (0, 1, 2, 3, 4) in all_cuts(4)


def test_reference_is_a_real_decode(reference: tuple[list[int], list[np.ndarray]]) -> None:
    tokens, logits = reference
    assert len(tokens) == N_DECODE
    assert logits[0].shape == (len(PROMPT), 256)
    assert all(np.isfinite(x).all() for x in logits)
    assert len(set(tokens)) > 1 or len(set(PROMPT)) > 1


@pytest.mark.parametrize("cut", all_cuts(N_LAYER), ids=lambda c: "-".join(map(str, c)))
def test_chain_equals_whole_model(
    pool: EnginePool, reference: tuple[list[int], list[np.ndarray]], cut: tuple[int, ...]
) -> None:
    ref_tokens, ref_logits = reference
    chain = pool.chain(cut)
    chain.open(1, 0)
    try:
        tokens, logits = chain.greedy(1, 0, PROMPT, N_DECODE)
    finally:
        chain.close(1, 0)
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    for step, (got, want) in enumerate(zip(logits, ref_logits, strict=True)):
        assert np.array_equal(got, want), f"cut {cut}: logits differ at step {step}"


def test_boundary_rows_are_the_raw_residual_width(pool: EnginePool) -> None:
    chain = pool.chain((0, 2, 4))
    first = chain.engines[0]
    assert first.info.out_width == first.info.n_embd
    assert chain.engines[1].info.in_width == first.info.n_embd
    assert chain.engines[1].info.out_width == first.info.n_vocab


def test_interleaved_sessions_equal_each_alone(
    pool: EnginePool, reference: tuple[list[int], list[np.ndarray]]
) -> None:
    chain = pool.chain((0, 1, 3, 4))
    other_prompt = [int(t) for t in (np.arange(11) * 13 + 5) % 256]
    alone = pool.chain((0, 4))
    alone.open(50, 0)
    other_tokens_alone, other_logits_alone = alone.greedy(50, 0, other_prompt, 12)
    alone.close(50, 0)

    chain.open(2, 0)
    chain.open(3, 0)
    try:
        hist = {2: list(PROMPT), 3: list(other_prompt)}
        got: dict[int, list[np.ndarray]] = {
            2: [chain.forward(2, 0, hist[2], 0, all_logits=True)],
            3: [chain.forward(3, 0, hist[3], 0, all_logits=True)],
        }
        for _ in range(12):
            for sid in (3, 2):  # alternate which session goes first
                token = int(np.argmax(got[sid][-1][-1]))
                got[sid].append(chain.forward(sid, 0, [token], len(hist[sid])))
                hist[sid].append(token)
    finally:
        chain.close(2, 0)
        chain.close(3, 0)
    ref_tokens, ref_logits = reference
    assert hist[2][len(PROMPT) :] == ref_tokens[:12]
    assert hist[3][len(other_prompt) :] == other_tokens_alone
    for got_l, want_l in zip(got[2], ref_logits[:13], strict=True):
        assert np.array_equal(got_l, want_l)
    for got_l, want_l in zip(got[3], other_logits_alone, strict=True):
        assert np.array_equal(got_l, want_l)


def test_newer_epoch_reprefill_equals_first_run(
    pool: EnginePool, reference: tuple[list[int], list[np.ndarray]]
) -> None:
    chain = pool.chain((0, 2, 3, 4))
    ref_tokens, ref_logits = reference
    chain.open(7, 0)
    tokens0, _ = chain.greedy(7, 0, PROMPT, 5)
    assert tokens0 == ref_tokens[:5]
    # route change: cache miss, re-prefill prompt + accepted tokens under epoch 1
    chain.open(7, 1)
    for engine in chain.engines:
        assert engine.next_pos(7, 1) == 0
    tokens1, logits1 = chain.greedy(7, 1, PROMPT, N_DECODE - 5, accepted=tokens0)
    chain.close(7, 1)
    assert tokens0 + tokens1 == ref_tokens
    # prefill, replayed steps and the decode after them equal the first run's logits exactly
    assert len(logits1) == len(ref_logits)
    for step, (got, want) in enumerate(zip(logits1, ref_logits, strict=True)):
        assert np.array_equal(got, want), f"re-prefill differs at step {step}"


def test_state_save_load_round_trip(
    pool: EnginePool, reference: tuple[list[int], list[np.ndarray]]
) -> None:
    chain = pool.chain((0, 1, 4))
    ref_tokens, ref_logits = reference
    chain.open(11, 0)
    chain.forward(11, 0, PROMPT, 0)
    saved = [engine.save_state(11, 0) for engine in chain.engines]
    assert all(s[:4] == b"DGRS" for s in saved)
    # continue the original, then restore the saved state into a fresh session and replay
    chain.forward(11, 0, ref_tokens[:3], len(PROMPT))
    chain.open(12, 0)
    for engine, state in zip(chain.engines, saved, strict=True):
        engine.load_state(12, 0, state)
        assert engine.next_pos(12, 0) == len(PROMPT)
    for i in range(4):
        got = chain.forward(12, 0, [ref_tokens[i]], len(PROMPT) + i)
        assert np.array_equal(got, ref_logits[1 + i])
    chain.close(11, 0)
    chain.close(12, 0)


def test_truncate_then_continue_matches(
    pool: EnginePool, reference: tuple[list[int], list[np.ndarray]]
) -> None:
    chain = pool.chain((0, 3, 4))
    ref_tokens, ref_logits = reference
    chain.open(13, 0)
    chain.forward(13, 0, PROMPT, 0)
    for i in range(6):  # the same batching as the reference run
        chain.forward(13, 0, [ref_tokens[i]], len(PROMPT) + i)
    for engine in chain.engines:
        engine.truncate(13, 0, len(PROMPT) + 2)
        assert engine.next_pos(13, 0) == len(PROMPT) + 2
    got = chain.forward(13, 0, [ref_tokens[2]], len(PROMPT) + 2)
    chain.close(13, 0)
    assert np.array_equal(got, ref_logits[3])


def test_shard_memory_adds_up_to_the_whole_model(tiny_llama: Path) -> None:
    """Weights and KV of the stages of an untied model add up exactly to the whole model's:
    no shard allocates a tensor or a KV layer it does not own."""
    cut = [(0, 1), (1, 2), (2, 4)]
    with ShardEngine(tiny_llama, **ENGINE_KW) as whole:
        total = whole.stats()
    parts = []
    for rng in cut:
        with ShardEngine(tiny_llama, layers=rng, **ENGINE_KW) as engine:
            parts.append(engine.stats())
    assert sum(p.weight_bytes for p in parts) == total.weight_bytes
    assert sum(p.kv_bytes for p in parts) == total.kv_bytes
    assert parts[1].weight_bytes < parts[0].weight_bytes  # no embedding, no head in the middle
