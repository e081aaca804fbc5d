"""The gate of connections not yet introduced (``worker/calls/introductions.py``): bounded per
source and in all, a newcomer never turned away, and the place it needs taken from the source
that holds the most, oldest first."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dgr_engine.worker.calls.introductions import IntroductionGate, Waiting


class Ended:
    def __init__(self) -> None:
        self.ended: list[str] = []

    def place(self, gate: IntroductionGate, source: str, name: str) -> Waiting:
        return gate.admit(source, lambda: self.ended.append(name))


def test_a_full_source_gives_up_its_own_oldest_connection() -> None:
    gate, log = IntroductionGate(per_source=2, total=10, grace=0.0), Ended()
    log.place(gate, "attacker", "a1")
    log.place(gate, "attacker", "a2")
    honest = log.place(gate, "honest", "h1")
    log.place(gate, "attacker", "a3")
    assert log.ended == ["a1"] and gate.waiting == 3 and gate.evicted == 1
    gate.leave(honest)  # introduced
    gate.leave(honest)  # idempotent
    assert gate.waiting == 2


def test_a_full_gate_takes_the_place_from_the_source_holding_the_most() -> None:
    gate, log = IntroductionGate(per_source=3, total=4, grace=0.0), Ended()
    for name in ("a1", "a2", "a3"):
        log.place(gate, "attacker", name)
    log.place(gate, "honest", "h1")
    log.place(gate, "other", "o1")  # full: the attacker's oldest goes, not the honest one
    assert log.ended == ["a1"] and gate.waiting == 4


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.sampled_from("abcde"), st.booleans()), max_size=200))
def test_bounds_hold_and_every_connection_is_held_once(steps: list[tuple[str, bool]]) -> None:
    gate = IntroductionGate(per_source=3, total=7, grace=0.0)
    held: dict[int, tuple[str, Waiting | None]] = {}  # token -> (source, its place)

    def evict(token: int) -> None:
        assert token in held, "a connection ended twice, or one already gone"
        del held[token]

    for token, (source, leaves) in enumerate(steps):
        if leaves and held:
            oldest = min(held)
            place = held.pop(oldest)[1]
            assert place is not None
            gate.leave(place)
        else:
            held[token] = (source, None)
            held[token] = (source, gate.admit(source, lambda t=token: evict(t)))
        assert gate.waiting == len(held) <= 7
        by_source = [sum(1 for s, _ in held.values() if s == x) for x in "abcde"]
        assert max(by_source) <= 3


def test_a_burst_from_one_source_is_let_be_until_it_waited_the_grace() -> None:
    """Many sessions opening at once from one host: over its share, but none has waited the
    grace yet, so none is evicted; once the oldest has, a newcomer takes its place. The total
    is a hard bound whatever their age."""
    now = [0.0]
    gate, log = IntroductionGate(per_source=2, total=5, grace=1.0, clock=lambda: now[0]), Ended()
    for name in ("b1", "b2", "b3", "b4"):
        log.place(gate, "host", name)
    assert log.ended == [] and gate.waiting == 4
    now[0] = 1.0
    log.place(gate, "host", "b5")
    assert log.ended == ["b1"]
    log.place(gate, "other", "o1")
    log.place(gate, "other", "o2")  # full: the source holding the most gives its oldest
    assert log.ended == ["b1", "b2"] and gate.waiting == 5


def test_limits_are_checked() -> None:
    for per_source, total in ((0, 4), (5, 4)):
        with pytest.raises(ValueError, match="per_source <= total"):
            IntroductionGate(per_source=per_source, total=total)
