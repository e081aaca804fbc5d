"""DeepSeek V4 stages chained equal the whole model bit for bit, on the real engine.

tiny-v4 has 6 layers, compress ratios (0, 4, 128, 4, 0, 128), hash-routed layers 0-2 and a
sliding window of 32. Its prompts are 300 tokens: past the window, past 75 CSA blocks (ratio 4,
with the indexer picking its top 8 of them) and two HCA blocks (ratio 128). Every cut of tiny-v4
is run (32 chains of 1-6 stages, cut points inside the hash-routed layers at 1 and 2, at their end
at 3 and after them at 4 and 5); v4-12 runs chains of 11 and 12 stages.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine import errors as E
from dgr_engine.fixtures import FIXTURES, ensure_fixture
from dgr_engine.reference import InProcessRoute

TINY = FIXTURES["tiny-v4"]
N_LAYER = TINY.n_layer
HASH_LAYERS = TINY.hash_layer_count
PROMPT = [int(t) for t in np.random.default_rng(4).integers(0, TINY.n_vocab, 300)]
OTHER_PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, TINY.n_vocab, 170)]
N_DECODE = 32
# One compute thread: robust on a shared 2-core CI (OpenMP spin-waits of 2 threads on a busy
# machine made single chains 10-100x slower); whole model and stages use the same setting.
ENGINE_KW = {"max_sessions": 3, "n_ctx_per_session": 512, "n_threads": 1, "n_batch": 512}

Run = tuple[list[int], list[np.ndarray]]


def all_cuts(n_layer: int) -> list[tuple[int, ...]]:
    """Every way to cut [0, n_layer) into contiguous stages, as boundary tuples."""
    return [
        (0, *inner, n_layer)
        for n_inner in range(n_layer)
        for inner in itertools.combinations(range(1, n_layer), n_inner)
    ]


class EnginePool:
    """One engine per distinct range, shared by every cut."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.engines: dict[tuple[int, int], ShardEngine] = {}

    def engine(self, rng: tuple[int, int]) -> ShardEngine:
        if rng not in self.engines:
            self.engines[rng] = ShardEngine(self.path, layers=rng, **ENGINE_KW)
        return self.engines[rng]

    def chain(self, cut: tuple[int, ...]) -> InProcessRoute:
        return InProcessRoute([self.engine(r) for r in zip(cut[:-1], cut[1:], strict=True)])

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def greedy(chain: InProcessRoute, session_id: int, prompt: list[int], n_steps: int) -> Run:
    chain.open(session_id, 0)
    try:
        return chain.greedy(session_id, 0, prompt, n_steps)
    finally:
        chain.close(session_id, 0)


def assert_same_run(got: Run, want: Run, what: str) -> None:
    assert got[0] == want[0], f"{what}: tokens differ"
    assert len(got[1]) == len(want[1])
    for step, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
        assert np.array_equal(a, b), f"{what}: logits differ at step {step}"


@pytest.fixture(scope="module")
def tiny_v4() -> Path:
    return ensure_fixture("tiny-v4")


@pytest.fixture(scope="module")
def v4_12() -> Path:
    return ensure_fixture("v4-12")


@pytest.fixture(scope="module")
def pool(tiny_v4: Path) -> Iterator[EnginePool]:
    p = EnginePool(tiny_v4)
    yield p
    p.close()


@pytest.fixture(scope="module")
def reference(pool: EnginePool) -> Run:
    return greedy(pool.chain((0, N_LAYER)), 999, PROMPT, N_DECODE)


def test_fixture_shape_covers_the_v4_features() -> None:
    assert TINY.hc_mult == 4 and HASH_LAYERS >= 2
    assert {0, 4, 128} <= set(TINY.compress_ratios)
    assert len(PROMPT) >= 300 and len(PROMPT) > 2 * 128 and len(PROMPT) > TINY.n_swa
    assert len(PROMPT) // 4 > TINY.indexer_top_k  # the indexer really selects
    assert len(all_cuts(N_LAYER)) == 2 ** (N_LAYER - 1)


def test_reference_is_a_real_decode(reference: Run) -> None:
    tokens, logits = reference
    assert len(tokens) == N_DECODE and len(set(tokens)) > 4
    assert logits[0].shape == (len(PROMPT), TINY.n_vocab)
    assert all(np.isfinite(x).all() for x in logits)


