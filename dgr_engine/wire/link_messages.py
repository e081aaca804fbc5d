"""The messages of a native link (``native/include/dgr_shard.h``, "Native frame links";
``docs/native-path.md``): what a client writes to a route's first stage and reads from its
last, and what the stages' native threads pass between them.

Every message is a 56-byte little-endian header and a payload. ``ROWS``: the ring's stop
tokens, the rows' token ids, and (past the first stage) the boundary rows as ``float32``.
``TOKEN``: the last stage's token for a frame, its sampler's (``value``), and the pass's trace
(each stage's engine microseconds, ``trace_of``). ``FAILED``: the
status (``value``) and the stage (``hop``) of a failure, its message as the payload.
"""

from __future__ import annotations

import asyncio
import enum
import socket
import struct
import time
from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np
import numpy.typing as npt

from dgr_engine._binding import lib, status_name

__all__ = [
    "HEADER",
    "HELLO_MAX_BYTES",
    "Opener",
    "SEALED_FLAG",
    "Hello",
    "Role",
    "decode_hello",
    "encode_accept",
    "encode_end",
    "encode_failed",
    "encode_hello",
    "parse_header",
    "read_socket_message",
    "read_stream_message",
    "trace_of",
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
payload_bytes, engine_us (the pass's engine time so far, summed over its stages)."""
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
    END = int(lib.DGR_LINK_END)
    """The sender ends cleanly: each stage passes it on and ends (a link whose input ends
    without it reports the stage before it lost: ``DGR_E_LINK_LOST``)."""
    HELLO = int(lib.DGR_LINK_HELLO)
    """A connection's introduction, and the stage's answer (``encode_accept``): read and
    answered by the worker's control shell before the link owns the socket."""


class LinkMessageError(ValueError):
    """Bytes that are not a link message the reader can take (a wrong magic or version, an
    unknown kind, a payload over the reader's bound)."""


class LinkClosed(ConnectionError):
    """The link's socket ended before a whole message, or none came in time."""


class Opener(Protocol):
    """A sealed connection's reading direction (``wire/link_seal.py``): each message's payload
    comes with a tag of ``tag_bytes`` that ``open`` verifies (and decrypts) against its
    header; an opener that does not verify raises ``GrantUnauthenticated``."""

    tag_bytes: int

    def open(self, head: bytes, body: bytes) -> bytes: ...


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
    engine_us: int = 0
    """The engine time of the frame's pass so far, summed over the stages it went through
    (a ``TOKEN``: the whole pass's)."""

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
    trace: Sequence[int] = (),
    kind: int = 0,
) -> bytes:
    """A ``ROWS`` message: ``tokens`` at positions ``pos``, ``pos + 1``, ...; ``rows`` (one per
    token, ``float32``) past the first stage; a ring goes on to ``until_step`` unless it makes
    a token of ``stop``; ``trace``: the engine microseconds of each stage the frame went
    through (one per stage before the one it goes to); ``kind``: the rows' kind
    (``ForwardRequest.kind``: 1 prefill, 2 decode, 3 replay), which usage records count."""
    n = len(tokens)
    width = 0 if rows is None else int(rows.shape[1])
    body = np.asarray(list(stop), dtype="<i4").tobytes() + np.asarray(tokens, dtype="<i4").tobytes()
    if rows is not None:
        if rows.shape[0] != n:
            raise ValueError(f"{rows.shape[0]} rows for {n} tokens")
        body += np.ascontiguousarray(rows, dtype="<f4").tobytes()
    body += np.asarray(list(trace), dtype="<u4").tobytes()
    head = HEADER.pack(
        MAGIC, VERSION, Kind.ROWS, epoch, step, pos, n, width, until_step, len(stop), hop, kind,
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
    sock: socket.socket,
    timeout: float,
    *,
    max_payload: int = 1 << 26,
    opener: Opener | None = None,
) -> tuple[Header, bytes]:
    """The next message on ``sock`` within ``timeout`` seconds: ``LinkClosed`` when it ends or
    none comes whole in time, ``LinkMessageError`` for bytes that are not one; on a sealed
    connection (``opener``) its payload opened."""
    deadline = time.monotonic() + timeout
    head = _read_exactly(sock, HEADER.size, deadline)
    header = parse_header(head, max_payload)
    if opener is not None:
        body = _read_exactly(sock, header.payload_bytes + opener.tag_bytes, deadline)
        return header, opener.open(head, body)
    payload = _read_exactly(sock, header.payload_bytes, deadline) if header.payload_bytes else b""
    return header, payload


# -- the introduction of a connection (answered by the worker's control shell) ----------------

HELLO_PAYLOAD = struct.Struct("<BBHH")
"""A ``HELLO``'s payload head: role, flags, session id bytes, secret bytes (then those)."""
HELLO_MAX_BYTES = 4096
"""Largest ``HELLO`` or ``FAILED`` payload a reader takes."""
RING_FLAG = 1
"""``HELLO`` flag of an output connection (``Role.OUTPUT``): the route is a ring, so the last
stage's link also waits for its link back to the first stage."""
SEALED_FLAG = 2
"""``HELLO`` flag of a sealed connection (``wire/link_seal.py``): its secret field carries the
dialer's nonce and proof, never the session secret, and every message after the answer is
sealed."""


class Role(enum.Enum):
    """What a connection is to the stage it introduces itself to."""

    INPUT = b"i"
    """The frames of the stage before (the client's, on the first stage)."""
    RING = b"r"
    """A ring's frames from its last stage (the first stage only)."""
    OUTPUT = b"o"
    """The client's token stream (the last stage only)."""


@attrs.frozen
class Hello:
    """A connection's introduction: who it is for and what it carries."""

    role: Role
    session_id: str
    epoch: int
    secret: bytes
    hop: int
    """The index in the route of the stage it introduces itself to; a ring's link back to the
    first stage (``RING``) names its sender instead, the ring's last stage."""
    ring: bool = False
    sealed: bool = False
    """A sealed connection: ``secret`` is the dialer's nonce and proof (``wire/link_seal.py``)."""


def encode_hello(hello: Hello) -> bytes:
    sid = hello.session_id.encode()
    flags = (RING_FLAG if hello.ring else 0) | (SEALED_FLAG if hello.sealed else 0)
    body = (
        HELLO_PAYLOAD.pack(hello.role.value[0], flags, len(sid), len(hello.secret))
        + sid
        + hello.secret
    )
    head = HEADER.pack(
        MAGIC, VERSION, Kind.HELLO, hello.epoch, 0, 0, 0, 0, 0, 0, hello.hop, 0, len(body), 0
    )
    return head + body


def decode_hello(header: Header, payload: bytes) -> Hello:
    """The introduction a ``HELLO`` carries; ``LinkMessageError`` unless well-formed."""
    if header.kind is not Kind.HELLO or len(payload) < HELLO_PAYLOAD.size:
        raise LinkMessageError(f"a {header.kind.name} where a HELLO was expected")
    role_byte, flags, n_sid, n_secret = HELLO_PAYLOAD.unpack_from(payload)
    if len(payload) != HELLO_PAYLOAD.size + n_sid + n_secret:
        raise LinkMessageError("a HELLO whose lengths do not add up")
    try:
        role = Role(bytes([role_byte]))
        sid = payload[HELLO_PAYLOAD.size : HELLO_PAYLOAD.size + n_sid].decode()
    except (ValueError, UnicodeDecodeError):
        raise LinkMessageError("a HELLO with an unknown role or a session id not UTF-8") from None
    secret = payload[HELLO_PAYLOAD.size + n_sid :]
    ring, sealed = bool(flags & RING_FLAG), bool(flags & SEALED_FLAG)
    return Hello(role, sid, header.epoch, secret, header.hop, ring, sealed)


def encode_accept(epoch: int, hop: int, payload: bytes = b"") -> bytes:
    """The answer to a ``HELLO`` the stage took: a ``HELLO`` with no payload (a sealed
    connection's: the answerer's nonce and proof)."""
    head = HEADER.pack(MAGIC, VERSION, Kind.HELLO, epoch, 0, 0, 0, 0, 0, 0, hop, 0, len(payload), 0)
    return head + payload


def trace_of(payload: bytes) -> tuple[int, ...]:
    """A ``TOKEN``'s trace: each stage's engine microseconds for the pass, in route order."""
    return tuple(int(v) for v in np.frombuffer(payload[: len(payload) // 4 * 4], dtype="<u4"))


def encode_end(epoch: int) -> bytes:
    """An ``END``: the route's links end cleanly, each passing it on."""
    return HEADER.pack(MAGIC, VERSION, Kind.END, epoch, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


def encode_failed(status: int, hop: int, message: str, *, epoch: int = 0, step: int = 0) -> bytes:
    """A ``FAILED``: the status (its number), the failing stage and its message (cut to the
    protocol's limit)."""
    body = message.encode()[: MAX_MESSAGE_BYTES - 1]
    head = HEADER.pack(
        MAGIC, VERSION, Kind.FAILED, epoch, step, 0, 0, 0, 0, 0, hop, status, len(body), 0
    )
    return head + body


def parse_header(data: bytes, max_payload: int) -> Header:
    """A header's fields; ``LinkMessageError`` unless it is one."""
    magic, version, kind, *rest = HEADER.unpack(data)
    if magic != MAGIC or version != VERSION:
        raise LinkMessageError(f"not a link message (magic {magic:#x}, version {version})")
    try:
        what = Kind(kind)
    except ValueError:
        raise LinkMessageError(f"unknown link message kind {kind}") from None
    epoch, step, pos, n_rows, width, until, n_stop, hop, value, payload_bytes, engine_us = rest
    if payload_bytes > max_payload:
        raise LinkMessageError(f"a payload of {payload_bytes} bytes, over {max_payload}")
    return Header(
        what, epoch, step, pos, n_rows, width, until, n_stop, hop, value, payload_bytes, engine_us
    )


async def read_stream_message(
    reader: asyncio.StreamReader, max_payload: int, opener: Opener | None = None
) -> tuple[Header, bytes]:
    """The next message on an asyncio stream: ``LinkMessageError`` for bytes that are not
    one, ``asyncio.IncompleteReadError`` when the stream ends first; on a sealed connection
    (``opener``) the payload opened, ``GrantUnauthenticated`` when its seal does not verify."""
    head = await reader.readexactly(HEADER.size)
    header = parse_header(head, max_payload)
    if opener is not None:
        body = await reader.readexactly(header.payload_bytes + opener.tag_bytes)
        return header, opener.open(head, body)
    payload = await reader.readexactly(header.payload_bytes) if header.payload_bytes else b""
    return header, payload


async def read_socket_message(sock: socket.socket, max_payload: int) -> tuple[Header, bytes]:
    """The next message on a non-blocking socket, read on the running loop: as
    :func:`read_stream_message` (``LinkClosed`` when the socket ends first)."""
    loop = asyncio.get_running_loop()

    async def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = await loop.sock_recv(sock, n - len(data))
            if not chunk:
                raise LinkClosed(f"the connection ended after {len(data)} of {n} bytes")
            data += chunk
        return data

    header = parse_header(await exactly(HEADER.size), max_payload)
    return header, (await exactly(header.payload_bytes) if header.payload_bytes else b"")
