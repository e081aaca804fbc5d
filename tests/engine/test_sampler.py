"""dgr's one sampler (``docs/sampling.md``): the native ``dgr_sample`` against a plain Python
transcription of the documented algorithm, the parameters' two checks against each other, and
the properties a caller relies on (the same (seed, position) draws the same token; a cut token
is never chosen; greedy in the cold limit)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dgr_engine.engine.sampling import (
    SeededSampler,
    check_sampling,
    native_sampling,
    sample_exp,
    uniform,
)
from dgr_session import NonFiniteLogits
from dgr_session.sampling import GREEDY, InvalidSamplingParameter, Sampling, greedy
from tests import reference_sampler as reference

LOGITS = hnp.arrays(
    np.float32,
    st.integers(1, 200),
    elements=st.floats(-40, 40, width=32, allow_nan=False),
)
"""Logits of a small vocabulary (any values)."""

TIED = hnp.arrays(
    np.float32, st.integers(1, 200), elements=st.integers(-24, 24).map(lambda v: v / 4)
)
"""Logits on a coarse grid: many ties."""

TEMPERATURES = st.one_of(
    st.just(0.0),
    st.floats(1e-300, 1e-3),
    st.floats(0.05, 20),
    st.floats(1e3, 1e300),
)
SAMPLINGS = st.builds(
    Sampling,
    seed=st.integers(0, 2**64 - 1),
    temperature=TEMPERATURES,
    top_k=st.integers(0, 60),
    top_p=st.one_of(st.just(1.0), st.floats(1e-6, 1.0), st.sampled_from([0.5, 0.9, 0.25])),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    presence_penalty=st.one_of(st.just(0.0), st.floats(-2, 2)),
    frequency_penalty=st.one_of(st.just(0.0), st.floats(-2, 2)),
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.5, 2.0)),
    penalty_last_n=st.integers(0, 80),
)


def _history(draw: st.DrawFn, n_vocab: int) -> list[int]:
    return draw(st.lists(st.integers(0, n_vocab - 1), max_size=100))


@st.composite
def cases(draw: st.DrawFn) -> tuple[Sampling, np.ndarray, int, list[int]]:
    logits = draw(st.one_of(LOGITS, TIED))
    return draw(SAMPLINGS), logits, draw(st.integers(0, 2**32 - 1)), _history(draw, len(logits))


@settings(max_examples=600)
@given(cases())
def test_the_native_sampler_is_the_documented_algorithm(
    case: tuple[Sampling, np.ndarray, int, list[int]],
) -> None:
    sampling, logits, position, history = case
    want = reference.sample(sampling, logits.tolist(), position, history)
    assert SeededSampler(sampling)(logits, position, history) == want


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1))
def test_the_draw_is_the_documented_counter_based_generator(seed: int, position: int) -> None:
    value = uniform(seed, position)
    assert value == reference.uniform(seed, position)
    assert 0.0 <= value < 1.0


EXPONENTS = st.one_of(
    st.floats(-800.0, 0.0),
    st.floats(-1e-6, 0.0),
    st.sampled_from([0.0, -0.0, -1e-300, -745.0, -745.1332, -745.2, -746.0, -1e300]),
    st.integers(-1080, 0).map(lambda k: k * math.log(2.0)),  # the reduction's ties, about
)


@settings(max_examples=2000)
@given(EXPONENTS)
def test_the_exponential_is_the_documented_one_and_within_two_ulp_of_exp(y: float) -> None:
    got = sample_exp(y)
    assert got == reference.exp(y) and math.copysign(1.0, got) == 1.0
    true = math.exp(y)  # the C library's, within half an ulp or so: the document's is close
    assert abs(got - true) <= 2 * math.ulp(true), (y, got, true)
    assert sample_exp(0.0) == 1.0


def test_the_weights_of_a_whole_row_have_the_documented_bits() -> None:
    """A row is weighed four at a time where the CPU can (AVX2), one at a time in the tail:
    every weight the draw reads has the document's bits, so the token does too. A two-token
    vocabulary at ``top_p`` whose boundary lies between two adjacent weights shows it."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        logits = rng.normal(0, 4, size=4099).astype(np.float32)  # a tail of 3
        sampling = Sampling(seed=int(rng.integers(0, 2**63)), temperature=0.7, top_p=0.9)
        for position in range(5):
            assert SeededSampler(sampling)(logits, position) == reference.sample(
                sampling, logits.tolist(), position
            )


def test_one_token_vocabularies_and_the_top_p_boundary() -> None:
    one = np.array([3.5], dtype=np.float32)
    for sampling in (GREEDY, Sampling(seed=9, top_p=1e-9), Sampling(seed=9, min_p=1.0)):
        assert SeededSampler(sampling)(one, 5) == 0
    # weights 1 and 1: top_p 0.5 is reached by the first exactly (>=): only it is kept
    even = np.array([2.0, 2.0], dtype=np.float32)
    assert {SeededSampler.of(seed=s, top_p=0.5)(even, 1) for s in range(60)} == {0}
    assert {SeededSampler.of(seed=s, top_p=0.51)(even, 1) for s in range(60)} == {0, 1}


