"""The workers' admission hints, kept for the clients of an overloaded route.

A worker with no free session slot answers an open with "busy" and a hint: how long to wait
before asking again (``CapacityExceeded.retry_after``, a :class:`~dgr_session.errors.StageBusy`).
The session waits that long and asks again within its admission budget; when the budget runs
out it fails with :class:`~dgr_session.errors.AdmissionTimeout`, and the server answers 503
with ``Retry-After`` = the newest hint the session was given. :class:`BusyHints` is the stage
transport that notes them on their way to the session.
"""

from __future__ import annotations

from typing import Any

from dgr_session.commands import Forward
from dgr_session.errors import StageBusy
from dgr_session.route import StageSpec
from dgr_session.transport import StageResult, StageTransport


class BusyHints:
    """A :class:`~dgr_session.transport.StageTransport` that passes every call to ``inner``
    and keeps, per session, the newest retry hint a busy stage answered its open with; any
    other attribute is ``inner``'s (its counters, a chain's ``session_starting``)."""

    def __init__(self, inner: StageTransport) -> None:
        self.inner = inner
        # Invariant: holds a session only between a busy answer with a hint and forget().
        self._hints: dict[str, float] = {}

    def retry_after(self, session_id: str) -> float | None:
        """The newest hint the session was given (seconds), ``None`` when none was."""
        return self._hints.get(session_id)

    def forget(self, session_id: str) -> None:
        """The session has ended: drop its hint."""
        self._hints.pop(session_id, None)

    async def open(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        try:
            await self.inner.open(stage, session_id, epoch)
        except StageBusy as busy:
            if busy.retry_after is not None:
                self._hints[session_id] = busy.retry_after
            raise

    async def forward(self, call: Forward) -> StageResult:
        return await self.inner.forward(call)

    async def close(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        await self.inner.close(stage, session_id, epoch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
