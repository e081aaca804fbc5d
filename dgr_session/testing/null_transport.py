"""A stage transport that answers at once with constant results (for benchmarks)."""

from __future__ import annotations

import asyncio

from dgr_session.commands import Forward
from dgr_session.route import StageSpec
from dgr_session.sampling import Sampling
from dgr_session.transport import Boundary, Logits, StageResult, StageTransport


class NullTransport(StageTransport):
    """Answers every call at once with constant results (token 0). When :attr:`gate` is set,
    forwards wait for it first, which parks every session mid-step."""

    _BOUNDARY = Boundary(None)
    _LOGITS = Logits((1.0, 0.0))

    def __init__(self) -> None:
        #: Forwards await this future while it is set.
        self.gate: asyncio.Future[None] | None = None

    async def open(
        self, stage: StageSpec, session_id: str, epoch: int, sampling: Sampling | None = None
    ) -> None:
        return None

    async def forward(self, call: Forward) -> StageResult:
        if self.gate is not None:
            await self.gate
        return self._BOUNDARY if call.stage.boundary_out else self._LOGITS

    async def close(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        return None
