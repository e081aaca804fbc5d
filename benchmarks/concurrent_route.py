"""Concurrent route sessions for the benchmarks: a route of loopback ``dgr worker`` processes
kept up across rounds, driving N greedy sessions at once, and the aggregate decode tok/s of
their token time stamps (``benchmarks.peers`` and ``benchmarks.co_batch``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.options import EngineOptions
from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_session import EvidenceClass, FailurePolicy, SessionManager, SessionState


def aggregate_tps(stamps: Sequence[Sequence[float]]) -> float:
    """Aggregate decode tok/s of concurrent sessions from each one's token time stamps: the
    tokens stamped after every session had its first token and before the first session
    finished, over that window; when the window holds too few tokens (sessions that barely
    overlap), every token after each session's first over the whole span."""
    firsts = [s[0] for s in stamps]
    lasts = [s[-1] for s in stamps]
    t0, t1 = max(firsts), min(lasts)
    inside = sum(1 for s in stamps for t in s if t0 < t <= t1)
    if t1 > t0 and inside >= 2 * len(stamps):
        return inside / (t1 - t0)
    total = sum(len(s) - 1 for s in stamps)
    return total / (max(lasts) - min(firsts))


class LoopbackRoute:
    """A route of loopback workers (``provider``), a transport and a session manager over it,
    started and closed together; subclasses build the three."""

    provider: LoopbackRouteProvider
    transport: GrpcStageTransport
    manager: SessionManager

    async def start(self) -> None:
        await self.provider.start()

    async def aclose(self) -> None:
        try:
            await self.manager.aclose()
            await self.transport.aclose()
        finally:
            await self.provider.aclose()


class ConcurrentRoute(LoopbackRoute):
    """A 2-stage (or any) route of loopback workers kept up across rounds, driving N sessions
    at once."""

    def __init__(
        self,
        path: Path,
        layout: list[tuple[int, int]],
        options: EngineOptions,
        worker_args: Sequence[str],
    ) -> None:
        self.provider = LoopbackRouteProvider(
            path, layout, options=options, worker_args=worker_args
        )
        self.transport = GrpcStageTransport(timeout=120.0)
        policy = FailurePolicy(step_deadline=120.0, session_deadline=1200.0)
        self.manager = SessionManager(
            self.transport, self.provider, policy=policy, required_evidence=EvidenceClass.FIXTURE
        )
        self._runs = 0

    async def run(
        self, prompts: Sequence[list[int]], n_decode: int
    ) -> tuple[float, list[list[int]]]:
        """(aggregate decode tok/s, tokens of each session)."""
        self._runs += 1
        stamps: list[list[float]] = [[] for _ in prompts]
        handles = [
            self.manager.start(
                prompt,
                max_new_tokens=n_decode + 1,
                session_id=f"agg-{self._runs}-{i}",
                on_token=partial(_stamp, stamps[i]),
            )
            for i, prompt in enumerate(prompts)
        ]
        results = await asyncio.gather(*(h.wait() for h in handles))
        for result in results:
            if result.state is not SessionState.DONE:
                raise RuntimeError(f"concurrent session failed: {result.error}")
        return aggregate_tps(stamps), [list(r.tokens) for r in results]


def _stamp(times: list[float], _token: int) -> None:
    times.append(time.perf_counter())
