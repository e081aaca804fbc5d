"""DeepSeek V4's MTP block as a draft source on the last stage (the ownership contract in
``docs/speculative.md``): only the last shard loads it, and only of a model that has one; its
drafts are deterministic, change nothing in the session, are the same whether the route has one
stage or two and however the rows were chunked (the block pairs each token with the previous
position's hidden state, as llama.cpp's draft-mtp drives it); plain decoding keeps its bits with
the block loaded; and drafts verified by the route keep the tokens of plain greedy decoding."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine import errors as E
from dgr_engine.fixtures import ensure_fixture

KW: dict[str, Any] = {"max_sessions": 2, "n_ctx_per_session": 96, "n_threads": 1, "n_batch": 32}
PROMPT = np.array([17, 4, 99, 230, 5, 61, 17, 4, 99, 12], dtype=np.int32)
N_LAYER = 6
SPLIT = 3


@pytest.fixture(scope="module")
def v4_mtp() -> Path:
    return ensure_fixture("tiny-v4-mtp")


@pytest.fixture(scope="module")
def tiny_v4() -> Path:
    return ensure_fixture("tiny-v4")


class Chain:
    """Stages run in order in this process: token ids into the first, boundary rows after it;
    every stage gets the token ids (the MTP owner embeds them)."""

    def __init__(self, engines: Sequence[ShardEngine]) -> None:
        self.engines = list(engines)
        self.last = self.engines[-1]

    def open(self, sid: int, epoch: int) -> None:
        for e in self.engines:
            e.open_session(sid, epoch)

    def forward(self, sid: int, epoch: int, tokens: Sequence[int], want: Any = None) -> Any:
        toks = np.asarray(tokens, dtype=np.int32)
        start = self.last.next_pos(sid, epoch)
        pos = np.arange(start, start + len(toks), dtype=np.int32)
        rows = None
        for e in self.engines:
            give = toks if e.info.needs_token_ids else None
            if e.info.is_last:
                return e.forward(sid, epoch, pos, tokens=give, rows=rows, want=want)
            rows = e.forward(sid, epoch, pos, tokens=give, rows=rows)
        raise AssertionError("no last stage")

    def truncate(self, sid: int, epoch: int, n_keep: int) -> None:
        for e in self.engines:
            e.truncate(sid, epoch, n_keep)

    def close(self) -> None:
        for e in self.engines:
            e.close()


def chain(path: Path, split: bool, mtp: bool) -> Chain:
    if not split:
        return Chain([ShardEngine(path, load_mtp=mtp, **KW)])
    return Chain(
        [
            ShardEngine(path, layers=(0, SPLIT), **KW),
            ShardEngine(path, layers=(SPLIT, N_LAYER), load_mtp=mtp, **KW),
        ]
    )


@pytest.fixture()
def whole(v4_mtp: Path) -> Iterator[Chain]:
    c = chain(v4_mtp, split=False, mtp=True)
    yield c
    c.close()


@pytest.fixture()
def split(v4_mtp: Path) -> Iterator[Chain]:
    c = chain(v4_mtp, split=True, mtp=True)
    yield c
    c.close()


def prefill(c: Chain, sid: int = 1, epoch: int = 0) -> int:
    """Opens the session, forwards the prompt and returns the greedy next token."""
    c.open(sid, epoch)
    return int(np.argmax(c.forward(sid, epoch, PROMPT)[-1]))


# -- who loads the block -----------------------------------------------------------------------


def test_only_the_last_shard_loads_the_mtp_block(v4_mtp: Path) -> None:
    for layers in [(0, SPLIT), (0, N_LAYER - 1), (2, 4)]:
        with pytest.raises(E.UnsupportedFeature, match="belongs to the last shard"):
            ShardEngine(v4_mtp, layers=layers, load_mtp=True, **KW)
    with ShardEngine(v4_mtp, layers=(SPLIT, N_LAYER), load_mtp=True, **KW) as last:
        assert last.info.mtp_owner and last.mtp_loaded and last.info.is_last
        # the block embeds the token of every row it catches up on
        assert last.info.needs_token_ids and last.info.in_width == 4 * last.info.n_embd
    with ShardEngine(v4_mtp, layers=(SPLIT, N_LAYER), **KW) as plain:
        assert plain.info.mtp_owner and not plain.mtp_loaded and not plain.info.needs_token_ids


def test_a_model_without_an_mtp_block_is_refused(tiny_v4: Path, tiny_llama: Path) -> None:
    for path in (tiny_v4, tiny_llama):
        with pytest.raises(E.UnsupportedFeature, match="has no MTP block"):
            ShardEngine(path, load_mtp=True, **KW)


def test_drafting_without_the_block_is_refused_and_changes_nothing(v4_mtp: Path) -> None:
    with ShardEngine(v4_mtp, **KW) as engine:
        engine.open_session(1, 0)
        engine.forward(1, 0, np.arange(4), tokens=PROMPT[:4])
        with pytest.raises(E.UnsupportedFeature, match="no MTP block"):
            engine.mtp_draft(1, 0, 5, 3)
        assert engine.next_pos(1, 0) == 4


def test_bad_draft_requests_are_typed_refusals(split: Chain) -> None:
    token = prefill(split)
    last = split.last
    with pytest.raises(E.InvalidArgument, match="outside the vocabulary"):
        last.mtp_draft(1, 0, 256, 2)
    with pytest.raises(E.InvalidArgument, match="negative"):
        last.mtp_draft(1, 0, token, -1)
    with pytest.raises(E.UnknownSession):
        last.mtp_draft(2, 0, token, 2)
    with pytest.raises(E.ShapeMismatch, match="token ids"):
        last.forward(1, 0, [len(PROMPT)], rows=np.zeros((1, last.info.in_width), np.float32))
    assert last.mtp_draft(1, 0, token, 0) == []
    assert last.next_pos(1, 0) == len(PROMPT)


# -- what the drafts are -----------------------------------------------------------------------


def test_drafts_are_deterministic_and_change_nothing(v4_mtp: Path, split: Chain) -> None:
    token = prefill(split)
    first = split.last.mtp_draft(1, 0, token, 6)
    assert len(first) == 6 and all(0 <= t < 256 for t in first)
    assert split.last.mtp_draft(1, 0, token, 6) == first
    assert split.last.mtp_draft(1, 0, token, 3) == first[:3]  # each draft feeds the next
    assert split.last.mtp_draft(1, 0, (token + 1) % 256, 6) != first  # it reads the token
    assert split.last.next_pos(1, 0) == len(PROMPT)
    # a fresh route gives the same drafts, and the logits after drafting are plain decoding's
    other = chain(v4_mtp, split=True, mtp=True)
    try:
        assert prefill(other) == token
        assert other.last.mtp_draft(1, 0, token, 6) == first
    finally:
        other.close()
    plain = chain(v4_mtp, split=True, mtp=False)
    try:
        assert prefill(plain) == token
        a = split.forward(1, 0, [token, *first[:2]], want=np.ones(3))
        b = plain.forward(1, 0, [token, *first[:2]], want=np.ones(3))
        assert np.array_equal(a, b)  # same bits: the block reads the target, never writes it
    finally:
        plain.close()


def test_drafts_are_the_same_on_one_stage_and_on_two(whole: Chain, split: Chain) -> None:
    token = prefill(whole)
    assert prefill(split) == token
    assert whole.last.mtp_draft(1, 0, token, 5) == split.last.mtp_draft(1, 0, token, 5)


def test_drafts_do_not_depend_on_how_the_rows_were_chunked(whole: Chain, v4_mtp: Path) -> None:
    """Row i of a call pairs with the hidden state of row i - 1, the first row with the last
    row of the call before (llama.cpp's pending_h): one call or one call per row, same drafts."""
    token = prefill(whole)
    one_by_one = chain(v4_mtp, split=True, mtp=True)
    try:
        one_by_one.open(1, 0)
        for t in PROMPT:
            logits = one_by_one.forward(1, 0, [int(t)])
        assert int(np.argmax(logits[-1])) == token
        assert one_by_one.last.mtp_draft(1, 0, token, 5) == whole.last.mtp_draft(1, 0, token, 5)
    finally:
        one_by_one.close()


def test_a_new_epoch_and_a_truncation_to_zero_start_the_block_afresh(split: Chain) -> None:
    token = prefill(split)
    drafts = split.last.mtp_draft(1, 0, token, 4)
    split.truncate(1, 0, 0)
    assert int(np.argmax(split.forward(1, 0, PROMPT)[-1])) == token
    assert split.last.mtp_draft(1, 0, token, 4) == drafts
    split.open(1, 1)  # cache miss: the new epoch starts empty, the block too
    assert int(np.argmax(split.forward(1, 1, PROMPT)[-1])) == token
    assert split.last.mtp_draft(1, 1, token, 4) == drafts


def test_a_loaded_state_loses_the_mtp_inputs_until_a_new_epoch(split: Chain) -> None:
    token = prefill(split)
    state = split.last.save_state(1, 0)
    split.last.load_state(1, 0, state)
    with pytest.raises(E.UnsupportedFeature, match="MTP inputs were lost"):
        split.last.mtp_draft(1, 0, token, 2)
    split.open(1, 1)
    assert int(np.argmax(split.forward(1, 1, PROMPT)[-1])) == token
    assert len(split.last.mtp_draft(1, 1, token, 2)) == 2


def test_drafts_stop_where_the_context_ends(v4_mtp: Path) -> None:
    with ShardEngine(v4_mtp, load_mtp=True, **KW) as engine:
        engine.open_session(1, 0)
        logits = engine.forward(1, 0, np.arange(len(PROMPT)), tokens=PROMPT)
        room = engine.info.n_ctx_per_session - len(PROMPT)  # llama.cpp pads the context
        drafts = engine.mtp_draft(1, 0, int(np.argmax(logits[-1])), room + 5)
        assert len(drafts) == room and engine.next_pos(1, 0) == len(PROMPT)


# -- drafts verified by the route ---------------------------------------------------------------


def greedy(c: Chain, n: int) -> list[int]:
    c.open(1, 0)
    out = [int(np.argmax(c.forward(1, 0, PROMPT)[-1]))]
    while len(out) < n:
        out.append(int(np.argmax(c.forward(1, 0, [out[-1]])[-1])))
    return out


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_verified_by_the_route_keep_plain_greedy_tokens(
    v4_mtp: Path, split: Chain, k: int
) -> None:
    """A pass forwards the last token and k MTP drafts, keeps the longest prefix greedy decoding
    gives, and drops the rest (V4 state drops a tail only to 0 on this build: the kept history is
    re-forwarded, which the block follows)."""
    n = 14
    plain = chain(v4_mtp, split=True, mtp=False)
    try:
        expected = greedy(plain, n)
    finally:
        plain.close()
    history = [int(t) for t in PROMPT]
    out = [prefill(split)]
    proposed = accepted = 0
    while len(out) < n:
        drafts = split.last.mtp_draft(1, 0, out[-1], k)
        logits = split.forward(1, 0, [out[-1], *drafts], want=np.ones(1 + len(drafts)))
        best = [int(t) for t in np.argmax(logits, axis=1)]
        keep = 0
        while keep < len(drafts) and drafts[keep] == best[keep]:
            keep += 1
        proposed, accepted = proposed + len(drafts), accepted + keep
        history += [out[-1], *drafts[:keep]]
        out += [*drafts[:keep], best[keep]]
        if keep < len(drafts):
            split.truncate(1, 0, 0)
            split.forward(1, 0, history)
        assert split.last.next_pos(1, 0) == len(history)
    assert out[:n] == expected
    assert proposed >= k * 4  # random weights: acceptance says nothing, the tokens everything


# -- drafting as from the kept position (the route's last stage, before the next frame) ----------


def pass_with_rejects(c: Chain, token: int, drafts: list[int]) -> tuple[int, list[int]]:
    """One verification pass of ``token`` and ``drafts``; returns (kept drafts, greedy)."""
    logits = c.forward(1, 0, [token, *drafts], want=np.ones(1 + len(drafts)))
    best = [int(t) for t in np.argmax(logits, axis=1)]
    keep = 0
    while keep < len(drafts) and drafts[keep] == best[keep]:
        keep += 1
    return keep, best


def test_drafting_as_from_the_kept_position_equals_drafting_after_the_truncation(
    v4_mtp: Path, split: Chain
) -> None:
    token = prefill(split)
    base = len(PROMPT)
    wrong = [(token + 7) % 256, 3, 9]  # the first draft is wrong: nothing kept
    reference = chain(v4_mtp, split=True, mtp=True)
    try:
        assert prefill(reference) == token
        for c in (split, reference):
            keep, best = pass_with_rejects(c, token, wrong)
        assert keep == 0
        nxt = best[0]
        # the reference truncates first, then drafts from the next position
        reference.truncate(1, 0, base + 1)
        expected = reference.last.mtp_draft(1, 0, nxt, 4)
        # the stage drafts as from the kept position before anything is truncated
        got = split.last.mtp_draft(1, 0, nxt, 4, n_keep=base + 1)
        assert got == expected
        assert split.last.next_pos(1, 0) == base + 4  # the main KV keeps every row until then
        # drafting from the next position is refused until the session is truncated to it
        with pytest.raises(E.UnsupportedFeature, match="drafted as from position"):
            split.last.mtp_draft(1, 0, nxt, 2)
        assert split.last.mtp_draft(1, 0, nxt, 4, n_keep=base + 1) == expected  # repeatable
        split.truncate(1, 0, base + 1)  # the frame's truncation: the MTP state stays right
        assert split.last.mtp_draft(1, 0, nxt, 4) == expected
        # and the next pass goes on as plain decoding
        for c in (split, reference):
            keep, best = pass_with_rejects(c, nxt, expected[:2])
        assert split.last.mtp_draft(1, 0, best[keep], 3, n_keep=base + 2 + keep) == (
            reference.last.mtp_draft(1, 0, best[keep], 3, n_keep=base + 2 + keep)
        )
    finally:
        reference.close()


def test_bad_kept_positions_are_refused_and_change_nothing(split: Chain) -> None:
    token = prefill(split)
    base = len(PROMPT)
    keep, best = pass_with_rejects(split, token, [(token + 7) % 256, 3])
    drafts = split.last.mtp_draft(1, 0, best[keep], 3, n_keep=base + 1 + keep)
    for n_keep in (0, -1, base + 4):
        with pytest.raises(E.PositionMismatch):
            split.last.mtp_draft(1, 0, best[keep], 3, n_keep=n_keep)
    with pytest.raises(E.UnsupportedFeature, match="last forward call"):
        split.last.mtp_draft(1, 0, best[keep], 3, n_keep=base - 1)  # before the pass's rows
    assert split.last.mtp_draft(1, 0, best[keep], 3, n_keep=base + 1 + keep) == drafts
    assert split.last.next_pos(1, 0) == base + 3


def test_a_forward_without_the_truncation_loses_the_mtp_inputs(split: Chain) -> None:
    token = prefill(split)
    base = len(PROMPT)
    keep, best = pass_with_rejects(split, token, [(token + 7) % 256, 3])
    split.last.mtp_draft(1, 0, best[keep], 2, n_keep=base + 1)
    split.forward(1, 0, [best[keep]])  # the session went on from base + 3, not from base + 1
    with pytest.raises(E.UnsupportedFeature, match="MTP inputs were lost"):
        split.last.mtp_draft(1, 0, 5, 2)