@pytest.mark.parametrize("cut", all_cuts(N_LAYER), ids=lambda c: "-".join(map(str, c)))
def test_chain_equals_whole_model(pool: EnginePool, reference: Run, cut: tuple[int, ...]) -> None:
    assert_same_run(greedy(pool.chain(cut), 1, PROMPT, N_DECODE), reference, f"cut {cut}")


def test_stage_widths_and_token_id_needs(pool: EnginePool) -> None:
    width = TINY.hc_mult * TINY.n_embd
    for begin, end in itertools.combinations(range(N_LAYER + 1), 2):
        info = pool.engine((begin, end)).info
        assert info.arch == "deepseek4" and info.n_layer == N_LAYER
        assert info.in_width == (0 if begin == 0 else width)
        assert info.out_width == (TINY.n_vocab if end == N_LAYER else width)
        assert info.needs_token_ids == (begin < HASH_LAYERS), (begin, end)
        assert info.mtp_owner == (end == N_LAYER)


def test_later_stage_routes_hash_layers_by_the_token_ids_it_gets(pool: EnginePool) -> None:
    """Wrong token ids change the output of a stage that owns hash-routed layers; a stage that
    owns none ignores them (the ids really ride with the rows, none is guessed)."""
    first, hashed, plain = pool.engine((0, 1)), pool.engine((1, 4)), pool.engine((3, 6))
    tokens = np.asarray(PROMPT[:40], dtype=np.int32)
    shifted = (tokens + 1) % TINY.n_vocab
    positions = np.arange(40)
    first.open_session(30, 0)
    rows = first.forward(30, 0, positions, tokens=tokens)
    first.close_session(30, 0)
    outs = []
    for toks in (tokens, shifted):
        hashed.open_session(31, 0)
        outs.append(hashed.forward(31, 0, positions, rows=rows, tokens=toks))
        hashed.close_session(31, 0)
    assert not np.array_equal(outs[0], outs[1])
    plain_outs = []
    for toks in (tokens, shifted, None):
        plain.open_session(32, 0)
        plain_outs.append(plain.forward(32, 0, positions, rows=outs[0], tokens=toks))
        plain.close_session(32, 0)
    assert np.array_equal(plain_outs[0], plain_outs[1])
    assert np.array_equal(plain_outs[0], plain_outs[2])


def test_ten_plus_stage_chains_on_v4_12(v4_12: Path) -> None:
    spec = FIXTURES["v4-12"]
    n = spec.n_layer
    pool = EnginePool(v4_12)
    try:
        reference = greedy(pool.chain((0, n)), 999, PROMPT, N_DECODE)
        for cut in (tuple(range(n + 1)), (0, 2, *range(3, n + 1))):
            assert len(cut) - 1 >= 10
            assert_same_run(greedy(pool.chain(cut), 1, PROMPT, N_DECODE), reference, f"{cut}")
    finally:
        pool.close()


def test_interleaved_sessions_equal_each_alone(pool: EnginePool, reference: Run) -> None:
    chain = pool.chain((0, 2, 4, 6))
    other_ref = greedy(pool.chain((0, N_LAYER)), 50, OTHER_PROMPT, N_DECODE)
    chain.open(2, 0)
    chain.open(3, 0)
    try:
        hist = {2: list(PROMPT), 3: list(OTHER_PROMPT)}
        got: dict[int, list[np.ndarray]] = {
            3: [chain.forward(3, 0, hist[3], 0, all_logits=True)],
            2: [chain.forward(2, 0, hist[2], 0, all_logits=True)],
        }
        for step in range(N_DECODE):
            for sid in (3, 2) if step % 2 else (2, 3):  # alternate which session goes first
                token = int(np.argmax(got[sid][-1][-1]))
                got[sid].append(chain.forward(sid, 0, [token], len(hist[sid])))
                hist[sid].append(token)
    finally:
        chain.close(2, 0)
        chain.close(3, 0)
    assert_same_run((hist[2][len(PROMPT) :], got[2]), reference, "session 2")
    assert_same_run((hist[3][len(OTHER_PROMPT) :], got[3]), other_ref, "session 3")


