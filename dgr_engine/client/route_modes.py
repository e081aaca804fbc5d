"""The two choices a client makes for a route, as enums: how its frames go round
(:class:`RouteMode`) and what carries them between stages (:class:`DataPath`); ``docs/chain.md``
and ``docs/data-paths.md`` say what each means."""

from __future__ import annotations

import enum

__all__ = ["DataPath", "RouteMode"]


class RouteMode(enum.StrEnum):
    """How a route's frames go round."""

    AUTO = "auto"
    """The fastest mode the route's stages offer: a ring (``client/path_choice.py``)."""
    RELAY = "relay"
    """The client sends every stage its frame and gets every stage's output back."""
    CHAIN = "chain"
    """Each stage sends its output straight to the next; the last stage's comes back."""
    RING = "ring"
    """A chain whose last stage also sends each next decode step's frame to the first."""


class DataPath(enum.StrEnum):
    """What carries a chained route's links, each stage's to the next (``docs/glossary.md``)."""

    AUTO = "auto"
    """The fastest every stage offers: native, else frame, else gRPC."""
    GRPC = "grpc"
    """gRPC: the ``Chain`` service's streaming calls over HTTP/2."""
    FRAME = "frame"
    """The frame path: the chained calls' messages, length-prefixed over TCP."""
    NATIVE = "native"
    """The native path: the engine's own messages, run on its own thread."""
