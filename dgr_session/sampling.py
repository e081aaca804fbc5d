"""How a session takes each token from logits: :class:`Sampling`, the parameters of dgr's one
sampler, and :data:`greedy`, the sampler of greedy decoding.

The sampler itself is native code behind the engine's ABI (``dgr_sample``, ``docs/sampling.md``);
``dgr_engine.engine.sampling.SeededSampler`` is its binding. A session whose sampler states its
:class:`Sampling` (:attr:`Sampler.sampling`) hands it to every stage at open, and the last stage
takes the tokens: on a ring it sends the next frame itself, and a speculative pass keeps a draft
exactly when it is the sampler's token at its position. Its randomness depends only on
``(seed, position)``, so a re-prefill on a new route, another data path or a pass of drafts
take the same tokens as plain decoding.

This module is pure Python (``dgr_session`` calls no native code): it checks the parameters
(the native check, ``dgr_sampling_check``, is held to the same rule by
``tests/engine/test_sampler.py``) and takes greedy tokens, the lowest index of the largest
logit, which the native sampler takes at temperature 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from dgr_session.errors import DgrError, NonFiniteLogits

__all__ = [
    "GREEDY",
    "InvalidSamplingParameter",
    "Sampler",
    "Sampling",
    "check_finite",
    "greedy",
]

SEED_LIMIT = 1 << 64
"""Seeds are unsigned 64-bit numbers: ``0 <= seed < SEED_LIMIT``."""


class InvalidSamplingParameter(DgrError, ValueError):
    """A sampler was asked for with a value out of its range (a negative temperature, top-p
    outside ``(0, 1]``, a negative top-k...): nothing was sampled."""


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


def _within(low: float, high: float, *, low_open: bool = False) -> Any:
    def check(_instance: object, attribute: attrs.Attribute[float], value: float) -> None:
        above = value > low if low_open else value >= low
        if not (math.isfinite(value) and above and value <= high):
            bracket = "(" if low_open else "["
            raise InvalidSamplingParameter(
                f"{attribute.name} must be in {bracket}{low:g}, {high:g}], got {value}"
            )

    return check


def _temperature(_instance: object, _attribute: object, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise InvalidSamplingParameter(f"temperature must be finite and >= 0, got {value}")


def _top_k(_instance: object, _attribute: object, value: int) -> None:
    if not 0 <= value < 1 << 31:
        raise InvalidSamplingParameter(f"top_k must be >= 0 (0: all tokens), got {value}")


def _seed(_instance: object, _attribute: object, value: int) -> None:
    if not 0 <= value < SEED_LIMIT:
        raise InvalidSamplingParameter(f"seed must be in [0, 2**64), got {value}")


def _repetition(_instance: object, _attribute: object, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise InvalidSamplingParameter(f"repetition_penalty must be finite and > 0, got {value}")


def _last_n(_instance: object, _attribute: object, value: int) -> None:
    if not 0 <= value < 1 << 31:
        raise InvalidSamplingParameter(f"penalty_last_n must be >= 0, got {value}")


@attrs.frozen
class Sampling:
    """The parameters of dgr's one sampler (``docs/sampling.md`` states the algorithm): the
    token at a position is a fixed function of the logits of the row before it, these, the
    position and the tokens before it. Invalid values are refused at construction with
    :class:`InvalidSamplingParameter`, by the same rule the native sampler checks."""

    seed: int = attrs.field(default=0, validator=_seed)
    """Seed of the draw (``0 <= seed < 2**64``)."""
    temperature: float = attrs.field(default=1.0, validator=_temperature)
    """Softmax temperature (>= 0; 0: greedy, the lowest index of the largest logit)."""
    top_k: int = attrs.field(default=0, validator=_top_k)
    """Keep only the ``top_k`` most likely tokens (0: all)."""
    top_p: float = attrs.field(default=1.0, validator=_within(0, 1, low_open=True))
    """Keep the most likely tokens whose probability adds up to ``top_p`` (1: all)."""
    min_p: float = attrs.field(default=0.0, validator=_within(0, 1))
    """Drop tokens less likely than ``min_p`` times the most likely (0: none)."""
    presence_penalty: float = attrs.field(default=0.0, validator=_within(-2, 2))
    """OpenAI's: subtracted once from the logit of every token the window holds."""
    frequency_penalty: float = attrs.field(default=0.0, validator=_within(-2, 2))
    """OpenAI's: subtracted from a token's logit once per time the window holds it."""
    repetition_penalty: float = attrs.field(default=1.0, validator=_repetition)
    """llama.cpp's: a held token's logit divided by it (positive logits) or multiplied by it
    (the others); 1: none."""
    penalty_last_n: int = attrs.field(default=64, validator=_last_n)
    """The window: the last this many tokens before the position (0: no penalties)."""

    @property
    def penalized(self) -> bool:
        """A penalty is set and looks at some tokens: the sampler reads the history."""
        return self.penalty_last_n > 0 and (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def is_greedy(self) -> bool:
        """The sampler takes the largest logit whatever came before (temperature 0, no
        penalty): what a greedy session takes."""
        return self.temperature == 0 and not self.penalized

    def describe(self) -> str:
        """One line for logs and reports: ``greedy`` or the parameters that are set."""
        if self.is_greedy:
            return "greedy"
        parts = [f"seed {self.seed}", f"temperature {self.temperature:g}"]
        defaults = Sampling()
        for name in ("top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value != getattr(defaults, name):
                parts.append(f"{name} {value:g}")
        if self.repetition_penalty != 1:
            parts.append(f"repetition_penalty {self.repetition_penalty:g}")
        if self.penalized:
            parts.append(f"penalty_last_n {self.penalty_last_n}")
        return ", ".join(parts)


GREEDY = Sampling(temperature=0.0)
"""Greedy decoding's parameters."""


class Sampler(Protocol):
    """Chooses the token at ``position`` from the logits of the row before it and the tokens
    before it (``history``: prompt and accepted tokens, oldest first). Must be a pure function
    of its arguments, so that a replay after a route change would choose the same token.

    :attr:`sampling` declares what it computes: a sampler stating its :class:`Sampling` is
    dgr's one sampler, which the stages apply themselves (the last stage takes the tokens, a
    ring runs on, speculation keeps the drafts it picks); ``None``: only this callable knows,
    so the session reads the logits and calls it (no ring, no speculation)."""

    @property
    def sampling(self) -> Sampling | None:
        """The parameters of dgr's sampler this is, or ``None`` for any other."""
        ...

    def __call__(self, logits: Any, position: int, history: Sequence[int] = ()) -> int:
        """Token id at ``position`` given the logits of the row before it."""
        ...


@attrs.frozen
class _Greedy:
    """Greedy decoding: the index of the largest logit, the lowest such index on ties (like
    ``numpy.argmax``); :class:`NonFiniteLogits` when any is NaN or infinite."""

    @property
    def sampling(self) -> Sampling:
        return GREEDY

    def __call__(self, logits: Any, position: int = 0, history: Sequence[int] = ()) -> int:
        check_finite(logits)
        argmax = getattr(logits, "argmax", None)
        if argmax is not None:
            if not len(logits):
                raise ValueError("empty logits")
            return int(argmax())
        if not len(logits):
            raise ValueError("empty logits")
        return max(range(len(logits)), key=logits.__getitem__)

    def __repr__(self) -> str:
        return "greedy"


greedy: Sampler = _Greedy()
"""The greedy sampler (:data:`GREEDY`'s)."""
