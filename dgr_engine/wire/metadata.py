"""What a call carries besides its payload, on both ends: the session's gRPC metadata and the
largest message either side accepts by default."""

from __future__ import annotations

from typing import Any

from dgr_session.identifiers import check_session_id

__all__ = ["CHAIN_SENDER_KEY", "DEFAULT_MAX_MESSAGE_BYTES", "chain_sender", "session_metadata"]

CHAIN_SENDER_KEY = "dgr-chain-sender"
"""Metadata key of a stream one stage of a chained route opens on the next: the sender's own
index (decimal), so that a malformed frame on it is filed against its sender (on a ring's
first stage, the ring's last stage; ``docs/chain.md``)."""
_MAX_SENDER = 1 << 16

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Largest reply the client accepts by default (a 512-row prefill of full V4 logits is ~260 MB)."""


def session_metadata(request: Any) -> tuple[tuple[str, str], ...]:
    """The session, epoch and step of a request as gRPC metadata (``dgr-session``,
    ``dgr-epoch``, ``dgr-step``), for proxies, interceptors and logs that see no payload; a
    stream carries those of its first frame. A session id that cannot be metadata (it breaks
    ``dgr_session.identifiers``' rule) raises ``InvalidIdentifier``: gRPC would fail the call
    in this process, and a stream's failure would read like a lost connection."""
    out: tuple[tuple[str, str], ...] = ()
    for key, field in (("dgr-session", "session_id"), ("dgr-epoch", "epoch"), ("dgr-step", "step")):
        value = getattr(request, field, None)
        if value is not None and value != "":
            if key == "dgr-session":
                check_session_id(value)
            out += ((key, str(value)),)
    return out


def chain_sender(metadata: Any) -> int | None:
    """The sender's index a chained stream's metadata names (``CHAIN_SENDER_KEY``); ``None``
    when it names none (the client's stream) or not a stage index."""
    for key, value in metadata or ():
        if key == CHAIN_SENDER_KEY:
            text = value.decode() if isinstance(value, bytes) else str(value)
            if text.isdigit() and int(text) < _MAX_SENDER:
                return int(text)
            return None
    return None