def test_the_same_seed_and_position_draw_the_same_token_whatever_came_before() -> None:
    logits = np.linspace(0, 1, 50, dtype=np.float32)
    sampler = SeededSampler.of(seed=11, temperature=5.0)
    forward = [sampler(logits, p) for p in range(100)]
    backward = [sampler(logits, p) for p in reversed(range(100))][::-1]
    assert forward == backward
    assert len(set(forward)) > 10  # it samples
    assert forward != [SeededSampler.of(seed=12, temperature=5.0)(logits, p) for p in range(100)]


@given(st.one_of(LOGITS, TIED), st.integers(0, 2**64 - 1), st.integers(0, 10_000))
def test_the_cold_limit_and_temperature_zero_are_greedy(
    logits: np.ndarray, seed: int, position: int
) -> None:
    assert SeededSampler(GREEDY)(logits, position) == greedy(logits)
    cold = SeededSampler.of(seed=seed, temperature=1e-300)
    assert logits[cold(logits, position)] == logits.max()


@given(st.one_of(LOGITS, TIED), st.integers(1, 30), st.integers(0, 10_000))
def test_top_k_never_chooses_a_token_it_cut(logits: np.ndarray, top_k: int, position: int) -> None:
    token = SeededSampler.of(seed=position, temperature=50.0, top_k=top_k)(logits, position)
    ranking = sorted(range(len(logits)), key=lambda i: (-float(logits[i]), i))
    assert ranking.index(token) < top_k


def test_penalties_follow_llama_cpp_and_openai() -> None:
    logits = np.array([1.0, 1.0, -1.0, 0.5], dtype=np.float32)
    # a held token falls below the others: greedy with a presence penalty avoids it
    sampler = SeededSampler.of(temperature=0.0, presence_penalty=0.6)
    assert sampler(logits, 4, history=[0]) == 1
    assert sampler(logits, 4, history=[]) == 0
    # outside the window it counts for nothing
    window = SeededSampler.of(temperature=0.0, presence_penalty=0.6, penalty_last_n=1)
    assert window(logits, 4, history=[0, 3]) == 0
    # repetition divides a positive logit and multiplies a negative one
    repeat = SeededSampler.of(temperature=0.0, repetition_penalty=3.0)
    assert repeat(np.array([1.2, 0.5], dtype=np.float32), 2, history=[0]) == 1
    assert repeat(np.array([-0.5, -1.2], dtype=np.float32), 2, history=[0]) == 1


@given(
    st.one_of(
        st.builds(dict, temperature=st.floats(max_value=-1e-12) | st.just(math.inf)),
        st.builds(dict, top_k=st.integers(max_value=-1)),
        st.builds(dict, top_p=st.floats(max_value=0.0) | st.floats(min_value=1.0 + 1e-9)),
        st.builds(dict, top_p=st.just(math.nan)),
        st.builds(dict, min_p=st.floats(max_value=-1e-12) | st.floats(min_value=1.0 + 1e-9)),
        st.builds(dict, presence_penalty=st.floats(min_value=2.0 + 1e-9)),
        st.builds(dict, frequency_penalty=st.floats(max_value=-2.0 - 1e-9)),
        st.builds(dict, repetition_penalty=st.floats(max_value=0.0)),
        st.builds(dict, penalty_last_n=st.integers(max_value=-1)),
        st.builds(dict, seed=st.integers(max_value=-1) | st.integers(min_value=2**64)),
    )
)
def test_values_out_of_range_are_refused_with_a_typed_error(bad: dict[str, float]) -> None:
    with pytest.raises(InvalidSamplingParameter):
        Sampling(**bad)  # type: ignore[arg-type]


@given(
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from(
        ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
         "repetition_penalty"]
    ),
)  # fmt: skip
def test_the_python_and_native_checks_agree(value: float, name: str) -> None:
    fields = {name: value}
    try:
        Sampling(**fields)  # type: ignore[arg-type]
        python_ok = True
    except InvalidSamplingParameter:
        python_ok = False
    params = native_sampling(Sampling())
    setattr(params, name, value)
    try:
        check_sampling(params)
        native_ok = True
    except InvalidSamplingParameter:
        native_ok = False
    assert python_ok == native_ok, (name, value)


def test_non_finite_logits_are_refused() -> None:
    for bad in (math.nan, math.inf, -math.inf):
        logits = np.array([0.0, bad, 1.0], dtype=np.float32)
        with pytest.raises(NonFiniteLogits):
            SeededSampler.of(seed=1)(logits, 0)
        with pytest.raises(NonFiniteLogits):
            SeededSampler(GREEDY)(logits, 0)


def test_a_history_token_outside_the_vocabulary_is_refused() -> None:
    sampler = SeededSampler.of(presence_penalty=1.0)
    with pytest.raises(InvalidSamplingParameter, match="vocabulary"):
        sampler(np.zeros(4, dtype=np.float32), 3, history=[7])
