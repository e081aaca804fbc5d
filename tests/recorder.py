"""A sampler of a test's own that keeps the logits it was given: it states no ``Sampling``, so
a session hands the stages none and reads the logits itself (``docs/sampling.md``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class LogitsRecorder:
    """Greedy, keeping per step (the token's position less the prompt's length) the logits the
    token was chosen from, and every step it was called at (replayed steps ask for no logits
    and are not sampled: one call per step)."""

    sampling = None

    def __init__(self, prompt_length: int) -> None:
        self.prompt_length = prompt_length
        self.logits: dict[int, np.ndarray] = {}
        self.steps: list[int] = []

    def __call__(self, logits: Any, position: int, history: Sequence[int] = ()) -> int:
        step = position - self.prompt_length
        self.steps.append(step)
        self.logits[step] = np.array(logits, copy=True)
        return int(np.argmax(logits))
