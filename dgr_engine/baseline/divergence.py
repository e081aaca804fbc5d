"""Two implementations' next-token distributions, compared: the figures DGR-020 reads for a
quantized GGUF, where logits of a dequantized reference and of llama.cpp's quantized kernels
are not expected to agree to a bound, but their distributions are.

At every teacher-forced position the reference's logits give ``P`` and the tested side's give
``Q``, both by a float64 log-softmax; the figure is ``KL(P || Q) = sum_v P(v) (log P(v) - log
Q(v))`` in nats (the direction llama.cpp's own ``llama-perplexity --kl-divergence`` reports: the
reference weights the error). Its mean and 99th percentile over positions (numpy's linear
interpolation), the share of positions whose top-1 agrees, and the greedy continuations' first
difference.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from dgr_engine.baseline.compare import first_difference
from dgr_engine.certification.lock import QuantizedBaseline

P99: float = 99.0


@attrs.frozen
class Divergence:
    """How far a tested implementation's next-token distributions are from a reference's."""

    kld_mean: float
    """Mean KL(P || Q) over every teacher-forced position, nats."""
    kld_p99: float
    """Its 99th percentile over positions, nats."""
    kld_max: float
    """Its largest value, nats."""
    top1_agreement: float
    """Share of positions whose top-1 token agrees."""
    tokens_equal: bool
    """The greedy continuations are equal (reported; no threshold)."""
    first_difference: int | None
    """Index of the first greedy token that differs, prompts end to end (``None``: equal)."""
    positions: int
    """Teacher-forced positions compared."""
    max_abs_logit: float = float("nan")
    """The largest |tested - reference| raw logit over every position and token (reported; no
    threshold: a quantized model's logits are judged by their distributions)."""

    def within(self, limits: QuantizedBaseline) -> bool:
        """Mean, 99th percentile and top-1 within the locked thresholds, over at least the
        locked number of positions."""
        return not self.shortfalls(limits)

    def shortfalls(self, limits: QuantizedBaseline) -> list[str]:
        """What is outside the locked thresholds, one phrase each (empty: within)."""
        out = []
        if self.positions < limits.prompt_tokens_min:
            out.append(f"{self.positions} positions < {limits.prompt_tokens_min}")
        if not self.kld_mean <= limits.kld_mean_max:  # NaN is outside
            out.append(f"mean KLD {self.kld_mean:.3g} > {limits.kld_mean_max:g}")
        if not self.kld_p99 <= limits.kld_p99_max:
            out.append(f"p99 KLD {self.kld_p99:.3g} > {limits.kld_p99_max:g}")
        if not self.top1_agreement >= limits.top1_agreement_min:
            out.append(f"top-1 {self.top1_agreement:.3f} < {limits.top1_agreement_min:g}")
        return out

    def text(self) -> str:
        """One line of the figures."""
        greedy = "equal" if self.tokens_equal else f"differ at {self.first_difference}"
        return (
            f"mean KLD {self.kld_mean:.3g} nats, p99 {self.kld_p99:.3g}, max {self.kld_max:.3g}, "
            f"top-1 {self.top1_agreement:.3f} over {self.positions} positions; greedy tokens "
            f"{greedy}"
        )


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (shifted by the row's maximum: no overflow)."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def kl_divergence(reference: np.ndarray, tested: np.ndarray) -> np.ndarray:
    """``KL(P || Q)`` per row of ``[positions, vocab]`` logits, nats (``P``: the reference)."""
    if reference.shape != tested.shape or reference.ndim != 2:
        raise ValueError(f"kl_divergence: logits of shape {tested.shape} against {reference.shape}")
    log_p, log_q = log_softmax(reference), log_softmax(tested)
    kld = (np.exp(log_p) * (log_p - log_q)).sum(axis=-1)
    return np.maximum(kld, 0.0)  # rounding can leave -1e-17 where P == Q


def divergence(
    reference_logits: Sequence[np.ndarray],
    tested_logits: Sequence[np.ndarray],
    reference_tokens: Sequence[Sequence[int]],
    tested_tokens: Sequence[Sequence[int]],
) -> Divergence:
    """Compares per-prompt ``[positions, vocab]`` logits and per-prompt greedy tokens."""
    if len(reference_logits) != len(tested_logits) or not reference_logits:
        raise ValueError("divergence: the same, non-zero number of prompts is needed on both sides")
    ref = np.concatenate([np.asarray(x, dtype=np.float64) for x in reference_logits])
    got = np.concatenate([np.asarray(x, dtype=np.float64) for x in tested_logits])
    kld = kl_divergence(ref, got)
    first = first_difference(reference_tokens, tested_tokens)
    return Divergence(
        kld_mean=float(kld.mean()),
        kld_p99=float(np.percentile(kld, P99)),
        kld_max=float(kld.max()),
        top1_agreement=float(np.mean(np.argmax(ref, axis=1) == np.argmax(got, axis=1))),
        tokens_equal=first is None,
        first_difference=first,
        positions=int(ref.shape[0]),
        max_abs_logit=float(np.abs(got - ref).max()),
    )
