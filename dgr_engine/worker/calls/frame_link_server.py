"""A worker's frame link (``wire/frame_link.py``, ``docs/data-paths.md``): the ``Chain`` service's
two streaming calls served over raw TCP (TLS exactly when the gRPC port serves it), by the same
:class:`~dgr_engine.worker.calls.chain.ChainServicer` methods as over gRPC.

Each connection carries one call. It must finish its TLS handshake and say which call within
``hello_seconds`` (default ``HELLO_SECONDS``), waiting meanwhile in the port's gate of
strangers (``worker/calls/introductions.py``), and send its request (``ChainOutput``) or begin
its first frame (``ChainStream``) within as long again: a peer that connects and never sends
is dropped. A
header that is not the protocol's (a length over the worker's message limit, an unknown kind)
ends the call with ``INVALID_ARGUMENT`` / ``DGR_E_FRAME``, and a peer that goes away mid-call
cancels its handler, exactly as a cancelled gRPC call does (the epoch is abandoned). At most
``max_connections`` calls are served at once; a call beyond that is answered
``RESOURCE_EXHAUSTED`` and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from dgr_engine.security.tls import ServerTls
from dgr_engine.wire import frame_link as fl
from dgr_engine.wire.keepalive import keep_alive
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.status import STATUS_KEY
from dgr_engine.worker.calls.chain import ChainServicer
from dgr_engine.worker.calls.introductions import HELLO_SECONDS, IntroductionGate
from dgr_engine.worker.calls.registration import lenient
from dgr_session.identifiers import log_field

if TYPE_CHECKING:
    from loguru import Logger

__all__ = ["HELLO_SECONDS", "FrameLinkServer", "LinkAborted", "LinkContext", "connection_limit"]

_FRAME_REFUSAL = ((STATUS_KEY, "DGR_E_FRAME"),)


class LinkAborted(Exception):
    """A handler ended the call with a status (``LinkContext.abort``)."""


class LinkContext:
    """What the ``ChainServicer`` methods use of a gRPC servicer context."""

    def __init__(self, metadata: fl.Metadata) -> None:
        self.metadata = metadata
        self.status: tuple[grpc.StatusCode, str, fl.Metadata] | None = None

    def fail(self, code: grpc.StatusCode, details: str, trailers: fl.Metadata = ()) -> None:
        if self.status is None:
            self.status = (code, details, tuple(trailers))

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        self.fail(code, details, tuple((str(k), str(v)) for k, v in trailing_metadata or ()))
        raise LinkAborted(details)

    def time_remaining(self) -> float | None:
        return None  # a frame link call has no deadline of its own: frames carry theirs

    def invocation_metadata(self) -> fl.Metadata:
        return self.metadata


class FrameLinkServer:
    """Serves one worker's ``ChainServicer`` on a frame link port."""

    def __init__(
        self,
        servicer: ChainServicer,
        log: Logger,
        *,
        tls: ServerTls | None,
        max_message_bytes: int,
        max_connections: int,
        introductions: IntroductionGate,
        hello_seconds: float = HELLO_SECONDS,
        counted: Callable[[str], None] = lambda call: None,
    ) -> None:
        """``max_connections``: calls served at once; ``introductions``: where connections
        wait for their TLS handshake and ``OPEN`` (bounded per source and in all,
        ``worker/calls/introductions.py``), ``hello_seconds`` at most; ``counted`` is told what
        came of each connection: the call it opened (``ChainStream``, ``ChainOutput``),
        ``refused`` or ``evicted`` (metrics)."""
        if not 0 < hello_seconds < float("inf"):
            raise ValueError(f"hello_seconds must be finite and > 0, got {hello_seconds}")
        self._servicer = servicer
        self._log = log
        self._tls = tls
        self._max_bytes = max_message_bytes
        self._max_connections = max_connections
        self.introductions = introductions
        self._context = fl.server_ssl_context(tls) if tls is not None else None
        self._counted = counted
        self._hello = hello_seconds
        self._server: asyncio.Server | None = None
        self._calls: set[asyncio.Task[None]] = set()
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0
        self.refused = 0
        """Connections refused (over the limit, or not the protocol)."""

    @property
    def open_calls(self) -> int:
        """Connections held now: calls (past their ``OPEN``; at most ``max_connections``) and
        connections waiting for their ``OPEN`` (at most the gate's)."""
        return len(self._connections)

    async def start(self, host: str, port: int) -> int:
        """Binds and serves; returns the port."""
        # TLS is started by each connection once the gate admitted it (``_serve``)
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Stops accepting and cancels every call (their epochs are abandoned)."""
        if self._server is not None:
            self._server.close()
        calls, self._connections = set(self._connections), set()
        self._calls.clear()
        for call in calls:
            call.cancel()
        if calls:
            await asyncio.gather(*calls, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        keep_alive(writer.get_extra_info("socket"))
        peer = writer.get_extra_info("peername")
        place = self.introductions.admit(
            str(peer[0]) if peer else "-", functools.partial(self._evict, task)
        )
        try:
            try:  # a stranger until its TLS handshake and OPEN: its place can be taken
                async with asyncio.timeout(self._hello):
                    if self._context is not None:
                        await writer.start_tls(self._context)
                    kind, payload = await fl.read_message(reader, self._max_bytes)
            except (TimeoutError, asyncio.IncompleteReadError, OSError, ssl.SSLError):
                self._refuse()  # silent, too slow, or gone before a call began: dropped
                return
            except fl.LinkProtocolError as exc:
                self._refuse()
                self._log.warning("frame link refused: {}", log_field(str(exc), limit=200))
                await _send_status(
                    writer, grpc.StatusCode.INVALID_ARGUMENT, f"DGR_E_FRAME: {exc}", _FRAME_REFUSAL
                )
                return
            finally:
                self.introductions.leave(place)
            if len(self._calls) >= self._max_connections:
                self._refuse()
                why = f"DGR_E_CAPACITY: {self._max_connections} frame link calls are open"
                status = ((STATUS_KEY, "DGR_E_CAPACITY"),)
                writer.write(
                    fl.pack(
                        fl.Kind.STATUS,
                        fl.encode_status(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], why, status),
                    )
                )
                await writer.drain()
                return
            self._calls.add(task)
            try:
                if kind is not fl.Kind.OPEN:
                    raise fl.LinkProtocolError(f"a {kind.name} before OPEN")
                method, metadata = fl.decode_open(payload)
                self._counted(method)
                context = LinkContext(metadata)
                if method == "ChainStream":
                    await self._chain_stream(reader, writer, context)
                else:
                    async with asyncio.timeout(self._hello):
                        kind, payload = await fl.read_message(reader, self._max_bytes)
                    if kind is not fl.Kind.MESSAGE:
                        raise fl.LinkProtocolError(f"a {kind.name} in place of the request")
                    await self._chain_output(reader, writer, context, payload)
            except fl.LinkProtocolError as exc:
                self._refuse()
                self._log.warning("frame link refused: {}", log_field(str(exc), limit=200))
                await _send_status(
                    writer,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"DGR_E_FRAME: {exc}",
                    _FRAME_REFUSAL,
                )
            except (TimeoutError, asyncio.IncompleteReadError, OSError, ssl.SSLError):
                self._refuse()  # silent, too slow, or gone before a call began: dropped
        except asyncio.CancelledError:
            # the server stops (``stop``), and this call with it. Not raised on: Python 3.11's
            # start_server reads a handler's end with ``task.exception()``, which raises for a
            # cancelled task, and the loop logs that as an unhandled error with its traceback
            pass
        finally:
            self._calls.discard(task)
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _evict(self, task: asyncio.Task[None]) -> None:
        """Ends a connection still waiting for its ``OPEN`` (the gate needs its place)."""
        self._counted("evicted")
        task.cancel()

    def _refuse(self) -> None:
        self.refused += 1
        self._counted("refused")

    async def _chain_stream(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, context: LinkContext
    ) -> None:
        serving: asyncio.Task[None] | None = None

        async def requests() -> AsyncIterator[Any]:
            parse = lenient(pb.ForwardRequest)
            # the first frame must begin within the hello timeout (every caller sends one with
            # its OPEN); a stream may then idle as long as its session does
            hello: float | None = self._hello
            while True:
                try:
                    kind, payload = await fl.read_message(
                        reader, self._max_bytes, header_seconds=hello
                    )
                    hello = None
                except fl.LinkProtocolError as exc:
                    context.fail(
                        grpc.StatusCode.INVALID_ARGUMENT, f"DGR_E_FRAME: {exc}", _FRAME_REFUSAL
                    )
                    kind = None
                except (asyncio.IncompleteReadError, OSError):  # TimeoutError is an OSError
                    kind = None  # the caller went away mid-call (or never sent a frame)
                if kind is fl.Kind.HALF_CLOSE:
                    return
                if kind is fl.Kind.MESSAGE:
                    yield parse(payload)
                    continue
                if kind is not None:
                    context.fail(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"DGR_E_FRAME: a {kind.name} inside a ChainStream",
                        _FRAME_REFUSAL,
                    )
                assert serving is not None
                serving.cancel()
                await asyncio.Event().wait()  # cancelled with the call

        stream = self._servicer.ChainStream(requests(), context)
        serving = asyncio.get_running_loop().create_task(self._drive(stream, writer, context))
        await self._await_call(serving, writer, context)

    async def _chain_output(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        context: LinkContext,
        payload: bytes,
    ) -> None:
        request = lenient(pb.ChainOutputRequest)(payload)
        stream = self._servicer.ChainOutput(request, context)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        serving = loop.create_task(self._drive(stream, writer, context))
        # the caller sends nothing more: its connection's end (or any byte) cancels the call
        watch = loop.create_task(reader.read(1))
        watch.add_done_callback(lambda _: serving.cancel())
        try:
            await self._await_call(serving, writer, context)
        finally:
            watch.cancel()

    async def _await_call(
        self, serving: asyncio.Task[None], writer: asyncio.StreamWriter, context: LinkContext
    ) -> None:
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # the server stops: so does the call
                serving.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await serving
                raise
            # the caller went away, or broke the protocol: the call was cancelled
            if context.status is not None:
                await _send_status(writer, *context.status)

    async def _drive(
        self, stream: AsyncIterator[Any], writer: asyncio.StreamWriter, context: LinkContext
    ) -> None:
        """Runs one call's handler: its replies out, then its status."""
        try:
            async for reply in stream:
                writer.write(fl.pack(fl.Kind.MESSAGE, reply.SerializeToString()))
                await writer.drain()
        except LinkAborted:
            pass
        except (OSError, RuntimeError):
            return  # the connection is gone: nobody to tell
        except Exception as exc:  # noqa: BLE001 - a handler's bug must not take the worker down
            self._log.opt(exception=exc).error("frame link call failed: {!r}", exc)
            context.fail(
                grpc.StatusCode.INTERNAL,
                f"DGR_E_INTERNAL: {exc!r}",
                ((STATUS_KEY, "DGR_E_INTERNAL"),),
            )
        status = context.status or (grpc.StatusCode.OK, "", ())
        await _send_status(writer, *status)


async def _send_status(
    writer: asyncio.StreamWriter, code: grpc.StatusCode, details: str, trailers: fl.Metadata
) -> None:
    with contextlib.suppress(OSError, RuntimeError):
        payload = fl.encode_status(code.value[0], details, trailers)  # gRPC's number
        writer.write(fl.pack(fl.Kind.STATUS, payload))
        await writer.drain()


def connection_limit(max_sessions: int) -> int:
    """Calls a worker serves at once by default: per session an upstream stream, an output
    stream and a ring stream, twice over (an epoch's streams and its successor's), plus slack."""
    return 6 * max_sessions + 16
