"""Token choice: greedy by default, seeded sampling that depends only on (seed, step)."""

from __future__ import annotations

import numpy as np
import pytest

from dgr_session import SeededSampler, greedy


def test_greedy_takes_the_first_maximum_like_numpy() -> None:
    assert greedy([0.1, 3.0, -1.0, 3.0]) == 1
    assert greedy((5.0,)) == 0
    values = np.array([0.5, 2.0, 2.0, -3.0], dtype=np.float32)
    assert greedy(values) == int(np.argmax(values)) == 1
    assert greedy([0.5, 2.0, 2.0, -3.0]) == 1
    with pytest.raises(ValueError):
        greedy([])


def test_seeded_sampler_depends_only_on_seed_step_and_logits() -> None:
    logits = [0.0, 0.1, 0.2, 0.3, 0.25]
    first = SeededSampler(seed=1, temperature=10.0)
    again = SeededSampler(seed=1, temperature=10.0)
    draws = [first(logits, step) for step in range(200)]
    assert draws == [again(logits, step) for step in range(200)]
    assert len(set(draws)) > 1  # it samples
    other = [SeededSampler(seed=2, temperature=10.0)(logits, step) for step in range(200)]
    assert other != draws


def test_top_k_and_low_temperature_restrict_the_choice() -> None:
    logits = [0.0, 5.0, 4.9, -2.0]
    top2 = {SeededSampler(seed=3, temperature=100.0, top_k=2)(logits, s) for s in range(300)}
    assert top2 == {1, 2}
    cold = {SeededSampler(seed=3, temperature=1e-3)(logits, s) for s in range(50)}
    assert cold == {1}


@pytest.mark.parametrize("temperature", [-1.0, float("inf"), float("nan")])
def test_temperature_must_be_positive_and_finite(temperature: float) -> None:
    with pytest.raises(ValueError):
        SeededSampler(seed=0, temperature=temperature)
