"""The families beside Llama on the real engine (their converter-made fixtures), through a chain
of shards cut where their seams are: a session keeps its bits with other sessions interleaved
and co-batched, after a state save and load, after a truncation; the shards' KV adds up to the
whole model's. Gemma 3 is cut into a sliding-window-only, a global-only and a sliding-window-only
shard (its layer 5 is global): each shard's sliding-window and global caches cover only the
layers it owns, and a session truncated far behind its window continues correctly."""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine.fixtures import converted
from dgr_engine.reference import InProcessRoute
from tests.engine.test_engine_co_batch import greedy_alone, greedy_co_batched

CUTS = {
    "hf-qwen2-bias": (0, 1, 2, 3),
    "hf-qwen3-qknorm-tied": (0, 2, 3),
    "hf-phi-longrope": (0, 1, 3),  # later shards never own layer 0's rope factors
    "hf-gemma3-swa": (0, 5, 6, 7),  # sliding-window only, global only, sliding-window only
}
KW = {"max_sessions": 4, "n_ctx_per_session": 64, "n_threads": 1, "n_batch": 64}
PROMPTS = [[(7 * s + 11 * i) % 300 + 3 for i in range(12 + 2 * s)] for s in range(4)]
N_DECODE = 10


@attrs.define
class Family:
    """One family's fixture as a whole model and as the chain of its cut."""

    name: str
    whole: ShardEngine
    stages: list[ShardEngine]

    @property
    def chain(self) -> InProcessRoute:
        return InProcessRoute(self.stages)

    def greedy_whole(self, session: int, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
        chain = InProcessRoute([self.whole])
        chain.open(session, 0)
        try:
            return chain.greedy(session, 0, prompt, N_DECODE)
        finally:
            chain.close(session, 0)


@pytest.fixture(scope="module", params=sorted(CUTS))
def family(request: pytest.FixtureRequest) -> Iterator[Family]:
    path = converted.ensure_converted(request.param).gguf
    cut = CUTS[request.param]
    whole = ShardEngine(path, **KW)
    stages = [ShardEngine(path, layers=r, **KW) for r in zip(cut[:-1], cut[1:], strict=True)]
    yield Family(request.param, whole, stages)
    for engine in (whole, *stages):
        engine.close()


def test_interleaved_sessions_equal_each_alone(family: Family) -> None:
    alone = [family.greedy_whole(100 + i, p) for i, p in enumerate(PROMPTS[:2])]
    chain = family.chain
    hist = [list(p) for p in PROMPTS[:2]]
    got: list[list[np.ndarray]] = [[], []]
    for sid in (0, 1):
        chain.open(sid, 0)
    try:
        for sid in (0, 1):
            got[sid].append(chain.forward(sid, 0, hist[sid], 0, all_logits=True))
        for _ in range(N_DECODE - 1):
            for sid in (1, 0):
                token = int(np.argmax(got[sid][-1][-1]))
                got[sid].append(chain.forward(sid, 0, [token], len(hist[sid])))
                hist[sid].append(token)
    finally:
        for sid in (0, 1):
            chain.close(sid, 0)
    for sid, (tokens, logits) in enumerate(alone):
        assert hist[sid][len(PROMPTS[sid]) :] == tokens[:-1]
        for a, b in zip(got[sid], logits, strict=False):
            assert np.array_equal(a, b), family.name


def test_co_batched_sessions_through_the_chain_equal_each_alone_whole(family: Family) -> None:
    alone = greedy_alone(family.whole, PROMPTS, 5)
    together = greedy_co_batched(family.stages, PROMPTS, 5)
    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a, b), family.name


def test_a_saved_state_continues_as_the_original(family: Family) -> None:
    tokens, logits = family.greedy_whole(200, PROMPTS[0])
    chain = family.chain
    chain.open(20, 0)
    chain.open(21, 0)
    try:
        chain.forward(20, 0, PROMPTS[0], 0)
        saved = [stage.save_state(20, 0) for stage in family.stages]
        for stage, state in zip(family.stages, saved, strict=True):
            stage.load_state(21, 0, state)
        for i in range(4):
            got = chain.forward(21, 0, [tokens[i]], len(PROMPTS[0]) + i)
            assert np.array_equal(got, logits[1 + i]), (family.name, i)
    finally:
        chain.close(20, 0)
        chain.close(21, 0)


def test_a_truncated_session_continues_as_the_original(family: Family) -> None:
    tokens, logits = family.greedy_whole(300, PROMPTS[1])
    chain = family.chain
    n = len(PROMPTS[1])
    chain.open(30, 0)
    try:
        chain.forward(30, 0, PROMPTS[1], 0)
        for i in range(6):  # the same batching as the reference run
            chain.forward(30, 0, [tokens[i]], n + i)
        for stage in family.stages:
            stage.truncate(30, 0, n + 2)
        assert np.array_equal(chain.forward(30, 0, [tokens[2]], n + 2), logits[3])
    finally:
        chain.close(30, 0)


def test_the_shards_kv_adds_up_to_the_whole_models(family: Family) -> None:
    whole = family.whole.stats().kv_bytes
    assert sum(stage.stats().kv_bytes for stage in family.stages) == whole > 0


def test_each_gemma_shard_keeps_kv_for_the_layers_it_owns_only() -> None:
    """Layer 5 is Gemma 3's one global layer here. A shard's global and sliding-window caches
    hold its own layers of each kind only ([5, 6): one global layer, an empty sliding-window
    cache; [0, 5): five sliding-window layers, an empty global cache); both caches are
    full-size (llama.cpp's swa_full, which dgr keeps), so every layer costs the same."""
    path = converted.ensure_converted("hf-gemma3-swa").gguf
    per_layer = None
    for rng in ((0, 1), (0, 5), (5, 6), (6, 7), (4, 6), (0, 7)):
        with ShardEngine(path, layers=rng, **KW) as engine:
            size = engine.stats().kv_bytes
        per_layer = per_layer or size
        assert size == (rng[1] - rng[0]) * per_layer, rng


def test_gemma_truncates_past_its_sliding_window() -> None:
    """The sliding-window cache is full-size (swa_full): it keeps the cells of positions that
    left the window, so a session truncated far behind its window continues as a session
    that never went further."""
    path = converted.ensure_converted("hf-gemma3-swa").gguf
    options = {**KW, "max_sessions": 2, "n_ctx_per_session": 320}
    prompt = [(13 * i) % 300 + 3 for i in range(300)]
    with ShardEngine(path, **options) as engine:
        engine.open_session(1, 0)
        engine.open_session(2, 0)
        for start in range(0, 300, 30):  # under 32 rows: each row's bits its own (patch 0010)
            engine.forward(1, 0, np.arange(start, start + 30), tokens=prompt[start : start + 30])
        engine.truncate(1, 0, 40)
        assert engine.next_pos(1, 0) == 40
        engine.forward(2, 0, np.arange(0, 30), tokens=prompt[:30])
        engine.forward(2, 0, np.arange(30, 40), tokens=prompt[30:40])
        after = engine.forward(1, 0, [40], tokens=[7])
        fresh = engine.forward(2, 0, [40], tokens=[7])
    assert np.array_equal(after, fresh)
