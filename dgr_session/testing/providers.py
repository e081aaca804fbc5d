"""Route providers for tests: from a pool of stages, from a script, or always one route."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from dgr_session.faults import FailureReport
from dgr_session.identity import ModelIdentity
from dgr_session.route import Route
from dgr_session.testing.fake_transport import FakeTransport
from dgr_session.testing.routes import make_route


class PoolRouteProvider:
    """Builds routes from a pool of workers, as a tracker with perfect health knowledge would.

    Request *n* uses layout ``layouts[n % len(layouts)]`` (interior cut points) and puts each
    stage on the next healthy worker (rotating, distinct within a route). ``None`` when too few
    workers are healthy.
    """

    def __init__(
        self,
        transport: FakeTransport,
        workers: Sequence[str],
        layouts: Sequence[Sequence[int]],
        *,
        identity: ModelIdentity,
        width: int = 16,
    ) -> None:
        self._transport = transport
        self._workers = tuple(workers)
        self._layouts = tuple(tuple(cuts) for cuts in layouts)
        self._identity = identity
        self._width = width
        self._requests = 0
        #: Every report received, in order.
        self.reports: list[FailureReport] = []

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        if report is not None:
            self.reports.append(report)
        n = self._requests
        self._requests += 1
        cuts = self._layouts[n % len(self._layouts)]
        count = len(self._workers)
        healthy = [
            self._workers[(n + k) % count]
            for k in range(count)
            if self._transport.healthy(self._workers[(n + k) % count])
        ]
        if len(healthy) < len(cuts) + 1:
            return None
        return make_route(
            healthy[: len(cuts) + 1], cuts, identity=self._identity, width=self._width
        )


HANG = "hang"
"""In a :class:`ScriptedRouteProvider` script: never answer this request."""


class ScriptedRouteProvider:
    """Answers route requests from a script, in order: a route, ``None`` (no route), or
    :data:`HANG` (never answers). After the script, answers with the last entry (or ``None``)."""

    def __init__(self, script: Sequence[Route | None | str]) -> None:
        self._script = list(script)
        self._index = 0
        #: ``(session_id, report)`` per request, in order.
        self.requests: list[tuple[str, FailureReport | None]] = []

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        self.requests.append((session_id, report))
        if not self._script:
            return None
        entry = self._script[min(self._index, len(self._script) - 1)]
        self._index += 1
        if entry == HANG:
            await asyncio.get_running_loop().create_future()  # cancelled when the session ends
        if isinstance(entry, Route):
            return entry
        return None


class FixedRouteProvider:
    """Always answers with the same route."""

    def __init__(self, route: Route) -> None:
        self.route = route

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        return self.route
