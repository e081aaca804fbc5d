"""Two implementations' logits and greedy tokens, compared: the figures DGR-020 reads."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np


@attrs.frozen
class Comparison:
    """How far a tested implementation's logits are from a reference's, on the same inputs."""

    max_abs: float
    """Largest |logit difference| over every teacher-forced position."""
    max_rel: float
    """Largest row-normwise relative error: max over positions of ||a - r|| / ||r||."""
    top1_agreement: float
    """Share of teacher-forced positions whose top-1 token agrees."""
    min_margin: float
    """Smallest top-1/top-2 logit margin of the reference over those positions."""
    tokens_equal: bool
    """The greedy continuations are equal."""
    first_difference: int | None
    """Index of the first greedy token that differs (``None``: equal)."""
    positions: int
    """Teacher-forced positions compared."""

    @property
    def margin_ratio(self) -> float:
        """``max_abs / min_margin``: below 0.5 no position's top-1 can flip by the error alone
        (an error moves each of the two logits by at most ``max_abs``)."""
        return self.max_abs / self.min_margin if self.min_margin > 0 else float("inf")


def compare(
    reference_logits: Sequence[np.ndarray],
    tested_logits: Sequence[np.ndarray],
    reference_tokens: Sequence[Sequence[int]],
    tested_tokens: Sequence[Sequence[int]],
) -> Comparison:
    """Compares per-prompt ``[positions, vocab]`` logits and per-prompt greedy tokens."""
    if len(reference_logits) != len(tested_logits) or not reference_logits:
        raise ValueError("compare: the same, non-zero number of prompts is needed on both sides")
    ref = np.concatenate([np.asarray(x, dtype=np.float64) for x in reference_logits])
    got = np.concatenate([np.asarray(x, dtype=np.float64) for x in tested_logits])
    if ref.shape != got.shape:
        raise ValueError(f"compare: logits of shape {got.shape} against {ref.shape}")
    diff = got - ref
    norms = np.linalg.norm(ref, axis=1)
    rel = np.linalg.norm(diff, axis=1) / np.where(norms > 0, norms, 1.0)
    top2 = np.sort(ref, axis=1)[:, -2:]
    first = first_difference(reference_tokens, tested_tokens)
    return Comparison(
        max_abs=float(np.abs(diff).max()),
        max_rel=float(rel.max()),
        top1_agreement=float(np.mean(np.argmax(ref, axis=1) == np.argmax(got, axis=1))),
        min_margin=float((top2[:, 1] - top2[:, 0]).min()),
        tokens_equal=first is None,
        first_difference=first,
        positions=int(ref.shape[0]),
    )


def first_difference(
    reference_tokens: Sequence[Sequence[int]], tested_tokens: Sequence[Sequence[int]]
) -> int | None:
    """Index of the first differing token of the prompts' greedy continuations laid end to end
    (``None``: equal; a shorter side differs where it ends)."""
    flat_ref = [int(t) for seq in reference_tokens for t in seq]
    flat_got = [int(t) for seq in tested_tokens for t in seq]
    return next(
        (i for i, (a, b) in enumerate(zip(flat_ref, flat_got, strict=False)) if a != b),
        None if len(flat_ref) == len(flat_got) else min(len(flat_ref), len(flat_got)),
    )
