"""Stop strings over streamed text: nothing that could still become a stop string is sent
early, the output ends right before the first stop string, whatever the pieces' cuts."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dgr_engine.serve.stops import StopMatcher


def stream(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(p) for p in pieces) + matcher.flush()
    return out, matcher.stopped


def test_the_text_ends_before_a_stop_string_split_across_pieces() -> None:
    assert stream(["END"], ["Paris E", "N", "D and more"]) == ("Paris ", True)


def test_a_held_prefix_that_does_not_complete_is_sent() -> None:
    matcher = StopMatcher(["END"])
    assert matcher.push("a EN") == "a "  # "EN" may begin END: held
    assert matcher.push("x") == "ENx"
    assert matcher.flush() == "" and not matcher.stopped


def test_the_earliest_of_several_stop_strings_wins() -> None:
    assert stream(["world", "lo"], ["hello world"]) == ("hel", True)


def test_nothing_is_sent_after_the_stop() -> None:
    matcher = StopMatcher(["\n"])
    assert matcher.push("one\ntwo") == "one"
    assert matcher.push("three") == "" and matcher.flush() == ""


@given(
    text=st.text(alphabet="abc\n", max_size=40),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_any_cut_of_the_text_gives_the_text_before_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    want = text[: min(found)] if found else text
    assert stream(stops, pieces) == (want, bool(found))
