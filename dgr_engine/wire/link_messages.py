"""The messages of a native link (``native/include/dgr_shard.h``, "Native frame links";
``docs/native-link.md``): what a client writes to a route's first stage and reads from its
last, and what the stages' native threads pass between them.

Every message is a 56-byte little-endian header and a payload. ``ROWS``: the ring's stop
tokens, the rows' token ids, and (past the first stage) the boundary rows as ``float32``.
``TOKEN``: the last stage's greedy token for a frame (``value``), no payload. ``FAILED``: the
status (``value``) and the stage (``hop``) of a failure, its message as the payload.
"""

from __future__ import annotations

import enum
import socket
import struct
import time
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from dgr_engine._binding import lib, status_name

__all__ = [
    "HEADER",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "MAX_STOP",
    "VERSION",
    "Header",
    "Kind",
    "LinkClosed",
    "LinkMessageError",
    "encode_rows",
    "read_message",
]

HEADER = struct.Struct("<IHHQIiIIIIIiII")
"""magic, version, kind, epoch, step, pos, n_rows, width, until_step, n_stop, hop, value,
payload_bytes, reserved."""
MAGIC = int(lib.DGR_LINK_MAGIC)
VERSION = int(lib.DGR_LINK_VERSION)
MAX_STOP = int(lib.DGR_LINK_MAX_STOP)
MAX_MESSAGE_BYTES = int(lib.DGR_LINK_MESSAGE_BYTES)
assert HEADER.size == int(lib.DGR_LINK_HEADER_BYTES)


class Kind(enum.IntEnum):
    """What a link message is."""

    ROWS = int(lib.DGR_LINK_ROWS)
    TOKEN = int(lib.DGR_LINK_TOKEN)
    FAILED = int(lib.DGR_LINK_FAILED)


class LinkMessageError(ValueError):
    """Bytes that are not a link message the reader can take (a wrong magic or version, an
    unknown kind, a payload over the reader's bound)."""


class LinkClosed(ConnectionError):
    """The link's socket ended before a whole message, or none came in time."""


@attrs.frozen
class Header:
    """A link message's header."""

    kind: Kind
    epoch: int
    step: int
    pos: int
    n_rows: int
    width: int
    until_step: int
    n_stop: int
    hop: int
    value: int
    payload_bytes: int

    @property
    def status(self) -> str:
        """A ``FAILED`` message's status name (``DGR_E_...``)."""
        return status_name(self.value)


def encode_rows(
    epoch: int,
    step: int,
    pos: int,
    tokens: Sequence[int],
    *,
    rows: npt.NDArray[np.float32] | None = None,
    until_step: int = 0,
    stop: Sequence[int] = (),
    hop: int = 0,
) -> bytes:
    """A ``ROWS`` message: ``tokens`` at positions ``pos``, ``pos + 1``, ...; ``rows`` (one per
    token, ``float32``) past the first stage; a ring goes on to ``until_step`` unless it makes
    a token of ``stop``."""
    n = len(tokens)
    width = 0 if rows is None else int(rows.shape[1])
    body = np.asarray(list(stop), dtype="<i4").tobytes() + np.asarray(tokens, dtype="<i4").tobytes()
    if rows is not None:
        if rows.shape[0] != n:
            raise ValueError(f"{rows.shape[0]} rows for {n} tokens")
        body += np.ascontiguousarray(rows, dtype="<f4").tobytes()
    head = HEADER.pack(
        MAGIC, VERSION, Kind.ROWS, epoch, step, pos, n, width, until_step, len(stop), hop, 0,
        len(body), 0,
    )  # fmt: skip
    return head + body


def _read_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    parts, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LinkClosed(f"no whole message within the deadline ({got} of {n} bytes)")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - got)
        except TimeoutError:
            raise LinkClosed(f"no whole message within the deadline ({got} of {n} bytes)") from None
        if not chunk:
            raise LinkClosed(f"the link closed after {got} of {n} bytes")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_message(
    sock: socket.socket, timeout: float, *, max_payload: int = 1 << 26
) -> tuple[Header, bytes]:
    """The next message on ``sock`` within ``timeout`` seconds: ``LinkClosed`` when it ends or
    none comes whole in time, ``LinkMessageError`` for bytes that are not one."""
    deadline = time.monotonic() + timeout
    fields = HEADER.unpack(_read_exactly(sock, HEADER.size, deadline))
    magic, version, kind, *rest = fields
    if magic != MAGIC or version != VERSION:
        raise LinkMessageError(f"not a link message (magic {magic:#x}, version {version})")
    try:
        what = Kind(kind)
    except ValueError:
        raise LinkMessageError(f"unknown link message kind {kind}") from None
    epoch, step, pos, n_rows, width, until, n_stop, hop, value, payload_bytes, _ = rest
    if payload_bytes > max_payload:
        raise LinkMessageError(f"a payload of {payload_bytes} bytes, over {max_payload}")
    header = Header(what, epoch, step, pos, n_rows, width, until, n_stop, hop, value, payload_bytes)
    payload = _read_exactly(sock, payload_bytes, deadline) if payload_bytes else b""
    return header, payload
