"""Which route mode and data path a command takes by default (``--transport auto``,
``--data-path auto``): the fastest the route's stages offer, chosen from their adverts, and one
line that says what was chosen and why (``docs/data-paths.md``, "Choosing the path").

Every dgr worker takes chained links (the ``Chain`` service), so ``auto`` is a **ring**: the
last stage takes each token with the session's sampler and sends the next frame itself. A
route of TLS stages chains only when every stage dials its next over TLS (``--chain-tls-*``,
``Security.chain_tls``); one that cannot is a **relay**. A ring's links take the native path
when every stage offers it (sealed ones over TLS), else the frame path when every stage offers
it, else gRPC; a session that drafts on the ring, or with the MTP block, takes the frame path or
gRPC (the chained transport decides per epoch, by the same rule). A route given as a relay or
a chain keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from dgr_engine.client.route_modes import DataPath, RouteMode
from dgr_engine.wire.advert import DataPaths, Security

__all__ = ["PathChoice", "StageOffer", "choose_path"]


@attrs.frozen
class StageOffer:
    """What one stage's advert offers a route: its data paths and its security."""

    paths: DataPaths = DataPaths()
    security: Security = Security()


@attrs.frozen
class PathChoice:
    """A route's mode and the data path its links take while nothing else decides."""

    mode: RouteMode
    """Relay, chain or ring (never ``auto``)."""
    path: DataPath
    """The links' path (never ``auto``; ``grpc`` for a relay)."""
    why: str
    """What the choice came from, for the line a command prints."""

    def line(self) -> str:
        """``ring over native links (every stage offers them; ...)``: what a command says."""
        if self.mode is RouteMode.RELAY:
            return f"relay: this client sends every stage its frame ({self.why})"
        return f"{self.mode} over {_LINKS[self.path]} ({self.why})"


_LINKS = {
    DataPath.NATIVE: "native links",
    DataPath.FRAME: "frame links",
    DataPath.GRPC: "gRPC links",
}


def choose_path(
    mode: RouteMode, path: DataPath, stages: Sequence[StageOffer], *, tls: bool
) -> PathChoice:
    """The mode and path of a route whose stages offer ``stages`` (their adverts', in route
    order), given what was asked (``auto`` for either leaves it to the offers); ``tls``: the
    client dials over TLS (native links must then be sealed)."""
    offers = [s.paths for s in stages]
    if mode is RouteMode.AUTO:
        secure = any(s.security.tls for s in stages)
        if secure and not all(s.security.chain_tls for s in stages):
            why = "a stage serves TLS and not every stage dials its next over TLS (--chain-tls-*)"
            return PathChoice(RouteMode.RELAY, DataPath.GRPC, why)
    chosen = RouteMode.RING if mode is RouteMode.AUTO else mode
    why = "the fastest mode every dgr worker offers" if mode is RouteMode.AUTO else "as asked"
    if chosen is RouteMode.RELAY:
        return PathChoice(chosen, DataPath.GRPC, "--transport relay")
    if path is not DataPath.AUTO:
        return PathChoice(chosen, path, f"{why}; --data-path {path}")
    native = all(o.native_link_port and (o.native_link_sealed or not tls) for o in offers)
    if native and chosen is RouteMode.RING:
        return PathChoice(
            chosen,
            DataPath.NATIVE,
            f"{why}; every stage offers native links, a session that drafts takes frame links",
        )
    if all(o.frame_link_port for o in offers):
        return PathChoice(chosen, DataPath.FRAME, f"{why}; every stage offers frame links")
    return PathChoice(chosen, DataPath.GRPC, f"{why}; not every stage offers a faster path")
