"""The client's book of kept prompt prefixes (``dgr_session/prefixes.py``): a session starts
only from whole chunks of its own chunk size that an earlier session's prompt computed the
same way, leaving at least one token of its prompt to compute."""

from __future__ import annotations

from dgr_session.prefixes import PrefixBook, keep_length, prefix_digest

ROUTE = (("127.0.0.1:1", 0, 15), ("127.0.0.1:2", 15, 30))
OTHER = (("127.0.0.1:3", 0, 15), ("127.0.0.1:2", 15, 30))


def kept_book(prompt: list[int], chunk: int) -> PrefixBook:
    book = PrefixBook()
    keep = book.to_keep(prompt, chunk)
    assert keep is not None
    book.kept(ROUTE, prompt, chunk, keep)
    return book


def test_a_session_keeps_the_whole_chunks_of_its_prompt() -> None:
    book = PrefixBook()
    keep = book.to_keep(list(range(150)), 64)
    assert keep is not None and keep.length == 128 == keep_length(150, 64)
    assert keep.digest == prefix_digest(list(range(128)), 64)
    assert keep.digest != prefix_digest(list(range(128)), 32)  # the chunking is in the name
    assert book.to_keep(list(range(40)), 64) is None  # not one whole chunk


def test_the_next_prompt_starts_from_the_whole_chunks_both_share() -> None:
    first = list(range(150))
    book = kept_book(first, 64)
    found = book.find(ROUTE, [*first, 7, 8, 9], 64)
    assert found is not None and found.length == 128
    diverged = [*range(100), -1, *range(60)]  # differs at position 100: one whole chunk
    found = book.find(ROUTE, diverged, 64)
    assert found is not None and found.length == 64
    assert book.find(ROUTE, [*range(60), -1, *range(90)], 64) is None  # under one chunk


def test_at_least_one_prompt_token_is_left_to_compute() -> None:
    book = kept_book(list(range(128)), 64)
    found = book.find(ROUTE, list(range(128)), 64)  # the same prompt again
    assert found is not None and found.length == 64


def test_another_route_or_chunk_size_starts_from_nothing() -> None:
    first = list(range(150))
    book = kept_book(first, 64)
    assert book.find(OTHER, [*first, 1], 64) is None
    assert book.find(ROUTE, [*first, 1], 32) is None


def test_the_book_is_bounded() -> None:
    book = PrefixBook(capacity=2)
    for start in range(3):
        prompt = list(range(start * 1000, start * 1000 + 64))
        keep = book.to_keep(prompt, 64)
        assert keep is not None
        book.kept(ROUTE, prompt, 64, keep)
    assert len(book) == 2
    assert book.find(ROUTE, [*range(64), 5], 64) is None  # the oldest went first
