"""The sans-I/O core with kept prompt prefixes (``docs/prefix-cache.md``): opens name the
book's prefix; stages that all opened with it start the prefill after it; stages that answered
differently are opened again empty before any row runs; a session that ends well asks every
stage to keep its whole prompt chunks; a penalised sampler's session keeps and reuses nothing."""

from __future__ import annotations

from typing import Any

from dgr_session import Cancel, CloseStage, FaultKind, Forward, OpenStage, StageOpened
from dgr_session.prefixes import PrefixBook, PrefixRef, route_key
from dgr_session.sampling import Sampling
from tests.session.test_session_core import SID, Driver, of, route

CHUNK = 4
PROMPT = tuple(range(10, 20))  # 10 tokens: two whole chunks of 4


def book_with(prompt: tuple[int, ...], r: Any) -> PrefixBook:
    book = PrefixBook()
    keep = book.to_keep(prompt, CHUNK)
    assert keep is not None
    book.kept(route_key(r), prompt, CHUNK, keep)
    return book


def opened(d: Driver, index: int, next_pos: int) -> list[Any]:
    return d.feed(StageOpened(SID, d.core.epoch, index, next_pos))


def test_stages_that_kept_the_prefix_start_the_prefill_after_it() -> None:
    r = route("a:1", "b:2")
    d = Driver(prompt=PROMPT, prefixes=book_with(PROMPT[:8], r), prefill_chunk=CHUNK)
    d.start()
    opens = of(d.assign(r), OpenStage)
    assert {o.prefix.length for o in opens} == {8}
    assert opened(d, 0, 8) == []
    forwards = of(opened(d, 1, 8), Forward)
    assert forwards[0].positions == range(8, 10)
    assert forwards[0].token_ids == PROMPT[8:]


def test_stages_that_answered_differently_are_opened_again_empty() -> None:
    r = route("a:1", "b:2")
    d = Driver(prompt=PROMPT, prefixes=book_with(PROMPT[:8], r), prefill_chunk=CHUNK)
    d.start()
    d.assign(r)
    opened(d, 0, 8)
    again = opened(d, 1, 0)  # stage 1 had lost it
    reopens = of(again, OpenStage)
    assert [(o.stage_index, o.prefix.length) for o in reopens] == [(0, 0)]
    assert not of(again, Forward)
    forwards = of(opened(d, 0, 0), Forward)
    assert forwards[0].positions == range(0, CHUNK)  # the whole prompt, in its chunks


def test_positions_nobody_asked_for_are_a_protocol_fault() -> None:
    r = route("a:1", "b:2")
    d = Driver(prompt=PROMPT, prefill_chunk=CHUNK)
    d.start()
    d.assign(r)
    closes = of(opened(d, 0, 8), CloseStage)
    assert len(closes) == 2  # the epoch ends
    assert d.core.reports[-1].fault is FaultKind.PROTOCOL


def test_a_session_that_ends_well_asks_its_stages_to_keep_its_whole_chunks() -> None:
    r = route("a:1", "b:2")
    book = PrefixBook()
    d = Driver(prompt=PROMPT, max_new_tokens=1, prefixes=book, prefill_chunk=CHUNK).running(r)
    out = d.step(5)
    closes = of(out, CloseStage)
    assert len(closes) == 2
    keep = closes[0].keep
    assert isinstance(keep, PrefixRef) and keep.length == 8
    assert book.find(route_key(r), (*PROMPT, 5), CHUNK) == keep


def test_a_cancelled_session_asks_its_stages_to_keep_its_whole_chunks_too() -> None:
    r = route("a:1", "b:2")
    d = Driver(prompt=PROMPT, max_new_tokens=4, prefixes=PrefixBook(), prefill_chunk=CHUNK)
    d.running(r).step(5)
    closes = of(d.feed(Cancel(SID, "a stop string")), CloseStage)
    assert [c.keep.length for c in closes] == [8, 8]


def test_a_penalised_sampler_keeps_and_reuses_nothing() -> None:
    r = route("a:1", "b:2")
    penalised = Sampling(seed=1, temperature=0.7, presence_penalty=0.5)
    book = book_with(PROMPT[:8], r)
    d = Driver(
        prompt=PROMPT, max_new_tokens=1, prefixes=book, prefill_chunk=CHUNK, sampling=penalised
    )
    d.start()
    assert {o.prefix for o in of(d.assign(r), OpenStage)} == {None}
    d.open_all()
    assert {c.keep for c in of(d.step(5), CloseStage)} == {None}
