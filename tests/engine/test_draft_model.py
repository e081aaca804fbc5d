"""The draft model (``dgr_engine.speculative.ModelDrafter``) on the real engine: a model that is
its own draft proposes exactly the whole model's greedy continuation, through accepted and
rejected drafts, and a draft with another vocabulary is refused."""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import pytest

from dgr_engine.errors import InvalidArgument
from dgr_engine.fixtures import FIXTURES, write_fixture
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_greedy
from dgr_engine.speculative import DraftVocabMismatch, ModelDrafter
from dgr_session.drafts import DraftConfigError, DraftContextFull, Drafter
from tests.harness import PARITY_PROMPT

N_VOCAB = 256
N_TOKENS = 24
_rng = random.Random(3)
PROMPTS = [PARITY_PROMPT] + [
    [_rng.randrange(N_VOCAB) for _ in range(_rng.randrange(3, 40))] for _ in range(3)
]


def greedy(model: Path, prompt: list[int], n: int = N_TOKENS) -> list[int]:
    return whole_model_greedy(model, [prompt], n, EngineOptions())[0]


@pytest.fixture(scope="module")
def references(tiny_llama: Path) -> list[list[int]]:
    return whole_model_greedy(tiny_llama, PROMPTS, N_TOKENS, EngineOptions())


def test_the_references_are_not_one_repeated_token(references: list[list[int]]) -> None:
    assert all(len(set(tokens)) > 3 for tokens in references)


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("n_batch", [5, 64])
def test_a_model_as_its_own_draft_proposes_its_greedy_continuation(
    tiny_llama: Path, references: list[list[int]], k: int, n_batch: int
) -> None:
    """Every draft is accepted (acceptance 1.0): the drafts of each pass are the next greedy
    tokens, then the verifier's own next token follows them into the history."""
    with ModelDrafter(tiny_llama, target_n_vocab=N_VOCAB, n_batch=n_batch) as drafter:
        for prompt, expected in zip(PROMPTS, references, strict=True):
            accepted: list[int] = []
            passes = 0
            while len(accepted) < N_TOKENS:
                drafts = drafter.propose(prompt + accepted, k)
                want = expected[len(accepted) : len(accepted) + k]
                assert len(drafts) == k and list(drafts[: len(want)]) == want, f"pass {passes}"
                accepted += want
                if len(accepted) < N_TOKENS:
                    accepted.append(expected[len(accepted)])  # the verifier's next token
                passes += 1
            assert accepted == expected
            assert passes == -(-N_TOKENS // (k + 1))


def test_after_rejected_drafts_it_resyncs_to_the_new_history(
    tiny_llama: Path, references: list[list[int]]
) -> None:
    """The verifier accepts 2 of 8 drafts and then picks another token than the third draft
    (a divergent history): the next proposal is the greedy continuation of that history."""
    prompt, expected = PROMPTS[0], references[0]
    with ModelDrafter(tiny_llama, target_n_vocab=N_VOCAB) as drafter:
        drafts = drafter.propose(prompt, 8)
        assert list(drafts) == expected[:8]
        other = (drafts[2] + 1) % N_VOCAB
        history = [*prompt, *drafts[:2], other]
        assert list(drafter.propose(history, 6)) == greedy(tiny_llama, history, 6)
        # back to the first history, and a history that is a prefix of the drafter's KV
        assert list(drafter.propose(prompt + expected[:4], 5)) == expected[4:9]
        assert list(drafter.propose(prompt, 3)) == expected[:3]
        assert list(drafter.propose(prompt[:5], 4)) == greedy(tiny_llama, prompt[:5], 4)
        # an unrelated history: nothing in common with what the KV holds
        fresh = [(t * 7 + 3) % N_VOCAB for t in prompt]
        assert list(drafter.propose(fresh, 4)) == greedy(tiny_llama, fresh, 4)


def test_drafts_stop_where_the_context_ends_and_a_longer_history_is_refused(
    tiny_llama: Path,
) -> None:
    history = [(t * 13 + 5) % N_VOCAB for t in range(30)]
    with ModelDrafter(tiny_llama, target_n_vocab=N_VOCAB, n_ctx=32) as drafter:
        # 30 tokens + 2 forwarded drafts fill 32 cells; the third draft is never forwarded
        assert list(drafter.propose(history, 8)) == greedy(tiny_llama, history, 3)
        assert len(drafter.propose(history + [1, 2], 8)) == 1
        with pytest.raises(DraftContextFull, match="33 tokens .* context of 32"):
            drafter.propose(list(range(33)), 1)
        assert list(drafter.propose(history, 2)) == greedy(tiny_llama, history, 2)


def test_no_history_or_no_length_drafts_nothing_and_a_negative_length_is_refused(
    tiny_llama: Path,
) -> None:
    with ModelDrafter(tiny_llama, target_n_vocab=N_VOCAB) as drafter:
        assert isinstance(drafter, Drafter) and drafter.name == "draft-model"
        assert drafter.propose([], 4) == ()
        assert drafter.propose([1, 2, 3], 0) == ()
        with pytest.raises(DraftConfigError, match="k must be >= 0"):
            drafter.propose([1, 2, 3], -1)
    assert drafter.engine.closed
    drafter.close()


def test_a_draft_with_another_vocabulary_is_refused_at_construction(
    tiny_llama: Path, tmp_path: Path
) -> None:
    spec = attrs.evolve(FIXTURES["tiny-llama"], name="tiny-llama-v320", n_vocab=320)
    other = write_fixture(spec, tmp_path / "tiny-llama-v320.gguf")
    with pytest.raises(DraftVocabMismatch) as refused:
        ModelDrafter(other, target_n_vocab=N_VOCAB)
    message = str(refused.value)
    assert "320" in message and "256" in message and "\n" not in message
    assert (refused.value.draft_n_vocab, refused.value.target_n_vocab) == (320, 256)
    assert isinstance(refused.value, ValueError)
    with pytest.raises(DraftVocabMismatch, match="vocabulary of 256 tokens, the target's has 512"):
        ModelDrafter(tiny_llama, target_n_vocab=512)


def test_a_refused_engine_call_leaves_a_drafter_that_starts_its_kv_over(
    tiny_llama: Path, references: list[list[int]]
) -> None:
    prompt, expected = PROMPTS[0], references[0]
    with ModelDrafter(tiny_llama, target_n_vocab=N_VOCAB) as drafter:
        assert list(drafter.propose(prompt, 4)) == expected[:4]
        with pytest.raises(InvalidArgument, match="token id 999"):
            drafter.propose([*prompt, 999], 2)
        assert "held=?" in repr(drafter)
        assert list(drafter.propose(prompt + expected[:2], 4)) == expected[2:6]
