"""What the page shows of the route: each stage as its worker describes itself now (endpoint,
layer range, lane and evidence class, load, sessions), read from the workers' adverts
(``Describe``) when asked, so a stage that stopped answering shows as unreachable.

:class:`StageStatus` is one stage's view; :class:`AdvertStages` reads them from the workers;
:func:`route_json` is ``GET /v1/route``'s body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
from loguru import logger

from dgr_engine.client.routes import describe
from dgr_engine.security.tls import ClientTls
from dgr_engine.wire.advert import Advert


@attrs.frozen
class StageStatus:
    """One stage as the page shows it."""

    index: int
    """Place in the route (0: the first)."""
    endpoint: str
    """``host:port`` (or the in-process name)."""
    layers: tuple[int, int]
    """Owned layer range ``[begin, end)``."""
    serving: bool
    """It answered; every figure below is from its answer (else zero or empty)."""
    detail: str = ""
    """Why it is not serving (empty when it is)."""
    backend: str = ""
    hardware: str = ""
    certification: str = ""
    """``certified`` or ``dark``."""
    evidence: str | None = None
    """Evidence class of its certification (``None``: dark)."""
    lane_id: str = ""
    sessions_open: int = 0
    sessions_max: int = 0
    sessions_waiting: int = 0
    context_per_session: int = 0
    in_flight: int = 0
    """Forwards running or queued."""
    rows_per_second: float = 0.0
    """Rows forwarded per second over the worker's recent window."""

    @classmethod
    def from_advert(cls, index: int, endpoint: str, advert: Advert) -> StageStatus:
        lane, capacity = advert.lane, advert.capacity
        return cls(
            index=index,
            endpoint=endpoint,
            layers=(advert.span.layer_begin, advert.span.layer_end),
            serving=True,
            backend=lane.backend,
            hardware=lane.hardware,
            certification=lane.certification.value,
            evidence=None if lane.evidence is None else lane.evidence.value,
            lane_id=lane.lane_id,
            sessions_open=capacity.sessions_open,
            sessions_max=capacity.sessions_max,
            sessions_waiting=capacity.sessions_waiting,
            context_per_session=capacity.context_per_session,
            in_flight=advert.load.in_flight,
            rows_per_second=advert.load.rows_per_second,
        )

    @classmethod
    def unreachable(
        cls, index: int, endpoint: str, layers: tuple[int, int], detail: str
    ) -> StageStatus:
        return cls(index=index, endpoint=endpoint, layers=layers, serving=False, detail=detail)


class StageSource(Protocol):
    """Where the route's stages are read from."""

    async def stages(self) -> Sequence[StageStatus]:
        """Every stage, in route order, as it is now."""
        ...


async def _read(
    stages: Sequence[tuple[str, tuple[int, int]]], tls: ClientTls | None, timeout: float
) -> list[StageStatus]:
    """Each ``(endpoint, layers)`` as its worker's advert says now, all asked at once."""
    adverts = await asyncio.gather(
        *(describe(e, timeout=timeout, tls=tls) for e, _ in stages), return_exceptions=True
    )
    out = []
    for index, ((endpoint, layers), advert) in enumerate(zip(stages, adverts, strict=True)):
        if isinstance(advert, Advert):
            out.append(StageStatus.from_advert(index, endpoint, advert))
        elif isinstance(advert, Exception):
            why = str(advert).splitlines()[0] if str(advert) else type(advert).__name__
            out.append(StageStatus.unreachable(index, endpoint, layers, why))
        else:  # a BaseException (cancellation) is not the stage's state
            raise advert
    return out


class AdvertStages:
    """The stages of workers at known endpoints, read from their adverts (``timeout`` seconds
    each, all at once)."""

    def __init__(
        self,
        stages: Sequence[tuple[str, tuple[int, int]]],
        *,
        tls: ClientTls | None = None,
        timeout: float = 3.0,
    ) -> None:
        self.endpoints = tuple(stages)
        self.tls = tls
        self.timeout = timeout

    async def stages(self) -> list[StageStatus]:
        return await _read(self.endpoints, self.tls, self.timeout)


REPAIR_BACKOFF = 30.0
"""Seconds :class:`PoolStages` waits after a replacement failed to start before it tries
another."""