def test_newer_epoch_reprefill_equals_first_run(pool: EnginePool, reference: Run) -> None:
    chain = pool.chain((0, 1, 3, 6))
    chain.open(7, 0)
    tokens0, _ = chain.greedy(7, 0, PROMPT, 5)
    assert tokens0 == reference[0][:5]
    # route change: cache miss, re-prefill prompt + accepted tokens under epoch 1
    chain.open(7, 1)
    for engine in chain.engines:
        assert engine.next_pos(7, 1) == 0
    tokens1, logits1 = chain.greedy(7, 1, PROMPT, N_DECODE - 5, accepted=tokens0)
    chain.close(7, 1)
    assert_same_run((tokens0 + tokens1, logits1), reference, "epoch 1")


def test_state_save_load_round_trip(pool: EnginePool, reference: Run) -> None:
    chain = pool.chain((0, 1, 4, 6))
    ref_tokens, ref_logits = reference
    chain.open(11, 0)
    chain.open(12, 0)
    try:
        chain.forward(11, 0, PROMPT, 0)
        saved = [engine.save_state(11, 0) for engine in chain.engines]
        chain.forward(11, 0, ref_tokens[:3], len(PROMPT))
        for engine, state in zip(chain.engines, saved, strict=True):
            engine.load_state(12, 0, state)
            assert engine.next_pos(12, 0) == len(PROMPT)
        for i in range(4):
            got = chain.forward(12, 0, [ref_tokens[i]], len(PROMPT) + i)
            assert np.array_equal(got, ref_logits[1 + i])
    finally:
        chain.close(11, 0)
        chain.close(12, 0)


@pytest.mark.parametrize(
    "cut",
    [(0, 3, 6), (0, 1, 2, 3, 4, 5, 6), (0, 2, 4, 5, 6)],
    ids=lambda c: "-".join(map(str, c)),
)
def test_shard_state_and_weights_add_up_to_the_whole_model(
    tiny_v4: Path, cut: tuple[int, ...]
) -> None:
    """KV, CSA/HCA, indexer, compressor and SWA state (kv_bytes) and weights of the stages add
    up exactly to the whole model's: no shard allocates a layer it does not own (stages [0, 1)
    and [4, 5) have no compressed layer, [2, 3) no indexer)."""
    with ShardEngine(tiny_v4, **ENGINE_KW) as whole:
        total = whole.stats()
    parts = []
    for rng in zip(cut[:-1], cut[1:], strict=True):
        with ShardEngine(tiny_v4, layers=rng, **ENGINE_KW) as engine:
            parts.append(engine.stats())
    assert sum(p.kv_bytes for p in parts) == total.kv_bytes
    assert sum(p.weight_bytes for p in parts) == total.weight_bytes
    assert all(p.kv_bytes > 0 for p in parts)


def test_v4_state_drops_only_the_newest_rows_of_the_last_call_once(
    pool: EnginePool, reference: Run
) -> None:
    """DeepSeek V4 state drops a tail only from its snapshots (llama.cpp n_rs_seq): at most
    DGR_V4_ROLLBACK_ROWS rows of the last forward call, once; anything deeper is refused with
    nothing changed. What it keeps is bit for bit the state plain decoding has there, and a full
    reset still works."""
    chain = pool.chain((0, 2, 6))
    chain.open(13, 0)
    try:
        chain.forward(13, 0, PROMPT, 0)
        for engine in chain.engines:
            with pytest.raises(E.UnsupportedFeature, match="cannot be truncated"):
                engine.truncate(13, 0, len(PROMPT) - 17)  # deeper than the snapshots
            assert engine.next_pos(13, 0) == len(PROMPT)
            engine.truncate(13, 0, len(PROMPT))  # keeping everything is a no-op
        got = chain.forward(13, 0, [reference[0][0], 7, 9], len(PROMPT), all_logits=True)
        assert np.array_equal(got[0], reference[1][1][-1])
        for engine in chain.engines:
            engine.truncate(13, 0, len(PROMPT) + 1)  # the two rows after the first: dropped
            with pytest.raises(E.UnsupportedFeature, match="cannot be truncated"):
                engine.truncate(13, 0, len(PROMPT))  # once: the snapshots are spent
            assert engine.next_pos(13, 0) == len(PROMPT) + 1
        got = chain.forward(13, 0, [reference[0][1]], len(PROMPT) + 1)
        assert np.array_equal(got, reference[1][2])
        for engine in chain.engines:
            engine.truncate(13, 0, 0)
        tokens, logits = chain.greedy(13, 0, PROMPT, 2)
        assert tokens == reference[0][:2]
        assert np.array_equal(logits[0], reference[1][0])
    finally:
        chain.close(13, 0)
