"""Connections to a worker's side ports that have not yet said who they are (``docs/
reliability.md``, "Side ports").

The frame path's and the native path's ports take connections from anyone who can reach
them, before any secret is shown. An honest peer introduces itself at once (a frame link's
``OPEN``, a native link's ``HELLO``); a peer that connects and says nothing, or half of a
header, holds only a place here, for ``hello_seconds`` at most. The places are bounded per
source address and in total, apart from the worker's session capacity, and a full gate never
turns a newcomer away: it evicts the oldest waiting connection of the source that holds the
most. So idle or stalled connections from one source cost that source its own oldest ones,
and an honest peer, which waits here for a round trip at most, is neither refused nor made
to wait by them. A source over its share gives up only connections that waited ``grace``
already: a burst of honest connections from one host (many sessions opening at once) is let
be while their introductions are read; the total is a hard bound.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable

import attrs

from dgr_engine.wire.keepalive import HELLO_SECONDS

__all__ = ["HELLO_SECONDS", "IntroductionGate", "Waiting"]

GRACE_SECONDS = 1.0
"""How long a connection waits before its source's share counts against it."""


@attrs.define(eq=False)
class Waiting:
    """One connection's place in the gate, until it is introduced or gone."""

    source: str
    evict: Callable[[], None] = attrs.field(repr=False)
    """Ends the connection (the gate needs its place for a newcomer)."""
    order: int = 0
    since: float = 0.0
    """When it came (the gate's clock)."""


class IntroductionGate:
    """At most ``total`` waiting connections in all and, of those that waited ``grace``
    seconds, ``per_source`` from one source address (see the module's text). Not
    thread-safe: one event loop's accept path uses it."""

    def __init__(
        self,
        *,
        per_source: int,
        total: int,
        grace: float = GRACE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= per_source <= total:
            raise ValueError(f"need 1 <= per_source <= total, got {per_source} and {total}")
        self.per_source = per_source
        self.total = total
        self.grace = grace
        self._clock = clock
        self._by_source: dict[str, collections.OrderedDict[int, Waiting]] = {}
        self._count = 0
        self._orders = itertools.count()
        self.evicted = 0
        """Connections ended to make room (each one a source's oldest)."""

    @property
    def waiting(self) -> int:
        return self._count

    def admit(self, source: str, evict: Callable[[], None]) -> Waiting:
        """A new connection from ``source`` waits for its introduction; an older one is
        evicted first when ``source`` or the gate is full."""
        now = self._clock()
        held = self._by_source.get(source)
        if self._count >= self.total:
            self._evict(max(self._by_source, key=lambda s: len(self._by_source[s])))
        elif held is not None and len(held) >= self.per_source:
            oldest = next(iter(held.values()))
            if now - oldest.since >= self.grace:  # a burst's own connections are let be
                self._evict(source)
        place = Waiting(source, evict, next(self._orders), now)
        self._by_source.setdefault(source, collections.OrderedDict())[place.order] = place
        self._count += 1
        return place

    def leave(self, place: Waiting) -> None:
        """The connection was introduced, refused or went away: its place is free. Idempotent."""
        held = self._by_source.get(place.source)
        if held is None or held.pop(place.order, None) is None:
            return
        self._count -= 1
        if not held:
            del self._by_source[place.source]

    def _evict(self, source: str) -> None:
        held = self._by_source[source]
        _, oldest = next(iter(held.items()))
        self.leave(oldest)
        self.evicted += 1
        oldest.evict()
