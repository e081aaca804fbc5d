"""Draft sources and the adaptive draft length (``dgr_session.drafts``): the n-gram drafter
against a from-scratch search, and the draft length's policy."""

from __future__ import annotations

import itertools
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from dgr_session.drafts import (
    MIN_NGRAM,
    REPROBE,
    REPROBE_MAX,
    DraftConfigError,
    Drafter,
    DraftLength,
    NgramDrafter,
    PassTimes,
    check_draft_k,
)
from dgr_session.errors import DgrError

# -- the n-gram drafter --------------------------------------------------------------------

# a small alphabet, so that n-grams repeat
TOKENS = st.lists(st.integers(0, 4), max_size=60)
KS = st.integers(0, 10)


def scratch_proposal(history: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[int, ...]:
    """The n-gram drafter's answer by brute force: for n from max_ngram down to min_ngram, the
    k tokens that followed the most recent earlier occurrence of the last n tokens."""
    length = len(history)
    if k == 0:
        return ()
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > length - 1:
            continue
        suffix = history[length - n :]
        for end in range(length - 1, n - 1, -1):
            if history[end - n : end] == suffix:
                return tuple(history[end : end + k])
    return ()


def is_continuation_of_an_earlier_occurrence(
    history: list[int], proposal: tuple[int, ...], min_ngram: int, max_ngram: int
) -> bool:
    """Some suffix of ``history`` of a length in the bounds occurred earlier, followed by
    ``proposal``."""
    length = len(history)
    for n in range(min_ngram, min(max_ngram, length - 1) + 1):
        suffix = history[length - n :]
        for end in range(n, length):
            if (
                history[end - n : end] == suffix
                and tuple(history[end : end + len(proposal)]) == proposal
            ):
                return True
    return False


NGRAM_BOUNDS = st.tuples(st.integers(1, 4), st.integers(0, 3)).map(lambda t: (t[0] + t[1], t[0]))


@given(history=TOKENS, k=KS, bounds=NGRAM_BOUNDS)
def test_a_proposal_continues_an_earlier_occurrence_of_a_suffix_and_fits_k(
    history: list[int], k: int, bounds: tuple[int, int]
) -> None:
    max_ngram, min_ngram = bounds
    proposal = NgramDrafter(max_ngram, min_ngram).propose(history, k)
    assert len(proposal) <= k
    if proposal:
        assert is_continuation_of_an_earlier_occurrence(history, proposal, min_ngram, max_ngram)
    assert proposal == scratch_proposal(history, k, max_ngram, min_ngram)


@given(history=st.lists(st.integers(0, 4), max_size=1), k=KS)
def test_an_empty_or_one_token_history_has_no_draft(history: list[int], k: int) -> None:
    assert NgramDrafter().propose(history, k) == ()


def test_the_longest_matching_ngram_wins_and_the_most_recent_occurrence_of_it() -> None:
    #           0  1  2  3  4  5  6  7  8  9 10
    history = [7, 1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    # [1, 2, 3] occurred at 1..3 (followed by 9); [2, 3] most recently at 5..6 (followed by 8)
    assert NgramDrafter(3, 1).propose(history, 3) == (9, 2, 3)
    assert NgramDrafter(2, 1).propose(history, 3) == (8, 1, 2)
    assert NgramDrafter(3, 1).propose(history, 0) == ()
    assert NgramDrafter(3, 3).propose([1, 2, 3, 4], 2) == ()


class IncrementalIndex(RuleBasedStateMachine):
    """One drafter follows a history that grows, shrinks and diverges; each answer equals a
    from-scratch search of the history as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.drafter = NgramDrafter(3, 1)
        self.history: list[int] = []

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=8))
    def append(self, tokens: list[int]) -> None:
        self.history += tokens

    @precondition(lambda self: len(self.history) > 0)
    @rule(data=st.data())
    def shrink(self, data: st.DataObject) -> None:
        self.history = self.history[: data.draw(st.integers(0, len(self.history) - 1))]

    @precondition(lambda self: len(self.history) > 0)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=4))
    def diverge(self, data: st.DataObject, tokens: list[int]) -> None:
        """Rejected drafts: the history from some point on is replaced."""
        cut = data.draw(st.integers(0, len(self.history) - 1))
        self.history = self.history[:cut] + [(self.history[cut] + 1) % 4] + tokens

    @rule(k=KS, as_tuple=st.booleans())
    def propose(self, k: int, as_tuple: bool) -> None:
        history = tuple(self.history) if as_tuple else list(self.history)
        assert self.drafter.propose(history, k) == scratch_proposal(self.history, k, 3, 1)

    @invariant()
    def proposals_do_not_depend_on_the_calls_before(self) -> None:
        fresh = NgramDrafter(3, 1).propose(self.history, 5)
        assert self.drafter.propose(self.history, 5) == fresh


TestIncrementalIndex = IncrementalIndex.TestCase
TestIncrementalIndex.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_long_history_costs_the_new_tokens_not_a_search() -> None:
    """200 000 tokens of a repeating text, then 2 000 passes of one accepted token each: well
    under a second of drafting (a search per pass would be 2 000 x 200 000 comparisons)."""
    period = [5, 3, 8, 1, 9, 2, 7, 4, 6, 0, 11, 12, 13]
    history = (period * (200_000 // len(period) + 1))[:200_000]
    drafter = NgramDrafter()
    drafter.propose(history, 4)
    started = time.perf_counter()
    for _ in range(2_000):
        proposal = drafter.propose(history, 4)
        assert len(proposal) == 4
        history.append(proposal[0])
    assert time.perf_counter() - started < 5.0
    assert drafter.propose(history, 4) == scratch_proposal(history[-50:], 4, 3, 1)


def test_bad_ngram_bounds_and_a_negative_k_are_typed_refusals() -> None:
    for max_ngram, min_ngram in ((3, 0), (1, 2), (0, 0)):
        with pytest.raises(DraftConfigError, match="min_ngram"):
            NgramDrafter(max_ngram, min_ngram)
    with pytest.raises(DraftConfigError, match="k must be >= 0, got -1"):
        NgramDrafter().propose([1, 2, 1], -1)
    with pytest.raises(ValueError):
        check_draft_k(-3)
    assert issubclass(DraftConfigError, DgrError)


def test_the_ngram_drafter_is_a_drafter_and_close_forgets_the_index() -> None:
    drafter = NgramDrafter()
    assert isinstance(drafter, Drafter) and drafter.name == "ngram"
    assert drafter.propose([1, 2, 3, 1, 2], 2) == (3, 1)
    drafter.close()
    drafter.close()
    assert "indexed=0" in repr(drafter)
    assert drafter.propose([1, 2, 3, 1, 2], 2) == (3, 1)


def test_by_default_a_draft_needs_a_match_of_two_tokens() -> None:
    # [1] occurred before (followed by 2), [2, 1] did not: one token is not enough by default
    assert MIN_NGRAM == 2
    assert NgramDrafter().propose([1, 2, 1], 2) == ()
    assert NgramDrafter(3, 1).propose([1, 2, 1], 2) == (2, 1)
    assert NgramDrafter().propose([1, 2, 1, 2], 2) == (1, 2)


# -- the draft length ----------------------------------------------------------------------


def test_full_acceptance_grows_k_up_to_k_max() -> None:
    length = DraftLength(k_max=6, k_start=4)
    seen = []
    for _ in range(4):
        length.record(length.k, length.k)
        seen.append(length.k)
    assert seen == [5, 6, 6, 6]


def test_partial_acceptance_keeps_k_and_no_acceptance_halves_it() -> None:
    length = DraftLength(k_max=8, k_start=8)
    length.record(8, 3)
    assert length.k == 8
    length.record(8, 0)
    assert length.k == 4
    length.record(4, 0)
    length.record(2, 0)
    assert length.k == 1


def test_repeated_misses_at_k_1_pause_with_a_growing_backoff_then_probe() -> None:
    length = DraftLength(k_max=8, k_start=1, patience=2, backoff_start=4, backoff_max=16)
    length.record(1, 0)
    assert length.k == 1  # one miss is not yet a run
    length.record(1, 0)
    pauses = []
    for _ in range(4):  # pause, probe, miss: the pause doubles up to backoff_max
        assert length.paused and length.k == 0
        passes = 0
        while length.k == 0:
            length.record(0, 0)
            passes += 1
        pauses.append(passes)
        assert length.k == 1
        length.record(1, 0)  # the probe fails: paused again at once
    assert pauses == [4, 8, 16, 16]
    # a probe that is accepted ends the back-off
    while length.k == 0:
        length.record(0, 0)
    length.record(1, 1)
    assert length.k == 2 and not length.paused
    length.record(2, 0)
    length.record(1, 0)
    length.record(1, 0)
    passes = 0
    while length.k == 0:
        length.record(0, 0)
        passes += 1
    assert passes == 4


def test_a_pass_with_nothing_proposed_outside_a_pause_changes_nothing() -> None:
    length = DraftLength(k_max=8, k_start=3)
    for _ in range(10):
        length.record(0, 0)
    assert length.k == 3 and not length.paused


@given(
    k_max=st.integers(1, 12),
    data=st.data(),
    passes=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), max_size=200),
)
def test_k_stays_within_0_and_k_max_and_never_drafts_during_a_pause(
    k_max: int, data: st.DataObject, passes: list[tuple[float, float]]
) -> None:
    length = DraftLength(k_max=k_max, k_start=data.draw(st.integers(1, k_max)))
    for drafted, kept in passes:
        proposed = round(drafted * length.k)
        accepted = round(kept * proposed)
        length.record(proposed, accepted)
        assert 0 <= length.k <= k_max
        assert length.paused == (length.k == 0)


@given(passes=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), max_size=50))
def test_the_same_records_give_the_same_k(passes: list[tuple[int, int]]) -> None:
    one, two = DraftLength(), DraftLength()
    for proposed, accepted in passes:
        proposed = min(proposed, one.k)
        accepted = min(accepted, proposed)
        one.record(proposed, accepted)
        two.record(proposed, accepted)
        assert one.k == two.k


def test_record_refuses_counts_out_of_range_and_changes_nothing() -> None:
    length = DraftLength(k_max=8, k_start=4)
    for proposed, accepted in ((4, 5), (2, -1), (-1, 0), (5, 0)):
        with pytest.raises(ValueError):
            length.record(proposed, accepted)
    assert length.k == 4 and repr(length) == "<DraftLength k=4 k_max=8>"


def test_bad_draft_length_settings_are_typed_refusals() -> None:
    for kwargs in (
        {"k_max": 0, "k_start": 0},
        {"k_max": 4, "k_start": 5},
        {"k_max": 4, "k_start": 0},
        {"backoff_start": 8, "backoff_max": 4},
        {"patience": 0},
    ):
        with pytest.raises(DraftConfigError):
            DraftLength(**kwargs)


# -- timed: what a draft row costs decides ----------------------------------------------------


def _simulate(length: DraftLength, alpha: float, plain: float, row: float, passes: int) -> float:
    """Tokens a second over ``passes`` passes of a session whose drafts are each kept with
    chance ``alpha`` (given the ones before were), a plain pass taking ``plain`` seconds and
    each draft row ``row`` more (seeded: the same figures each run)."""
    rng = random.Random(7)
    tokens, seconds = 0, 0.0
    for _ in range(passes):
        k = length.k
        kept = 0
        while kept < k and rng.random() < alpha:
            kept += 1
        took = plain + k * row
        length.record(k, kept, took)
        tokens += kept + 1
        seconds += took
    return tokens / seconds


def test_a_timed_length_times_a_plain_pass_first_then_drafts_what_pays() -> None:
    length = DraftLength(k_max=8, k_start=4)
    assert length.k == 4
    length.record(4, 4, 0.050)  # a pass with drafts, timed before any plain one
    assert length.k == 0  # plain passes next, to know what drafts cost
    length.record(0, 0, 0.040)
    assert length.k == 0  # PLAIN_FIRST of them, before the model decides
    length.record(0, 0, 0.040)
    # cheap rows (2.5 ms a draft against 40 ms a pass) and every draft kept: draft a lot
    assert length.k >= 6
    for _ in range(20):
        length.record(length.k, length.k, 0.040 + 0.0025 * length.k)
    assert length.k == 8


def test_a_timed_length_stops_drafting_where_no_draft_pays_and_probes_again() -> None:
    length = DraftLength(k_max=8, k_start=4)
    length.record(0, 0, 0.030)
    for _ in range(10):  # rows as dear as a pass, and drafts never kept
        k = length.k
        length.record(k, 0, 0.030 * (1 + k))
    assert length.k == 0
    ks = []
    for _ in range(REPROBE + 1):
        ks.append(length.k)
        length.record(length.k, 0, 0.030 * (1 + length.k))
    assert ks.count(1) == 1 and set(ks) == {0, 1}  # one probe row in REPROBE + 1 passes


def test_a_timed_length_waits_twice_as_long_after_each_probe_that_missed() -> None:
    length = DraftLength(k_max=8, k_start=4)
    length.record(0, 0, 0.030)
    while length.k:  # rows as dear as a pass, and drafts never kept: it stops drafting
        length.record(length.k, 0, 0.030 * (1 + length.k))
    probes_at = []
    for n in range(4 * REPROBE_MAX):
        k = length.k
        if k:
            probes_at.append(n)
        length.record(k, 0, 0.030 * (1 + k))
    gaps = [b - a for a, b in itertools.pairwise(probes_at)]
    doubling = [REPROBE * 2**i + 1 for i in range(1, 8) if REPROBE * 2**i < REPROBE_MAX]
    assert gaps[: len(doubling)] == doubling and len(gaps) > len(doubling) + 1
    assert set(gaps[len(doubling) :]) == {REPROBE_MAX + 1}
    # a probe that keeps its draft (and pays nothing yet) brings the short wait back
    while not length.k:
        length.record(0, 0, 0.030)
    length.record(1, 1, 0.060)
    waited = 0
    while not length.k and waited < 10 * REPROBE_MAX:
        length.record(0, 0, 0.030)
        waited += 1
    assert waited == REPROBE


def test_a_fresh_length_drafts_two_tokens_first() -> None:
    assert DraftLength().k == 2
    assert DraftLength(k_max=8, k_start=4).k == 4


@settings(max_examples=25, deadline=None)
@given(
    alpha=st.floats(0.0, 0.98),
    row_share=st.floats(0.01, 1.5),  # a draft row's cost, as a share of a plain pass
)
def test_a_timed_length_is_never_much_slower_than_plain_decoding(
    alpha: float, row_share: float
) -> None:
    """Whatever the drafts' acceptance and a row's cost, a session drafting with a timed length
    decodes at least 0.95 x as fast as plain decoding over 400 passes (the first passes, and a
    probe now and then, are what it pays to learn)."""
    plain = 0.040
    rate = _simulate(DraftLength(k_max=8), alpha, plain, plain * row_share, 400)
    assert rate >= 0.95 / plain
    if alpha >= 0.8 and row_share <= 0.1:  # where drafts pay well, it takes the gain
        assert rate >= 2.0 / plain


def test_a_timed_length_learns_how_deep_drafts_are_kept() -> None:
    """Drafts are not kept independently of one another: the length keeps a chance per depth.
    Where the first draft of every pass is kept and the second never, one draft a pass is what
    pays; where a pass keeps all its drafts or none, as many as it may."""
    first_only = DraftLength(k_max=8, times=PassTimes(plain=0.040, row=0.004))
    for _ in range(30):
        k = first_only.k
        first_only.record(k, min(k, 1), 0.040 + 0.004 * k)
    assert first_only.k == 1
    runs = DraftLength(k_max=8, times=PassTimes(plain=0.040, row=0.004))
    for n in range(30):  # every other pass keeps everything, the others nothing
        k = runs.k
        runs.record(k, k if n % 2 else 0, 0.040 + 0.004 * k)
    assert runs.k == 8


def test_a_warm_length_drafts_from_its_first_pass_and_keeps_learning() -> None:
    times = PassTimes(plain=0.040, row=0.0025)
    warm = DraftLength(k_max=8, times=times)
    assert warm.k >= 2 and warm.times == times  # no plain pass first: the route's are known
    assert DraftLength(k_max=8).times is None
    for _ in range(20):  # everything kept: the length grows to what pays
        warm.record(warm.k, warm.k, 0.040 + 0.0025 * warm.k)
    assert warm.k == 8
    # its own passes move the averages: rows four times as dear now, and nothing kept
    for _ in range(40):
        warm.record(warm.k, 0, 0.040 + 0.010 * warm.k)
    assert warm.k <= 1
    held = warm.times
    assert held is not None and held.row > 0.008 and held.plain == pytest.approx(0.040)
    # rows as dear as a pass: a warm length with those timings does not draft at all
    assert DraftLength(k_max=8, times=PassTimes(plain=0.040, row=0.040)).k == 0


def test_pass_times_refuse_what_cannot_be_a_time() -> None:
    for plain, row in ((0.0, 0.001), (-1.0, 0.001), (0.04, -0.001)):
        with pytest.raises(ValueError):
            PassTimes(plain=plain, row=row)
