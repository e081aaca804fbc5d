"""How every long-lived connection finds out that its peer went silent (``docs/reliability.md``,
"Between hosts").

Between hosts a peer that loses power or a link that drops everything says nothing, and TCP
by itself would wait for many minutes. So each connection dgr holds says how long it waits:

* a socket of a frame link or a native link (:func:`keep_alive`): TCP keepalive probes after
  ``IDLE_SECONDS`` of quiet, every ``PROBE_SECONDS``, ``PROBES`` unanswered ones end it; and
  data sent but not acknowledged for ``UNACKNOWLEDGED_SECONDS`` ends it (``TCP_USER_TIMEOUT``);
* a gRPC channel (:data:`GRPC_CHANNEL_OPTIONS`): an HTTP/2 ping every ``IDLE_SECONDS`` while a
  call is open, unanswered for ``PROBE_SECONDS`` ends the connection; a worker's server
  (:data:`GRPC_SERVER_OPTIONS`) takes pings that often without calling them abuse.

A connection found dead ends with a connection error, which the side that held it reads as its
peer lost (the session moves on; the worker frees what the connection held).
"""

from __future__ import annotations

import socket

__all__ = [
    "GRPC_CHANNEL_OPTIONS",
    "HELLO_SECONDS",
    "GRPC_SERVER_OPTIONS",
    "IDLE_SECONDS",
    "PROBES",
    "PROBE_SECONDS",
    "UNACKNOWLEDGED_SECONDS",
    "keep_alive",
]

HELLO_SECONDS = 3.0
"""How long a new connection to a side port may stay silent before it introduces itself (its
TLS handshake and ``OPEN``, or its ``HELLO``): an honest peer's round trips over a WAN, no
more (``WorkerConfig.frame_link_hello_seconds``, ``dgr worker --hello-seconds``)."""
IDLE_SECONDS = 10
"""Quiet seconds before a connection's peer is probed."""
PROBE_SECONDS = 5
"""Seconds between probes (TCP), or that a ping may take (gRPC)."""
PROBES = 3
"""Unanswered TCP probes that end a connection: a quiet one is found dead within
``IDLE_SECONDS + PROBES * PROBE_SECONDS`` (25 s) at most."""
UNACKNOWLEDGED_SECONDS = 20
"""Seconds data may stay unacknowledged before the connection is given up; with keepalive
on, Linux also gives up a quiet connection whose probes went unanswered this long after the
last word from its peer (so 20 s, in practice: ``tests/wire/test_keepalive.py``)."""

GRPC_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", IDLE_SECONDS * 1000),
    ("grpc.keepalive_timeout_ms", PROBE_SECONDS * 1000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
)
"""A client channel's keepalive (``ShardClient``, a stage's channel to the next)."""
GRPC_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", IDLE_SECONDS * 1000 // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_time_ms", IDLE_SECONDS * 1000),
    ("grpc.keepalive_timeout_ms", PROBE_SECONDS * 1000),
)
"""A worker's server: pings as often as its clients send them are no abuse, and it pings a
quiet client itself."""


def keep_alive(sock: socket.socket) -> None:
    """Sets a TCP socket's keepalive and user timeout (see the module's text); a socket of
    another kind is left as it is."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, IDLE_SECONDS)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, PROBE_SECONDS)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, PROBES)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, UNACKNOWLEDGED_SECONDS * 1000)
