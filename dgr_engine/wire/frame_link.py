"""The frame path: a data path for chained frames beside gRPC (``docs/data-paths.md``); a link
it carries is a frame link (``docs/glossary.md``).

A frame link call is one TCP connection (TLS exactly when the worker's gRPC port serves TLS,
with the same certificate and client CA) carrying one of the ``Chain`` service's two streaming
calls, ``ChainStream`` or ``ChainOutput``, as length-prefixed messages: a 5-byte header
(payload length, big-endian ``uint32``; kind, one byte) and the payload.

====================  =========  =========================================================
kind                  who sends  payload
====================  =========  =========================================================
``OPEN``              caller     first, once: the method and the call's metadata (JSON)
``MESSAGE``           both       one protobuf message (the method's request or reply type)
``HALF_CLOSE``        caller     the caller sends no more messages (empty)
``STATUS``            worker     last, once: the call's gRPC code, details and trailers (JSON)
====================  =========  =========================================================

The messages, codes and trailers are the gRPC calls' (``proto/dgr/shard/v1``; a ``STATUS``
carries the number gRPC gives its code), so the worker runs the same ``ChainServicer`` methods
behind both paths and the callers read the same typed refusals: only the framing differs, and
with it the cost of a hop (no HTTP/2, no gRPC core, one message per write). No gRPC runs here:
a :class:`FrameLinkCall` answers its messages, ``None`` at an OK end, and
:class:`LinkCallFailed` for any other; the client reads it through its frame link channel
(``client/frame_link_channel.py``), a worker's downstream stream through
``worker/route/chain_downstream.py``, each turning the status into the typed error of the stage
it names (``wire/status.py``).
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import ssl
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from dgr_engine.security.tls import ClientTls, ServerTls
from dgr_engine.wire.keepalive import keep_alive
from dgr_engine.wire.proto import shard_pb2 as pb

__all__ = [
    "CANCELLED",
    "CONTROL_MAX_BYTES",
    "INTERNAL",
    "OK",
    "UNAVAILABLE",
    "CallStatus",
    "HEADER",
    "METHODS",
    "FrameLinkCall",
    "FrameLinkTarget",
    "Kind",
    "LinkCallFailed",
    "LinkProtocolError",
    "Metadata",
    "client_ssl_context",
    "decode_open",
    "decode_status",
    "encode_open",
    "encode_status",
    "pack",
    "read_message",
    "server_ssl_context",
    "split_endpoint",
]

HEADER = struct.Struct("!IB")
"""A message's header: payload length, kind."""

CONTROL_MAX_BYTES = 64 * 1024
"""Largest ``OPEN`` or ``STATUS`` payload."""

METHODS = ("ChainStream", "ChainOutput")
"""The calls a frame link carries."""

_CONNECT_SECONDS = 10.0
"""How long a caller waits for the connection and its TLS handshake."""

Metadata = tuple[tuple[str, str], ...]
M = TypeVar("M")

OK, CANCELLED, INTERNAL, UNAVAILABLE = 0, 1, 13, 14
"""The status codes a frame link call ends with by itself (gRPC's numbers for them, as every
``STATUS`` carries: a worker's refusals carry theirs, and their ``dgr-status``)."""


class LinkCallFailed(Exception):
    """A frame link call ended with a status other than OK: its code (gRPC's number), details
    and trailers (``dgr-status``, ``dgr-chain-hop``, ...)."""

    def __init__(self, code: int, details: str, trailers: Metadata) -> None:
        super().__init__(code, details, trailers)
        self.code, self.details, self.trailers = code, details, trailers


class Kind(enum.IntEnum):
    """What a frame link message is."""

    OPEN = 1
    MESSAGE = 2
    HALF_CLOSE = 3
    STATUS = 4


class LinkProtocolError(ValueError):
    """Bytes that are not a frame link message (a length over the limit, an unknown kind, an
    ``OPEN`` or ``STATUS`` that does not parse)."""


def pack(kind: Kind, payload: bytes = b"") -> bytes:
    """One message's bytes."""
    return HEADER.pack(len(payload), kind) + payload


async def read_message(
    reader: asyncio.StreamReader, max_bytes: int, *, header_seconds: float | None = None
) -> tuple[Kind, bytes]:
    """The next message; ``LinkProtocolError`` for a header that is not one (its length over
    ``max_bytes``, or over ``CONTROL_MAX_BYTES`` for a control message),
    ``asyncio.IncompleteReadError`` when the connection ends before a whole message, and
    ``TimeoutError`` when its header takes over ``header_seconds`` to come (``None``: no
    bound; a payload, once announced, may take as long as the connection carries it)."""
    async with asyncio.timeout(header_seconds):
        header = await reader.readexactly(HEADER.size)
    length, kind = HEADER.unpack(header)
    try:
        what = Kind(kind)
    except ValueError:
        raise LinkProtocolError(f"unknown message kind {kind}") from None
    cap = max_bytes if what is Kind.MESSAGE else CONTROL_MAX_BYTES
    if length > cap:
        raise LinkProtocolError(f"a {what.name} message of {length} bytes, over {cap}")
    return what, await reader.readexactly(length) if length else b""