class WorkerPool(Protocol):
    """What :class:`PoolStages` reads of the workers a server spawned
    (``dgr_engine.tooling.loopback.LoopbackRouteProvider``)."""

    layout: tuple[tuple[int, int], ...]
    spawn_on_demand: bool
    client_tls: ClientTls | None

    def live_endpoint(self, layers: tuple[int, int]) -> str | None:
        """The endpoint of the worker a route would take for ``layers`` now (``None``:
        none is running)."""
        ...

    async def repair(self) -> None:
        """Starts a worker for each range none serves (when it spawns on demand)."""
        ...


class PoolStages:
    """The stages of a server's own workers: for each range of the layout, the worker a route
    takes now, read from its advert (``timeout`` seconds each, all at once). A range whose
    worker died shows as not serving, and a replacement is started in the background (one
    repair at a time), as a session that met the dead worker would have started one."""

    def __init__(self, pool: WorkerPool, *, timeout: float = 3.0) -> None:
        self.pool = pool
        self.timeout = timeout
        self._repairing: asyncio.Task[None] | None = None
        self._failed_at: float | None = None  # when the last repair failed (loop time)

    async def stages(self) -> list[StageStatus]:
        found = [(self.pool.live_endpoint(layers), layers) for layers in self.pool.layout]
        live = [(e, layers) for e, layers in found if e is not None]
        read = iter(await _read(live, self.pool.client_tls, self.timeout))
        out = []
        for index, (endpoint, layers) in enumerate(found):
            if endpoint is None:
                a, b = layers
                starting = self._repair()
                why = f"no worker serves layers [{a},{b})" + (
                    ": a replacement is starting" if starting else ""
                )
                out.append(StageStatus.unreachable(index, "", layers, why))
            else:
                out.append(attrs.evolve(next(read), index=index))
        return out

    def _repair(self) -> bool:
        """Starts a repair unless one runs; whether one runs now."""
        if not self.pool.spawn_on_demand:
            return False
        loop = asyncio.get_running_loop()
        if self._failed_at is not None and loop.time() - self._failed_at < REPAIR_BACKOFF:
            return False  # a probe every few seconds must not start a worker every time
        if self._repairing is None or self._repairing.done():
            self._repairing = loop.create_task(self._repaired())
        return True

    async def _repaired(self) -> None:
        try:
            await self.pool.repair()
            self._failed_at = None
        except Exception as exc:  # noqa: BLE001 - the next read shows the stage still down
            self._failed_at = asyncio.get_running_loop().time()
            logger.bind(stage="serve").warning("could not replace a worker: {}", exc)


def health(stages: Sequence[StageStatus]) -> str | None:
    """Why the route cannot serve now: the first stage that is not answering, or not
    certified (``None``: every stage answers and is certified)."""
    for stage in stages:
        where = f"stage {stage.index} ({stage.endpoint or 'none'}, layers {list(stage.layers)})"
        if not stage.serving:
            return f"{where} is not serving: {stage.detail}"
        if stage.certification != "certified":
            return f"{where} is not certified (its lane is {stage.certification or 'unknown'})"
    return None


def stage_json(stage: StageStatus) -> dict[str, Any]:
    return {
        "index": stage.index,
        "endpoint": stage.endpoint,
        "layers": list(stage.layers),
        "serving": stage.serving,
        "detail": stage.detail,
        "lane": {
            "backend": stage.backend,
            "hardware": stage.hardware,
            "certification": stage.certification,
            "evidence": stage.evidence,
            "lane_id": stage.lane_id,
        },
        "sessions": {
            "open": stage.sessions_open,
            "max": stage.sessions_max,
            "waiting": stage.sessions_waiting,
            "context": stage.context_per_session,
        },
        "load": {"in_flight": stage.in_flight, "rows_per_second": stage.rows_per_second},
    }


def route_json(
    *, model: str, context: int, live_sessions: int, stages: Sequence[StageStatus]
) -> dict[str, Any]:
    """``GET /v1/route``: the model, a session's context, the server's sessions, the stages."""
    return {
        "object": "route",
        "model": model,
        "context": context,
        "sessions": live_sessions,
        "stages": [stage_json(s) for s in stages],
    }
