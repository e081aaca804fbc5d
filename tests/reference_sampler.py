"""A plain transcription of ``docs/sampling.md``'s algorithm, step for step, in pure Python
floats (IEEE doubles), its own exponential included: the reference the native sampler is held
to (``tests/engine/test_sampler.py``). Slow (it sorts the whole vocabulary): for tests."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs

from dgr_session.sampling import Sampling

_MASK = (1 << 64) - 1


def mix(z: int) -> int:
    """SplitMix64's step."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def uniform(seed: int, pos: int) -> float:
    return (mix(mix(seed) ^ pos) >> 11) * 2.0**-53


_EXP_TERMS = [1.0 / math.factorial(j) for j in range(13, -1, -1)]  # 1/13!, ..., 1/1!, 1/0!


def exp(y: float) -> float:
    """exp(y) for y <= 0 by the operations of the document's "The exponential"."""
    x = max(y, -746.0)
    t = x * float.fromhex("0x1.71547652b82fep0") + float.fromhex("0x1.8p52")
    k = t - float.fromhex("0x1.8p52")
    r = (x - k * float.fromhex("0x1.62e42fee00000p-1")) - k * float.fromhex("0x1.a39ef35793c76p-33")
    p = _EXP_TERMS[0]
    for term in _EXP_TERMS[1:]:
        p = p * r + term
    return (p * math.ldexp(1.0, int(k) + 1022)) * 2.0**-1022


def sample(s: Sampling, logits: Sequence[float], pos: int, history: Sequence[int] = ()) -> int:
    n = len(logits)
    assert n >= 1
    # 1. logits
    x = [float(v) for v in logits]
    assert all(math.isfinite(v) for v in x)
    # 2. penalties
    if s.penalty_last_n > 0 and (
        s.presence_penalty != 0 or s.frequency_penalty != 0 or s.repetition_penalty != 1
    ):
        window = list(history)[len(history) - min(s.penalty_last_n, len(history)) :]
        for t, c in Counter(window).items():
            assert 0 <= t < n
            if s.repetition_penalty != 1:
                x[t] = x[t] * s.repetition_penalty if x[t] <= 0 else x[t] / s.repetition_penalty
            x[t] = x[t] - (c * s.frequency_penalty + s.presence_penalty)
    # 3. greedy
    m = max(x)
    if s.temperature == 0:
        return x.index(m)
    # 4. weights
    w = [exp((v - m) / s.temperature) for v in x]
    # 5. order: larger x first, lower id on ties
    ranking = sorted(range(n), key=lambda i: (-x[i], i))
    # 6. the kept set
    kept = list(ranking)
    if 0 < s.top_k < n:
        kept = ranking[: s.top_k]
    if s.top_p < 1:
        total = 0.0
        for i in sorted(kept):
            total = total + w[i]
        need = s.top_p * total
        running = 0.0
        for end, i in enumerate(kept):
            running = running + w[i]
            if running >= need:
                kept = kept[: end + 1]
                break
    if s.min_p > 0:
        kept = [i for i in kept if not w[i] < s.min_p]
    # 7. the draw
    ids = sorted(kept)
    z = 0.0
    for i in ids:
        z = z + w[i]
    target = uniform(s.seed, pos) * z
    running = 0.0
    for i in ids:
        running = running + w[i]
        if running > target:
            return i
    return ids[-1]


@attrs.frozen
class DocumentedSampler:
    """dgr's sampler through this transcription (a ``dgr_session.sampling.Sampler`` for
    sessions in tests that run no native code)."""

    sampling: Sampling

    def __call__(self, logits: Any, position: int, history: Sequence[int] = ()) -> int:
        return sample(self.sampling, [float(v) for v in logits], position, history)
