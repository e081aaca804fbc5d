"""Per-client limits: sessions one client identity may hold, frames per second one session may
send, so that one client cannot take every slot or all the engine time of a worker.

A client's identity is the common name of its TLS client certificate when the worker asks for
one (mutual TLS), else the host it connects from. Refusals are ``DGR_E_CAPACITY``
(``RESOURCE_EXHAUSTED``): a session refused for its client's limit is load, like a busy worker,
and a frame over its session's rate carries the seconds until it would be taken. Without grant
keys the identity also guards a held session: another identity's open of it is refused
(``DGR_E_PERMISSION``). A session's owner and frame budget are forgotten when the session table
says it closed the session (for any cause but a newer epoch's open: ``worker/lifecycle/closes.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from dgr_engine.errors import CapacityExceeded, GrantDenied
from dgr_engine.worker.lifecycle.closes import SessionClosed


def client_identity(peer: str, auth: Mapping[str, Any]) -> str:
    """``cert:<CN>`` for a client that showed a certificate, else ``addr:<host>`` of
    ``peer`` (gRPC's ``ipv4:1.2.3.4:5678`` / ``ipv6:[::1]:5678``)."""
    names = auth.get("x509_common_name") or []
    if names:
        first = names[0]
        return "cert:" + (first.decode(errors="replace") if isinstance(first, bytes) else first)
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = rest.rsplit(":", 1)[0]
        return "addr:" + host.strip("[]")
    return "addr:" + peer


@attrs.frozen
class PeerLimitConfig:
    """``None`` turns a limit off."""

    sessions_per_client: int | None = attrs.field(default=None)
    """Sessions one client identity may hold at once."""
    frames_per_second: float | None = attrs.field(default=None)
    """Forward frames one session may send per second (a bucket of ``burst`` frames)."""
    burst: int = 8

    def __attrs_post_init__(self) -> None:
        if self.sessions_per_client is not None and self.sessions_per_client < 1:
            raise ValueError(f"sessions_per_client must be >= 1, got {self.sessions_per_client}")
        rate = self.frames_per_second
        if rate is not None and not (rate > 0 and rate != float("inf")):
            raise ValueError(f"frames_per_second must be finite and > 0, got {rate}")
        if self.burst < 1:
            raise ValueError(f"burst must be >= 1, got {self.burst}")


@attrs.define
class _Bucket:
    tokens: float
    at: float


class PeerLimits:
    """Who holds which session, and each session's frame budget; a close listener of the
    session table (a session closed, by anyone, is forgotten)."""

    def __init__(
        self,
        config: PeerLimitConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._now = clock
        self._owner: dict[str, str] = {}
        # invariant: the sessions held here, each with the client identity that opened it
        self._buckets: dict[str, _Bucket] = {}

    def session_closed(self, closed: SessionClosed) -> None:
        """The session table closed an epoch: unless a newer epoch of it lives on, the session
        has no owner and no frame budget any more."""
        if not closed.still_held:
            self._owner.pop(closed.session_id, None)
            self._buckets.pop(closed.session_id, None)

    def check_open(self, client: str, session_id: str) -> None:
        """Before an open: ``CapacityExceeded`` when ``client`` already holds its limit of
        other sessions."""
        limit = self.config.sessions_per_client
        if limit is None or self._owner.get(session_id) == client:
            return
        held = sum(1 for owner in self._owner.values() if owner == client)
        if held >= limit:
            raise CapacityExceeded(
                f"DGR_E_CAPACITY: open of session {session_id!r}: client {client} holds "
                f"{held} sessions, its limit on this worker"
            )

    def opened(self, client: str, session_id: str) -> None:
        self._owner[session_id] = client

    def check_owner(self, client: str, session_id: str, action: str = "open") -> None:
        """Before an open (or a close of a newer epoch, ``action="close"``) on a worker without
        grant keys: ``GrantDenied`` when another client identity holds ``session_id`` here
        (either would discard its state; with grant keys the tracker's grant decides who may
        open it)."""
        owner = self._owner.get(session_id)
        if owner is not None and owner != client:
            raise GrantDenied(
                f"DGR_E_PERMISSION: {action} of session {session_id!r}: another client holds "
                "it on this worker"
            )

    def check_frame(self, session_id: str) -> None:
        """Before a forward: ``CapacityExceeded`` (with ``retry_after``) when the session has
        spent its frames for now."""
        rate = self.config.frames_per_second
        if rate is None:
            return
        now = self._now()
        bucket = self._buckets.get(session_id)
        if bucket is None:
            bucket = self._buckets[session_id] = _Bucket(float(self.config.burst), now)
        bucket.tokens = min(float(self.config.burst), bucket.tokens + (now - bucket.at) * rate)
        bucket.at = now
        if bucket.tokens < 1.0:
            error = CapacityExceeded(
                f"DGR_E_CAPACITY: session {session_id!r}: more than {rate:g} frames per second"
            )
            error.retry_after = (1.0 - bucket.tokens) / rate
            raise error
        bucket.tokens -= 1.0
        if len(self._buckets) > 4 * max(len(self._owner), 64):
            # frames that named sessions nobody holds (the table refused them): bounded
            for stale in [s for s in self._buckets if s not in self._owner]:
                del self._buckets[stale]
