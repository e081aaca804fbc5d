"""Seeded prompts for the quantized baseline: natural text from a small built-in corpus,
tokenized by the GGUF's own vocabulary (llama.cpp's tokenizer, :class:`~dgr_engine.tokenizer.
Tokenizer`), so both sides are teacher-forced on the token ids a user's text would give.

Why text and not random ids: a quantized model's error shows where its distributions are
peaked, as on real text; over random ids the distributions are nearly flat and top-1 is a coin
between near-equal logits. A GGUF without a tokenizer (a generated fixture) gets seeded random
ids over its vocabulary instead, and the result says which (:class:`PromptSet`).

The corpus's paragraphs are put in a seeded order (numpy's PCG64, seed :data:`SEED`); prompt
``n`` is the first ``length`` tokens of that order rotated to start at its ``n``-th paragraph,
joined by blank lines: the same model and arguments give the same prompts on every machine.
The paragraphs were written for dgr (no licence applies).
"""

from __future__ import annotations

import enum
import os
from typing import Final

import attrs
import numpy as np

from dgr_engine.tokenizer import Tokenizer

SEED: Final = 20

CORPUS: Final[tuple[str, ...]] = (
    "The river runs slowly past the old mill, where the wheel has not turned for forty years. "
    "In spring the water rises over the lower steps, and children from the village come down "
    "to watch the ducks that nest among the reeds on the far bank.",
    "To bake a simple loaf of bread, mix flour, water, salt and a little yeast, then knead the "
    "dough for ten minutes until it is smooth. Let it rise in a warm place for an hour, shape "
    "it, let it rise again, and bake it in a hot oven until the crust is brown.",
    "A prime number is a whole number greater than one whose only divisors are one and itself. "
    "The first few are two, three, five, seven, eleven and thirteen. Every whole number greater "
    "than one can be written as a product of primes in exactly one way.",
    "The train left the station at half past seven and reached the coast just before noon. "
    "Most of the passengers slept through the mountains, but a few stood at the windows to see "
    "the snow on the peaks and the lakes shining far below the line.",
    "When you write a function, give it one job and a name that says what that job is. Check "
    "its inputs at the boundary, return early when there is nothing to do, and write a test "
    "that would fail if the function did the wrong thing.",
    "The moon has no air and no liquid water, so its surface keeps the marks of impacts for "
    "billions of years. During the day the ground becomes hotter than boiling water, and at "
    "night it grows colder than anywhere on the Earth.",
    "She opened the letter at the kitchen table and read it twice before she said anything. Her "
    "brother had found work in the city, he wrote, and he would come home for the harvest if "
    "the roads were clear and the weather held until the end of the month.",
    "Plants make their food from light, water and carbon dioxide. The green pigment in their "
    "leaves absorbs red and blue light and uses its energy to split water, releasing oxygen "
    "into the air and storing the energy in sugars the plant can use later.",
    "The committee met on Tuesday to discuss the budget for the new library. After a long "
    "debate, the members agreed to spend less on furniture and more on books, and to keep the "
    "building open on Sunday afternoons for students who work during the week.",
    "Question: What is the capital of France? Answer: The capital of France is Paris, a city on "
    "the river Seine. Question: How many days are there in a leap year? Answer: A leap year has "
    "three hundred and sixty-six days.",
    "Music is organised sound. A melody is a sequence of notes heard one after another, while "
    "harmony is what we hear when several notes sound together. Rhythm gives both of them their "
    "shape in time, and tempo sets how fast that time seems to pass.",
    "The market opens early on Saturday. Farmers arrive before dawn with crates of apples, "
    "potatoes and cabbages, the baker sets out warm rolls, and by eight o'clock the square is "
    "full of people carrying baskets and talking about the week's news.",
)
"""Plain English paragraphs on unrelated subjects (narrative, instructions, science, a
question and answer)."""


class PromptSource(enum.StrEnum):
    """Where the prompts' token ids came from."""

    TEXT = "text"
    """The built-in corpus, tokenized by the GGUF's vocabulary."""
    RANDOM_IDS = "random-ids"
    """Seeded random ids over the vocabulary (a GGUF without a tokenizer)."""


@attrs.frozen
class PromptSet:
    """The prompts both sides are teacher-forced on."""

    prompts: tuple[tuple[int, ...], ...]
    source: PromptSource
    seed: int

    @property
    def tokens(self) -> int:
        """Teacher-forced positions over all prompts."""
        return sum(len(p) for p in self.prompts)

    def text(self) -> str:
        """One phrase saying what the prompts are."""
        what = (
            "text from the built-in corpus"
            if self.source is PromptSource.TEXT
            else "random ids over the vocabulary"
        )
        sizes = f"{len(self.prompts)} prompts x {len(self.prompts[0])} tokens"
        return f"{sizes} of {what}, seed {self.seed}"


def seeded_prompts(
    gguf: str | os.PathLike[str], n_prompts: int, length: int, *, seed: int = SEED
) -> PromptSet:
    """``n_prompts`` prompts of exactly ``length`` tokens each for ``gguf`` (see the module)."""
    if n_prompts < 1 or length < 1:
        raise ValueError("seeded_prompts: n_prompts >= 1 and length >= 1")
    rng = np.random.default_rng(seed)
    with Tokenizer(gguf) as tokenizer:
        info = tokenizer.info
        if not info.has_tokenizer:
            low = 3 if info.n_vocab > 3 else 0
            ids = tuple(
                tuple(int(t) for t in rng.integers(low, info.n_vocab, length))
                for _ in range(n_prompts)
            )
            return PromptSet(ids, PromptSource.RANDOM_IDS, seed)
        order = [int(i) for i in rng.permutation(len(CORPUS))]
        prompts = []
        for n in range(n_prompts):  # each starts at another paragraph (up to len(CORPUS))
            start = n % len(CORPUS)
            rotated = order[start:] + order[:start]
            tokens = tokenizer.encode("\n\n".join(CORPUS[i] for i in rotated))
            if len(tokens) < length:
                raise ValueError(
                    f"seeded_prompts: the corpus is {len(tokens)} tokens, fewer than {length}"
                )
            prompts.append(tuple(tokens[:length]))
    return PromptSet(tuple(prompts), PromptSource.TEXT, seed)
