"""The prompt prefixes a worker keeps across sessions (``docs/prefix-cache.md``).

A client that closes a session may ask the stage to keep the session's first positions under a
digest it names (``CloseSessionRequest.keep_prefix``); a later open of the same client naming
that digest starts with them (``OpenSessionRequest.prefix``). What is kept is the engine's own
saved state of those positions (``ShardEngine.save_state``: this shard's layers only, one
model, one lane: a worker serves exactly one), so nothing of it can cross lanes or models.

:class:`PrefixStore` holds them, least recently used first out, within ``capacity`` bytes, per
client identity (a client's TLS name, else its host): a digest names what its client says the
positions hold, and only that client's opens may take them, so one client can never hand
another a state it did not compute.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs


@attrs.frozen
class KeptPrefix:
    """A kept prefix: its positions and the engine state that holds them."""

    length: int
    state: bytes = attrs.field(repr=False)


@attrs.define
class PrefixCounters:
    """What the store did, for the worker's metrics."""

    kept: int = 0
    """Prefixes stored."""
    hits: int = 0
    """Opens that found the prefix they named."""
    misses: int = 0
    """Opens that did not (never kept, evicted, another client's, too short)."""
    positions_reused: int = 0
    """Positions the hits started with: rows no stage computed again."""
    evicted: int = 0
    """Prefixes dropped for room."""


class PrefixStore:
    """Kept prefixes by (client, digest), within ``capacity`` bytes (0: keeps nothing)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.counters = PrefixCounters()
        self._held: OrderedDict[tuple[str, bytes], KeptPrefix] = OrderedDict()
        self._bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._held)

    def put(self, client: str, digest: bytes, kept: KeptPrefix) -> bool:
        """Keeps ``kept`` for ``client`` under ``digest`` (replacing one of that name), dropping
        the least recently used for room; False when it alone exceeds the capacity."""
        size = len(kept.state)
        if size > self.capacity:
            return False
        old = self._held.pop((client, digest), None)
        if old is not None:
            self._bytes -= len(old.state)
        while self._held and self._bytes + size > self.capacity:
            _key, dropped = self._held.popitem(last=False)
            self._bytes -= len(dropped.state)
            self.counters.evicted += 1
        self._held[(client, digest)] = kept
        self._bytes += size
        self.counters.kept += 1
        return True

    def take(self, client: str, digest: bytes, length: int) -> KeptPrefix | None:
        """The prefix ``client`` kept under ``digest`` when it holds at least ``length``
        positions (it stays kept, now the most recently used); ``None`` otherwise."""
        kept = self._held.get((client, digest))
        if kept is None or kept.length < length:
            self.counters.misses += 1
            return None
        self._held.move_to_end((client, digest))
        self.counters.hits += 1
        self.counters.positions_reused += length
        return kept
