"""Routes over fixed endpoints: the client's own route provider (``dgr generate --endpoints``).

* :func:`describe` reads one worker's advert;
* :class:`EndpointRouteProvider` routes over fixed endpoints given in order: the route of their
  adverts while every one of them is serving, else it raises
  :class:`~dgr_session.errors.StageUnreachable` naming the first stage it could not reach and
  why (which the session's failure keeps as its cause).

It checks every worker's certification against the client's own lock, not the worker's word:
its ``certification_verifier`` (default :class:`~dgr_engine.certification.verify.LockVerifier`
of the default lock) is what a ``SessionManager`` over it validates routes with. The loopback
provider that spawns its own workers is single-machine tooling
(:mod:`dgr_engine.tooling.loopback`). Every wait is bounded (``Describe``, health checks).
"""

from __future__ import annotations

from collections.abc import Sequence

from dgr_engine.certification.verify import LockVerifier
from dgr_engine.client.shard_client import ShardClient
from dgr_engine.errors import ShardTransportError
from dgr_engine.security.tls import ClientTls
from dgr_engine.wire.advert import Advert
from dgr_session.errors import StageUnreachable
from dgr_session.faults import FailureReport
from dgr_session.route import CertificationVerifier, Route

__all__ = ["EndpointRouteProvider", "describe"]


async def describe(endpoint: str, *, timeout: float = 10.0, tls: ClientTls | None = None) -> Advert:
    """The advert of the worker at ``endpoint`` (one short-lived channel; TLS with ``tls``)."""
    async with ShardClient(endpoint, timeout=timeout, tls=tls) as client:
        return await client.describe()


class EndpointRouteProvider:
    """Routes over fixed endpoints, in the order given (each serving the next range).

    Every request checks that all endpoints are serving (health, ``probe_timeout``) and
    re-reads their adverts; if one is not, there is no route (no alternative exists):
    :class:`~dgr_session.errors.StageUnreachable` names the stage, its endpoint and why.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        probe_timeout: float = 5.0,
        tls: ClientTls | None = None,
        certification_verifier: CertificationVerifier | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one endpoint is needed")
        self.certification_verifier = (
            certification_verifier if certification_verifier is not None else LockVerifier()
        )
        """Checks the workers' certifications against the client's lock."""
        self.endpoints = tuple(endpoints)
        self.probe_timeout = probe_timeout
        self.tls = tls
        #: Every report received, in order.
        self.reports: list[FailureReport] = []
        self.adverts: dict[str, Advert] = {}

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        if report is not None:
            self.reports.append(report)
        stages = []
        for index, endpoint in enumerate(self.endpoints):
            try:
                async with ShardClient(
                    endpoint, timeout=self.probe_timeout, tls=self.tls
                ) as client:
                    await client.require_serving()
                    advert = await client.describe()
            except ShardTransportError as exc:
                raise StageUnreachable(
                    f"stage {index} ({endpoint}) is unreachable: {_why(exc)}",
                    stage_index=index,
                    endpoint=endpoint,
                ) from exc
            self.adverts[endpoint] = advert
            stages.append(advert.stage_spec(endpoint))
        return Route(stages)


def _why(error: ShardTransportError) -> str:
    """Why a worker could not be reached, in short: gRPC's "failed to connect to all
    addresses; last error: ...: Connection refused" becomes its last clause."""
    text = str(error)
    if text.startswith("failed to connect to all addresses"):
        return text.rsplit(": ", 1)[-1]
    return text
