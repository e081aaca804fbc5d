"""Co-batched forwards (``ShardEngine.forward_batch`` over ``dgr_forward_batch``, issue 15
part 2), on the real engine: several sessions' rows in one engine call.

The numerics rule: a co-batched call keeps every micro-batch under 32 rows, where llama.cpp
computes each row's matmuls on their own (patch 0010), and runs larger items alone; so a
session's rows come out in the same bits next to other sessions' rows as alone. Checked here,
bit for bit: co-batched sessions against each session run alone (llama and DeepSeek V4
fixtures), a chain of shards co-batching against the whole model co-batching, and any sequence of
calls (hypothesis) with items refused, small and large; an item refused in a call leaves its
session as it was and the other items run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgr_engine.engine import ForwardItem, ShardEngine
from dgr_engine.errors import InvalidArgument, PositionMismatch, ShapeMismatch, StaleEpoch
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.reference import split_points

OPTIONS = {"max_sessions": 8, "n_ctx_per_session": 128, "n_threads": 1, "n_batch": 64}
PROMPTS = [[1 + s, 5, 9, 13 + s, 2 * s + 3] for s in range(6)]


def greedy_alone(engine: ShardEngine, prompts: list[list[int]], steps: int) -> list[np.ndarray]:
    """Per prompt, the logits of each step with every session run in its own calls."""
    logits = []
    for sid, prompt in enumerate(prompts):
        engine.open_session(sid, 1)
        rows = [engine.forward(sid, 1, np.arange(len(prompt)), tokens=prompt)[-1].copy()]
        for step in range(steps):
            token = int(np.argmax(rows[-1]))
            rows.append(engine.forward(sid, 1, [len(prompt) + step], tokens=[token])[-1].copy())
        engine.close_session(sid, 1)
        logits.append(np.stack(rows))
    return logits


def greedy_co_batched(
    stages: list[ShardEngine], prompts: list[list[int]], steps: int
) -> list[np.ndarray]:
    """The same sessions with every call co-batched across them (prompts included), through
    ``stages`` in order (one engine: the whole model)."""
    for stage in stages:
        for sid in range(len(prompts)):
            stage.open_session(sid, 1)
    tokens = [list(p) for p in prompts]
    at = [0] * len(prompts)
    logits: list[list[np.ndarray]] = [[] for _ in prompts]
    for _ in range(steps + 1):
        rows: list[np.ndarray | None] = [None] * len(prompts)
        for stage in stages:
            items = [
                ForwardItem(
                    sid,
                    1,
                    np.arange(at[sid], len(tokens[sid])),
                    tokens=tokens[sid][at[sid] :],
                    rows=rows[sid],
                )
                for sid in range(len(prompts))
            ]
            outs = stage.forward_batch(items)
            for sid, out in enumerate(outs):
                assert not isinstance(out, Exception), out
                rows[sid] = out
        for sid in range(len(prompts)):
            out = rows[sid]
            assert out is not None
            logits[sid].append(out[-1].copy())
            at[sid] = len(tokens[sid])
            tokens[sid].append(int(np.argmax(out[-1])))
    for stage in stages:
        for sid in range(len(prompts)):
            stage.close_session(sid, 1)
    return [np.stack(rows) for rows in logits]


@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-qwen2", "tiny-v4"])
def test_co_batched_rows_equal_sessions_run_alone(fixture: str) -> None:
    model = ensure_fixture(fixture)
    with ShardEngine(model, **OPTIONS) as whole:
        alone = greedy_alone(whole, PROMPTS[:4], 6)
        together = greedy_co_batched([whole], PROMPTS[:4], 6)
    for a, b in zip(alone, together, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-qwen2", "tiny-v4"])
def test_chain_co_batching_equals_whole_model_co_batching(fixture: str) -> None:
    model = ensure_fixture(fixture)
    with ShardEngine(model, **OPTIONS) as whole:
        n_layer = whole.info.n_layer
        reference = greedy_co_batched([whole], PROMPTS, 5)
    stages = [ShardEngine(model, layers=r, **OPTIONS) for r in split_points(n_layer, 3)]
    try:
        chained = greedy_co_batched(stages, PROMPTS, 5)
    finally:
        for stage in stages:
            stage.close()
    for a, b in zip(reference, chained, strict=True):
        assert np.array_equal(a, b)


def test_a_refused_item_changes_nothing_and_the_others_run(tiny_llama: Path) -> None:
    with ShardEngine(tiny_llama, **OPTIONS) as engine:
        for sid in range(4):
            engine.open_session(sid, 2)
        engine.open_session(9, 3)
        engine.forward(9, 3, [0, 1], tokens=[4, 4])
        items = [
            ForwardItem(0, 2, [0, 1], tokens=[3, 1]),
            ForwardItem(9, 2, [2], tokens=[5]),  # stale epoch
            ForwardItem(1, 2, [5], tokens=[5]),  # wrong position
            ForwardItem(2, 2, [0], tokens=[10_000_000]),  # outside the vocabulary
            ForwardItem(0, 2, [2], tokens=[7]),  # session 0 twice
            ForwardItem(3, 2, [0, 1, 2], tokens=[2, 7, 1]),
        ]
        outs = engine.forward_batch(items)
        assert isinstance(outs[1], StaleEpoch) and outs[1].held_epoch == 3
        assert isinstance(outs[2], PositionMismatch)
        assert isinstance(outs[3], InvalidArgument) and "vocabulary" in str(outs[3])
        assert isinstance(outs[4], InvalidArgument) and "twice" in str(outs[4])
        assert engine.next_pos(9, 3) == 2
        assert engine.next_pos(1, 2) == 0 and engine.next_pos(2, 2) == 0
        assert engine.next_pos(0, 2) == 2 and engine.next_pos(3, 2) == 3
    # the refused items took no part: the same engine layout given only the valid items
    # computes the same bits
    with ShardEngine(tiny_llama, **OPTIONS) as fresh:
        for sid in range(4):
            fresh.open_session(sid, 2)
        fresh.open_session(9, 3)
        again = fresh.forward_batch([items[0], items[5]])
    assert np.array_equal(outs[0], again[0]) and np.array_equal(outs[5], again[1])


def test_too_many_rows_together_run_nothing(tiny_llama: Path) -> None:
    with ShardEngine(tiny_llama, **OPTIONS) as engine:
        engine.open_session(0, 1)
        engine.open_session(1, 1)
        items = [ForwardItem(s, 1, np.arange(40), tokens=np.full(40, 3)) for s in (0, 1)]
        with pytest.raises(ShapeMismatch, match="exceed n_batch 64; nothing ran"):
            engine.forward_batch(items)
        assert engine.next_pos(0, 1) == 0 and engine.next_pos(1, 1) == 0
        assert engine.forward_batch([]) == []


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    calls=st.lists(
        st.lists(
            st.tuples(
                st.integers(0, 5),  # session
                st.sampled_from([1, 1, 2, 3, 4, 33]),  # rows (33: runs in a decode of its own)
                st.booleans(),  # sent with a wrong position (refused)
            ),
            min_size=1,
            max_size=6,
        ),
        min_size=1,
        max_size=4,
    )
)
def test_property_co_batched_rows_equal_alone_and_chain(
    calls: list[list[tuple[int, int, bool]]],
) -> None:
    """Any sequence of co-batched calls, some items refused: the refused items' sessions keep
    their positions; every item that ran has the bits of the same rows run alone, and a 2-shard
    chain co-batching the same items gives them too. A call whose valid items exceed n_batch
    runs nothing."""
    model = ensure_fixture("tiny-llama")
    options = {**OPTIONS, "n_ctx_per_session": 256}
    whole = ShardEngine(model, **options)
    alone = ShardEngine(model, **options)
    n_layer = whole.info.n_layer
    stages = [ShardEngine(model, layers=r, **options) for r in split_points(n_layer, 2)]
    try:
        for engine in (whole, alone, *stages):
            for sid in range(6):
                engine.open_session(sid, 1)
        pos = [0] * 6
        for call in calls:
            items = []
            seen: set[int] = set()
            runs: list[bool] = []
            for sid, n, wrong in call:
                start = pos[sid] + (3 if wrong else 0)
                tokens = [(sid * 7 + start + i) % 50 + 1 for i in range(n)]
                items.append(ForwardItem(sid, 1, np.arange(start, start + n), tokens=tokens))
                runs.append(not wrong and sid not in seen)
                if runs[-1]:
                    seen.add(sid)
            if sum(n for (_, n, _), run in zip(call, runs, strict=True) if run) > 64:
                with pytest.raises(ShapeMismatch):
                    whole.forward_batch(items)
                continue
            expected = whole.forward_batch(items)
            first = stages[0].forward_batch(items)
            second_items = [
                ForwardItem(i.session_id, 1, i.positions, tokens=i.tokens, rows=out)
                for i, out in zip(items, first, strict=True)
                if not isinstance(out, Exception)
            ]
            second = iter(stages[1].forward_batch(second_items))
            for item, run, want, got in zip(items, runs, expected, first, strict=True):
                assert isinstance(want, Exception) != run
                assert isinstance(got, Exception) != run
                if run:
                    out = next(second)
                    assert not isinstance(out, Exception) and not isinstance(want, Exception)
                    assert np.array_equal(out, want)
                    single = alone.forward(item.session_id, 1, item.positions, tokens=item.tokens)
                    assert np.array_equal(single, want)
                    pos[item.session_id] += len(item.tokens)  # type: ignore[arg-type]
            for engine in (whole, alone, *stages):
                for sid in range(6):
                    assert engine.next_pos(sid, 1) == pos[sid]
    finally:
        for engine in (whole, alone, *stages):
            engine.close()
