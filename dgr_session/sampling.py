"""Token choice from logits: greedy by default, or seeded sampling."""

from __future__ import annotations

import math
import random
from typing import Any

import attrs

from dgr_session.errors import NonFiniteLogits


def check_finite(logits: Any) -> None:
    """Raises :class:`NonFiniteLogits` when ``logits`` hold NaN or infinity (arrays with
    ``min``/``max``, which propagate NaN, are checked in two passes; sequences one by one)."""
    if hasattr(logits, "max") and hasattr(logits, "min"):
        if len(logits) and not (
            math.isfinite(float(logits.max())) and math.isfinite(float(logits.min()))
        ):
            raise NonFiniteLogits(f"logits hold NaN or infinity ({len(logits)} values)")
        return
    if not all(math.isfinite(float(value)) for value in logits):
        raise NonFiniteLogits(f"logits hold NaN or infinity ({len(logits)} values)")


def greedy(logits: Any, step: int = 0) -> int:
    """Index of the largest logit (the lowest such index on ties, like ``numpy.argmax``);
    :class:`NonFiniteLogits` when any is NaN or infinite."""
    check_finite(logits)
    argmax = getattr(logits, "argmax", None)
    if argmax is not None:
        return int(argmax())
    if not len(logits):
        raise ValueError("empty logits")
    return max(range(len(logits)), key=logits.__getitem__)


@attrs.frozen
class SeededSampler:
    """Temperature / top-k sampling whose randomness depends only on ``(seed, step)``.

    The same seed gives the same choice at the same step with the same logits, whatever happened
    to the route in between.
    """

    seed: int
    """Seed of the per-step generator."""
    temperature: float = attrs.field(default=1.0)
    """Softmax temperature (> 0)."""
    top_k: int = 0
    """Keep only the ``top_k`` largest logits (0: keep all)."""

    @temperature.validator
    def _positive(self, _attribute: attrs.Attribute[float], value: float) -> None:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"temperature must be finite and > 0, got {value}")

    def __call__(self, logits: Any, step: int) -> int:
        values = [float(value) for value in logits]
        if not values:
            raise ValueError("empty logits")
        check_finite(values)
        order = sorted(range(len(values)), key=lambda i: (-values[i], i))
        if self.top_k > 0:
            order = order[: self.top_k]
        top = values[order[0]]
        weights = [math.exp((values[i] - top) / self.temperature) for i in order]
        rng = random.Random(f"dgr-sampler/{self.seed}/{step}")
        return rng.choices(order, weights=weights)[0]
