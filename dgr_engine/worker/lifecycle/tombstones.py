"""Closes that arrived before their opens.

A client whose open timed out (the worker was stalled, or slow to admit) closes that epoch and
moves on; when the worker then handles both requests, the close can come first (it finds
nothing) and the open after it, which would hold a slot nobody will ever use again. The same
holds when the close finds only an older epoch of the session: it closes that one, and the open
of its own epoch, still in line for a slot, would take the slot it freed (the fault campaign's
leak). The session table remembers each close that found nothing of its epoch, for a bounded
time and number, and refuses the open of that epoch (or an older one) when it arrives: a dgr
client never reopens an epoch it closed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import attrs


@attrs.define
class Tombstones:
    """``(session, epoch)`` pairs closed before they were opened, kept ``ttl`` seconds (at most
    ``limit`` of them, the oldest dropped first)."""

    clock: Callable[[], float]
    ttl: float
    limit: int = 4096
    _entries: OrderedDict[str, tuple[int, float]] = attrs.field(factory=OrderedDict, init=False)

    def record(self, session_id: str, epoch: int) -> None:
        """A close of ``(session_id, epoch)`` found nothing open at that epoch."""
        held = self._entries.pop(session_id, None)
        newest = max(epoch, held[0]) if held is not None else epoch
        self._entries[session_id] = (newest, self.clock() + self.ttl)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def blocks(self, session_id: str, epoch: int) -> bool:
        """True when an open of ``(session_id, epoch)`` comes after a close of it (or of a newer
        epoch) that found nothing, within the time kept."""
        entry = self._entries.get(session_id)
        if entry is None:
            return False
        closed_epoch, until = entry
        if self.clock() >= until:
            del self._entries[session_id]
            return False
        return epoch <= closed_epoch

    def __len__(self) -> int:
        return len(self._entries)
