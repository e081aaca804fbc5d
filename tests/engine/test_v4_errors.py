"""Bad input to DeepSeek V4 stages gets a typed error and loses nothing.

A 3-stage tiny-v4 chain: [0, 1) takes tokens, [1, 4) owns hash-routed layers 1 and 2 (so its
boundary rows need the token ids), [4, 6) owns none. Session 1 decodes step by step; before a step
reaches the middle stage, a bad call is made on that very session (and stage), then the step goes
on with the right input and must equal the whole model's logits bit for bit. A second session
(2) keeps decoding in the same engines and must match too: neither the refused session nor the
engine is harmed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine import errors as E
from dgr_engine.fixtures import FIXTURES, ensure_fixture
from dgr_engine.reference import InProcessRoute

SPEC = FIXTURES["tiny-v4"]
PROMPT = [int(t) for t in np.random.default_rng(4).integers(0, SPEC.n_vocab, 300)]
OTHER_PROMPT = [int(t) for t in np.random.default_rng(6).integers(0, SPEC.n_vocab, 40)]
KW = {"max_sessions": 3, "n_ctx_per_session": 512, "n_threads": 1, "n_batch": 512}
WIDTH = SPEC.hc_mult * SPEC.n_embd

BadCall = Callable[[np.ndarray, int, int], object]
"""(boundary rows of this step, position, token) -> a call on the middle stage that must fail."""


class Harness:
    def __init__(self, path: Path) -> None:
        self.first = ShardEngine(path, layers=(0, 1), **KW)
        self.mid = ShardEngine(path, layers=(1, 4), **KW)
        self.last = ShardEngine(path, layers=(4, 6), **KW)
        self.chain = InProcessRoute([self.first, self.mid, self.last])
        with ShardEngine(path, **KW) as whole:
            ref = InProcessRoute([whole])
            ref.open(1, 0)
            self.ref = ref.greedy(1, 0, PROMPT, 8)
            ref.open(2, 0)
            self.other_ref = ref.greedy(2, 0, OTHER_PROMPT, 8)
        self.steps = {1: 0, 2: 0}
        for sid, prompt in ((1, PROMPT), (2, OTHER_PROMPT)):
            self.chain.open(sid, 0)
            self.chain.forward(sid, 0, prompt, 0)

    def step(
        self,
        sid: int,
        bad: BadCall | None = None,
        exc: type[E.EngineError] | None = None,
        match: str = "",
    ) -> E.EngineError | None:
        """One decode step of session ``sid``; ``bad`` is tried (and must raise ``exc``) on the
        middle stage first. Asserts the step's logits equal the whole model's."""
        prompt, (tokens, logits) = (
            (PROMPT, self.ref) if sid == 1 else (OTHER_PROMPT, self.other_ref)
        )
        k = self.steps[sid]
        token, pos = tokens[k], len(prompt) + k
        rows = self.first.forward(sid, 0, [pos], tokens=[token])
        err = None
        if bad is not None:
            assert exc is not None
            with pytest.raises(exc, match=match) as info:
                bad(rows, pos, token)
            err = info.value
            assert self.mid.next_pos(sid, 0) == pos  # nothing of the refused call was kept
        mid_out = self.mid.forward(sid, 0, [pos], rows=rows, tokens=[token])
        got = self.last.forward(sid, 0, [pos], rows=mid_out)
        self.steps[sid] += 1
        assert np.array_equal(got, logits[k + 1]), f"session {sid} differs at step {k}"
        return err

    def refused(self, bad: BadCall, exc: type[E.EngineError], match: str) -> E.EngineError:
        err = self.step(1, bad, exc, match)
        assert err is not None
        self.step(1)  # the refused session goes on exactly
        self.step(2)  # and so does another session of the same engines
        return err

    def close(self) -> None:
        for engine in self.chain.engines:
            engine.close()


@pytest.fixture(scope="module")
def tiny_v4() -> Path:
    return ensure_fixture("tiny-v4")


@pytest.fixture()
def h(tiny_v4: Path) -> Iterator[Harness]:
    harness = Harness(tiny_v4)
    yield harness
    harness.close()


def test_the_stages_of_the_harness(h: Harness) -> None:
    assert [e.info.needs_token_ids for e in h.chain.engines] == [True, True, False]
    assert h.mid.info.in_width == WIDTH == h.first.info.out_width == h.last.info.in_width


def test_boundary_of_the_wrong_width(h: Harness) -> None:
    """n_embd-wide rows (one residual instead of the 4 hyper-connection streams)."""

    def bad(rows: np.ndarray, pos: int, token: int) -> object:
        return h.mid.forward(1, 0, [pos], rows=rows[:, : SPEC.n_embd], tokens=[token])

    err = h.refused(bad, E.ShapeMismatch, f"width {SPEC.n_embd} does not match .* {WIDTH}")
    assert err.status == "DGR_E_SHAPE"


def test_boundary_of_the_wrong_width_on_a_stage_without_hash_layers(h: Harness) -> None:
    def bad(rows: np.ndarray, pos: int, token: int) -> object:
        wide = np.zeros((1, 2 * WIDTH), dtype=np.float32)
        return h.last.forward(1, 0, [pos], rows=wide)

    h.refused(bad, E.ShapeMismatch, f"width {2 * WIDTH}")
    assert h.last.next_pos(1, 0) == h.mid.next_pos(1, 0)


def test_missing_token_ids_on_a_stage_owning_hash_layers(h: Harness) -> None:
    def bad(rows: np.ndarray, pos: int, token: int) -> object:
        return h.mid.forward(1, 0, [pos], rows=rows)

    err = h.refused(bad, E.ShapeMismatch, r"owns hash-routed layers \[1, 3\).*token ids")
    assert isinstance(err, ValueError) and err.code == 9


def test_token_ids_out_of_vocabulary(h: Harness) -> None:
    for token_id in (SPEC.n_vocab, -1, 1 << 30):

        def bad(rows: np.ndarray, pos: int, token: int, tid: int = token_id) -> object:
            return h.mid.forward(1, 0, [pos], rows=rows, tokens=[tid])

        err = h.refused(bad, E.InvalidArgument, f"token id {token_id} .*vocabulary")
        assert err.status == "DGR_E_INVALID_ARGUMENT"


def test_token_ids_out_of_vocabulary_on_the_first_stage(h: Harness) -> None:
    def bad(rows: np.ndarray, pos: int, token: int) -> object:
        h.first.open_session(9, 0)
        try:
            return h.first.forward(9, 0, [0], tokens=[SPEC.n_vocab])
        finally:
            assert h.first.next_pos(9, 0) == 0
            h.first.close_session(9, 0)

    h.refused(bad, E.InvalidArgument, "vocabulary")


def test_token_count_that_does_not_match_the_rows(h: Harness) -> None:
    def bad(rows: np.ndarray, pos: int, token: int) -> object:
        return h.mid.forward(1, 0, [pos], rows=rows, tokens=[token, token])

    h.refused(bad, E.ShapeMismatch, "2 token ids for 1 positions")


def test_rows_at_the_wrong_position(h: Harness) -> None:
    def bad(rows: np.ndarray, pos: int, token: int) -> object:
        return h.mid.forward(1, 0, [pos + 1], rows=rows, tokens=[token])

    h.refused(bad, E.PositionMismatch, "continues at")


def test_mtp_of_a_model_without_an_mtp_block_is_refused(h: Harness, tiny_v4: Path) -> None:
    def bad(rows: np.ndarray, pos: int, token: int) -> object:
        return ShardEngine(tiny_v4, layers=(4, 6), load_mtp=True, **KW)

    h.refused(bad, E.UnsupportedFeature, "has no MTP block")
    assert h.last.info.mtp_owner and not h.mid.info.mtp_owner and not h.first.info.mtp_owner
