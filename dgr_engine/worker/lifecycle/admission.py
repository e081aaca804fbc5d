"""Admission of new sessions to a worker whose slots may all be taken: a first-come,
first-served line with a bounded wait, instead of an immediate refusal.

An open that needs a slot takes a place in line and waits until it is first *and* a slot is
free, for at most its wait; it then keeps the turn while it opens (so two admitted opens never
race for one slot) and gives it up when done. Whoever frees a slot (a close, an expired lease)
calls :meth:`Admission.changed`. A newcomer never passes a session that waited: it queues
behind it even when a slot happens to be free. Loop-only: every method runs on the worker's
event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable

from dgr_engine.errors import CapacityExceeded

RETRY_HINT_PER_WAITER = 0.25
"""Seconds of retry hint a busy answer gives per open still in line (bounded below by one
step and above by :data:`RETRY_HINT_MAX`)."""
RETRY_HINT_MAX = 5.0


class Admission:
    """The line of opens waiting for a slot. ``free_slots()`` counts slots free now."""

    def __init__(self, free_slots: Callable[[], int]) -> None:
        self._free_slots = free_slots
        self._line: deque[object] = deque()
        self._wake: asyncio.Future[None] | None = None

    @property
    def waiting(self) -> int:
        """Opens in line now (the one holding the turn included)."""
        return len(self._line)

    @contextlib.asynccontextmanager
    async def turn(self, wait: float, what: str) -> AsyncIterator[None]:
        """Waits (at most ``wait`` seconds) to be first in line with a slot free, then holds
        the turn for the body. Raises :class:`CapacityExceeded` (with a retry hint) when the
        wait runs out; the place in line is given up either way."""
        ticket = object()
        self._line.append(ticket)
        try:
            await self._wait_for_turn(ticket, wait, what)
            yield
        finally:
            self._line.remove(ticket)
            self.changed()

    def changed(self) -> None:
        """A slot may have been freed or the line moved: every waiter looks again."""
        wake, self._wake = self._wake, None
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _wait_for_turn(self, ticket: object, wait: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(wait, 0.0)
        while not (self._line[0] is ticket and self._free_slots() > 0):
            remaining = deadline - loop.time()
            if remaining <= 0:
                ahead = self._line.index(ticket)
                error = CapacityExceeded(
                    f"DGR_E_CAPACITY: {what}: no free session slot within {wait:g} s"
                    f" ({ahead} open(s) ahead in line)"
                )
                error.retry_after = min(RETRY_HINT_PER_WAITER * (ahead + 1), RETRY_HINT_MAX)
                raise error
            if self._wake is None:
                self._wake = loop.create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._wake), remaining)
