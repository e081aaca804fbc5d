"""A stage's stream to the next stage of a chained route (``docs/chain.md``): where a link
points (:class:`ChainLink`), the stream that carries one upstream stream's frames on
(:class:`Downstream`), and how its end is passed up (:class:`ChainFailure`): the downstream's
own refusal as it is (it names its hop already), or the next stage lost (``UNAVAILABLE``,
naming the hop this stage dialled).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any, Protocol

import attrs
import grpc

from dgr_engine.wire.frame_link import FrameLinkCall, LinkCallFailed
from dgr_engine.wire.metadata import CHAIN_SENDER_KEY, session_metadata
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.status import CHAIN_HOP_KEY, STATUS_KEY, grpc_code

_FAILURE_WAIT = 5.0
"""Seconds a stage whose write downstream failed waits for the downstream's status."""

Trailers = tuple[tuple[str, str], ...]


@attrs.frozen
class ChainFailure:
    """How a chained stream ends: a gRPC code, details and trailers (with ``dgr-chain-hop``)."""

    code: grpc.StatusCode
    details: str
    trailers: Trailers


@attrs.frozen
class ChainLink:
    """Where a session's output goes from this stage, for one epoch (``Chain.Link``)."""

    epoch: int
    endpoint: str
    expect: pb.Expectations
    secret: bytes
    tls: bool
    ring: bool = False
    """The last stage's link to the first: a ring (``LinkRequest.ring``)."""
    frame_link_port: int = 0
    """The next stage's frame link port, when the frames go over it (``ChainHop.frame_link``);
    0: over gRPC."""


class ChainDialer(Protocol):
    """What opens a stream to the next stage: its gRPC ``ChainStub``, or its frame link
    (``wire/frame_link.py``'s ``FrameLinkTarget``)."""

    def ChainStream(self, *, metadata: Any = ...) -> Any:  # noqa: N802 - the RPC's name
        ...


class _StreamOver(Exception):
    """A frame could not be written: the stream is over (its end says why)."""


class _GrpcCall:
    """A ``ChainStream`` over gRPC."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def write(self, request: pb.ForwardRequest) -> None:
        try:
            await self._call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise _StreamOver(repr(exc)) from exc

    async def done_writing(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self._call.done_writing()

    async def ended(self) -> tuple[grpc.StatusCode, str, Any] | None:
        """Reads to the end: ``None`` for OK (or a call already over), else its end."""
        try:
            while await self._call.read() is not grpc.aio.EOF:
                pass  # nothing is answered while all goes well
            code = await self._call.code()
            if code == grpc.StatusCode.OK:
                return None
            return code, await self._call.details() or "", await self._call.trailing_metadata()
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or "", exc.trailing_metadata()
        except asyncio.InvalidStateError:
            return None

    def cancel(self) -> None:
        self._call.cancel()


class _FrameLinkCall:
    """A ``ChainStream`` over the next stage's frame link (its status: gRPC's number)."""

    def __init__(self, call: FrameLinkCall[Any]) -> None:
        self._call = call

    async def write(self, request: pb.ForwardRequest) -> None:
        try:
            await self._call.write(request)
        except asyncio.InvalidStateError as exc:
            raise _StreamOver(repr(exc)) from exc

    async def done_writing(self) -> None:
        with contextlib.suppress(asyncio.InvalidStateError):
            await self._call.done_writing()

    async def ended(self) -> tuple[grpc.StatusCode, str, Any] | None:
        try:
            while await self._call.read() is not None:
                pass  # nothing is answered while all goes well
        except LinkCallFailed as failed:
            return grpc_code(failed.code), failed.details, failed.trailers
        return None

    def cancel(self) -> None:
        self._call.cancel()


def failure_of(
    code: grpc.StatusCode,
    details: str,
    trailers: Iterable[tuple[str, Any]] | None,
    hop: int,
    endpoint: str,
) -> ChainFailure:
    """A downstream stream's end, as this stage passes it up: the downstream's own refusal
    (already naming its hop), or the next stage lost (``UNAVAILABLE``, naming ``hop``)."""
    found: dict[str, str] = {}
    for key, value in trailers or ():
        found[key] = value if isinstance(value, str) else bytes(value).decode()
    if CHAIN_HOP_KEY in found:
        return ChainFailure(code, details, tuple(found.items()))
    if STATUS_KEY not in found and code in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
    ):
        code, found[STATUS_KEY] = grpc.StatusCode.UNAVAILABLE, "DGR_E_UNAVAILABLE"
        details = f"chain hop {hop} ({endpoint}) lost: {details}"
    found[CHAIN_HOP_KEY] = str(hop)
    return ChainFailure(code, details, tuple(found.items()))


class Downstream:
    """This stage's stream to the next stage for one upstream stream: frames out; its end, if
    it is an error, resolves ``failed``."""

    def __init__(
        self,
        stub: ChainDialer,
        first: pb.ForwardRequest,
        link: ChainLink,
        hop: int,
        failed: asyncio.Future[ChainFailure],
        watchers: set[asyncio.Task[None]],
        *,
        sender: int,
    ) -> None:
        """``hop``: the next stage's index, named in its failures; ``sender``: this stage's,
        named to the next stage (``CHAIN_SENDER_KEY``) as the sender of the frames."""
        self.link = link
        self.hop = hop
        self.failed = failed
        self.watchers = watchers
        metadata = (*session_metadata(first), (CHAIN_SENDER_KEY, str(sender)))
        call = stub.ChainStream(metadata=metadata)
        self.call = _FrameLinkCall(call) if isinstance(call, FrameLinkCall) else _GrpcCall(call)
        self.watcher = asyncio.get_running_loop().create_task(self._watch())
        watchers.add(self.watcher)
        self.watcher.add_done_callback(watchers.discard)

    def _fail(self, failure: ChainFailure) -> None:
        if not self.failed.done():
            self.failed.set_result(failure)

    async def _watch(self) -> None:
        ended = await self.call.ended()
        if ended is not None:
            code, details, trailers = ended
            self._fail(failure_of(code, details, trailers, self.hop, self.link.endpoint))

    async def send(self, request: pb.ForwardRequest) -> None:
        try:
            await self.call.write(request)
        except _StreamOver as exc:
            try:  # the stream is over: its status says why
                async with asyncio.timeout(_FAILURE_WAIT):
                    await asyncio.shield(self.failed)
            except TimeoutError:
                self._fail(
                    failure_of(
                        grpc.StatusCode.UNAVAILABLE, str(exc), None, self.hop, self.link.endpoint
                    )
                )

    async def finish(self) -> None:
        """The upstream stream ended: half-close this one (the next stage ends in turn)."""
        await self.call.done_writing()

    def cancel(self) -> None:
        self.call.cancel()
        self.watcher.cancel()

    def finish_soon(self) -> None:
        """Half-closes in the background (a ring whose epoch was closed)."""
        task = asyncio.get_running_loop().create_task(self.finish())
        self.watchers.add(task)
        task.add_done_callback(self.watchers.discard)


__all__ = ["ChainDialer", "ChainFailure", "ChainLink", "Downstream", "Trailers", "failure_of"]
