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
        adverts = await asyncio.gather(
            *(describe(e, timeout=self.timeout, tls=self.tls) for e, _ in self.endpoints),
            return_exceptions=True,
        )
        out = []
        for index, ((endpoint, layers), advert) in enumerate(
            zip(self.endpoints, adverts, strict=True)
        ):
            if isinstance(advert, Advert):
                out.append(StageStatus.from_advert(index, endpoint, advert))
            elif isinstance(advert, Exception):
                why = str(advert).splitlines()[0] if str(advert) else type(advert).__name__
                out.append(StageStatus.unreachable(index, endpoint, layers, why))
            else:  # a BaseException (cancellation) is not the stage's state
                raise advert
        return out


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
