"""Stop strings in streamed text: found across token boundaries, the text cut before them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dgr_engine.client.text import StopText


def streamed(stop: StopText, pieces: list[str]) -> str:
    return "".join(stop.push(piece) for piece in pieces) + stop.flush()


@given(
    st.text(alphabet="ab\n.", max_size=40),
    st.lists(st.text(alphabet="ab\n.", min_size=1, max_size=4), min_size=1, max_size=3),
    st.data(),
)
def test_any_cut_into_pieces_gives_the_text_before_the_first_stop(
    text: str, stops: list[str], data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stop = StopText(stops)
    hits = [text.find(s) for s in stops if s in text]
    want = text[: min(hits)] if hits else text
    assert streamed(stop, pieces) == want
    assert (stop.found is not None) == bool(hits)


def test_a_stop_split_over_three_pieces_is_found_and_nothing_after_it_shows() -> None:
    stop = StopText(["\n\nUser:"])
    assert stop.push("Paris.\n") == "Paris."  # "\n" might begin the stop: held
    assert stop.push("\nUs") == ""
    assert stop.push("er: and then") == ""
    assert stop.found == "\n\nUser:"
    assert stop.push("more") == "" and stop.flush() == ""


def test_held_text_that_never_completes_a_stop_comes_out() -> None:
    stop = StopText(["END"])
    assert stop.push("the EN") == "the "
    assert stop.push("D") == ""  # completed: cut
    other = StopText(["END"])
    assert other.push("the EN") == "the " and other.push("ds") == "ENds"
    assert other.push("E") == "" and other.flush() == "E"


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be empty"):
        StopText(["x", ""])