def _pairs(value: Any) -> Metadata:
    if not isinstance(value, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in value
    ):
        raise LinkProtocolError("metadata is not a list of [key, value] strings")
    return tuple((k, v) for k, v in value)


def _json(payload: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(payload)
    except ValueError:
        raise LinkProtocolError(f"{what} is not JSON") from None
    if not isinstance(value, dict):
        raise LinkProtocolError(f"{what} is not a JSON object")
    return value


def encode_open(method: str, metadata: Sequence[tuple[str, str]]) -> bytes:
    return json.dumps({"method": method, "metadata": [list(p) for p in metadata]}).encode()


def decode_open(payload: bytes) -> tuple[str, Metadata]:
    """``(method, metadata)`` of an ``OPEN``; ``LinkProtocolError`` unless well-formed."""
    value = _json(payload, "OPEN")
    method = value.get("method")
    if method not in METHODS:
        raise LinkProtocolError(f"unknown method {str(method)[:64]!r}")
    return method, _pairs(value.get("metadata", []))


def encode_status(code: int, details: str, trailers: Sequence[tuple[str, str]]) -> bytes:
    """A ``STATUS`` payload: always one JSON object within ``CONTROL_MAX_BYTES`` (over it, the
    details are cut, then the trailers dropped: a refusal's reason is bounded, but never trust
    it; JSON escapes can make a character six bytes)."""
    body = {"code": int(code), "details": details, "trailers": [list(p) for p in trailers]}
    payload = json.dumps(body).encode()
    keep = len(details)
    while len(payload) > CONTROL_MAX_BYTES and keep > 0:
        keep //= 2
        body["details"] = details[:keep]
        payload = json.dumps(body).encode()
    if len(payload) > CONTROL_MAX_BYTES:
        body["trailers"] = []
        payload = json.dumps(body).encode()
    return payload


_MAX_CODE = 16
"""The largest status code there is (gRPC's ``UNAUTHENTICATED``)."""


def decode_status(payload: bytes) -> tuple[int, str, Metadata]:
    """``(code, details, trailers)`` of a ``STATUS``; ``LinkProtocolError`` unless it holds a
    code there is and its details."""
    value = _json(payload, "STATUS")
    code, details = value.get("code", -1), value.get("details", "")
    valid = isinstance(code, int) and not isinstance(code, bool) and 0 <= code <= _MAX_CODE
    if not valid or not isinstance(details, str):
        raise LinkProtocolError("STATUS has no valid code and details")
    return code, details, _pairs(value.get("trailers", []))


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host, port`` of ``host:port`` (``[v6]:port`` too)."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _load_cert_chain(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """Python's ``ssl`` loads a certificate and key from files only: written into a private
    temporary folder (mode 0700) for the load and deleted at once."""
    with tempfile.TemporaryDirectory(prefix="dgr-link-tls-") as folder:
        paths = Path(folder, "cert.pem"), Path(folder, "key.pem")
        for path, data in zip(paths, (cert, key), strict=True):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
        context.load_cert_chain(certfile=paths[0], keyfile=paths[1])


def server_ssl_context(tls: ServerTls) -> ssl.SSLContext:
    """The worker's side: its certificate, and its client CA's certificates required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_cert_chain(context, tls.cert_chain, tls.private_key)
    if tls.client_ca is not None:
        context.load_verify_locations(cadata=tls.client_ca.decode("ascii"))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(tls: ClientTls) -> ssl.SSLContext:
    """The caller's side: the CA it trusts and its own certificate, if it has one."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cadata=tls.ca.decode("ascii"))
    if tls.cert_chain is not None and tls.private_key is not None:
        _load_cert_chain(context, tls.cert_chain, tls.private_key)
    return context


class FrameLinkTarget:
    """Where calls go: a worker's frame link (its host, the advert's port) and how to dial it."""

    def __init__(self, host: str, port: int, tls: ClientTls | None = None) -> None:
        self.host, self.port, self.tls = host, port, tls
        self._context = client_ssl_context(tls) if tls is not None else None

    @property
    def endpoint(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._context is None:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        else:
            tls = self.tls
            name = tls.server_name if tls is not None and tls.server_name else self.host
            reader, writer = await asyncio.open_connection(
                self.host, self.port, ssl=self._context, server_hostname=name
            )
        keep_alive(writer.get_extra_info("socket"))  # a silent worker is found out
        return reader, writer

    def ChainStream(self, *, metadata: Metadata = ()) -> FrameLinkCall[Any]:  # noqa: N802
        """A ``ChainStream`` call (named as the gRPC stub's)."""
        return FrameLinkCall(self, "ChainStream", metadata, pb.ChainAck)

    def ChainOutput(self, request: Any, *, metadata: Metadata = ()) -> FrameLinkCall[Any]:  # noqa: N802
        """A ``ChainOutput`` call: ``request`` first, then the replies."""
        return FrameLinkCall(self, "ChainOutput", metadata, pb.ChainOutputReply, request)


class CallStatus:
    """How a call over a connection of its own ends (``done``, ``cancel``, and its status once
    it is over: :meth:`ending`)."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self._status: asyncio.Future[tuple[int, str, Metadata]] = loop.create_future()
        self._writer: asyncio.StreamWriter | None = None

    def _end(self, code: int, details: str, trailers: Sequence[Any] = ()) -> None:
        if not self._status.done():
            self._status.set_result((code, details, tuple(trailers)))
        if self._writer is not None:
            self._writer.close()

    def _over(self) -> None:
        """Returns at an OK end; raises :class:`LinkCallFailed` for any other."""
        code, details, trailers = self._status.result()
        if code != OK:
            raise LinkCallFailed(code, details, trailers)

    async def ending(self) -> tuple[int, str, Metadata]:
        """``(code, details, trailers)`` of the call's end, once it ended."""
        return await asyncio.shield(self._status)

    def cancel(self) -> bool:
        done = self._status.done()
        self._end(CANCELLED, "cancelled by the caller")
        return not done

    def done(self) -> bool:
        return self._status.done()


class FrameLinkCall(CallStatus, Generic[M]):
    """One call on its own connection: ``write`` and ``done_writing`` its messages, ``read``
    its replies. Its status is read from the connection by :meth:`read`, so :meth:`ending`
    resolves once a caller has read to the end (every caller in dgr does), or once the call is
    cancelled or its connection lost."""

    def __init__(
        self,
        target: FrameLinkTarget,
        method: str,
        metadata: Metadata,
        reply_type: type[M],
        request: Any = None,
        *,
        max_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        super().__init__()
        self.target = target
        self._reply_type = reply_type
        self._max_bytes = max_bytes
        self._reader: asyncio.StreamReader | None = None
        loop = asyncio.get_running_loop()
        self._connected = loop.create_task(self._connect(method, metadata, request))

    async def _connect(self, method: str, metadata: Metadata, request: Any) -> None:
        try:
            async with asyncio.timeout(_CONNECT_SECONDS):
                self._reader, self._writer = await self.target.connect()
            first = pack(Kind.OPEN, encode_open(method, metadata))
            if request is not None:
                first += pack(Kind.MESSAGE, request.SerializeToString())
            self._writer.write(first)
            await self._writer.drain()
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            self._end(UNAVAILABLE, f"frame link {self.target.endpoint}: {exc!r}")

    async def _ready(self) -> asyncio.StreamWriter:
        await asyncio.shield(self._connected)
        if self._status.done() or self._writer is None:
            raise asyncio.InvalidStateError("the call is over")
        return self._writer

    async def write(self, message: Any) -> None:
        """Sends one message; ``InvalidStateError`` once the call is over (its status says
        why)."""
        writer = await self._ready()
        try:
            writer.write(pack(Kind.MESSAGE, message.SerializeToString()))
            await writer.drain()
        except (OSError, RuntimeError) as exc:
            self._end(UNAVAILABLE, f"frame link {self.target.endpoint}: {exc!r}")
            raise asyncio.InvalidStateError("the call is over") from exc

    async def done_writing(self) -> None:
        writer = await self._ready()
        try:
            writer.write(pack(Kind.HALF_CLOSE))
            await writer.drain()
        except (OSError, RuntimeError):
            self._end(UNAVAILABLE, f"frame link {self.target.endpoint}: closed")

    async def read(self) -> Any:
        """The next reply; ``None`` after an OK end; :class:`LinkCallFailed` for any other."""
        await asyncio.shield(self._connected)
        if not self._status.done():
            assert self._reader is not None
            try:
                kind, payload = await read_message(self._reader, self._max_bytes)
                if kind is Kind.MESSAGE:
                    reply = self._reply_type()
                    reply.ParseFromString(payload)  # type: ignore[attr-defined]
                    return reply
                if kind is not Kind.STATUS:
                    raise LinkProtocolError(f"a {kind.name} from the worker")
                self._end(*decode_status(payload))
            except (asyncio.IncompleteReadError, OSError) as exc:
                self._end(
                    UNAVAILABLE, f"frame link {self.target.endpoint} lost: {type(exc).__name__}"
                )
            except Exception as exc:  # noqa: BLE001 - bytes that are not the protocol
                self._end(INTERNAL, f"frame link {self.target.endpoint}: malformed answer: {exc}")
        self._over()
        return None

    def cancel(self) -> bool:
        self._connected.cancel()
        return super().cancel()
