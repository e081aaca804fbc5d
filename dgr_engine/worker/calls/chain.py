"""The ``dgr.shard.v1.Chain`` service of a worker: chained routes (``docs/chain.md``).

A chained frame arrives on ``ChainStream`` (from the client at the first stage, from the stage
before elsewhere) and is run exactly like a ``ForwardStream`` frame (the same checks, epoch
fence, session secret and engine call: the per-frame path, ``worker/calls/frame_path.py``). Its
output then goes where the chain hub (``worker/route/chain_hub.py``) was told by ``Link`` for that
session and epoch: to the next stage's ``ChainStream`` (one stream per upstream stream, over
one channel per next endpoint: ``worker/route/chain_downstream.py``), or, on the last stage, to the
session's ``ChainOutput`` stream, which the client opened there.

Nothing is answered upstream while all goes well. A frame refused here, or a refusal or a
lost stage downstream (the downstream stream ended with an error), ends the upstream stream
with that refusal's code and trailers plus ``dgr-chain-hop``, the index of the stage that
refused or was lost: each stage passes a downstream failure up as it is, so the client learns
which stage failed and why, one hop back per stage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import grpc

from dgr_engine.engine import ShardInfo
from dgr_engine.errors import FrameRejected, ShardUnavailable
from dgr_engine.status import Status, status_of
from dgr_engine.wire import frames
from dgr_engine.wire.frame_link import split_endpoint
from dgr_engine.wire.metadata import chain_sender
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.worker.calls.frame_path import Forwarded, FramePath
from dgr_engine.worker.calls.registration import lenient
from dgr_engine.worker.lifecycle.grant_gate import GrantGate
from dgr_engine.worker.route.chain_downstream import ChainFailure, ChainLink, Downstream
from dgr_engine.worker.route.chain_frames import next_frame, ring_frame
from dgr_engine.worker.route.chain_hub import ChainHub
from dgr_session.identifiers import is_valid_session_id, log_field

if TYPE_CHECKING:
    from loguru import Logger

    from dgr_engine.worker.calls.native_link_server import NativeLinkServer

CHAIN_SERVICE_NAME = "dgr.shard.v1.Chain"
"""Full gRPC name of the chain service."""

_CONFIRM_WAIT = 5.0
"""Seconds a stage without grant keys waits for a next stage to confirm a link."""

MAX_CHAIN_HOP = 1 << 16
"""The largest ``chain_hop`` a chained frame may carry (a route has far fewer stages; a larger
one is malformed, and ``chain_hop + 1`` must fit the next frame's uint32)."""


def _blamed(exc: Exception, hop: int, sender: int | None) -> int:
    """The stage a chained frame's refusal names: a malformed frame (``DGR_E_FRAME``) is its
    sender's, as a native link names it: the stage before (``hop`` - 1), or on the first stage
    the stage its stream says sent it (a ring's last stage); the client's own frames on the
    first stage name it. Any other refusal is this stage's (``hop``)."""
    if status_of(exc) is not Status.FRAME:
        return hop
    if hop > 0:
        return hop - 1
    return sender if sender is not None else hop


_CHAINED = "chained frame"
"""How a refusal of a chained frame names it in the log."""


class ChainHost(Protocol):
    """What the ``Chain`` service needs of the worker beyond its frame path and hub."""

    @property
    def info(self) -> ShardInfo:
        """The shard's shape: whether this is the last stage."""
        ...

    @property
    def log(self) -> Logger:
        """The worker's log (bound to its stage)."""
        ...

    @property
    def grants(self) -> GrantGate:
        """Session secrets, and (with grant keys) the next stage each grant names."""
        ...

    def abandon(self, session_id: str, epoch: int, why: str) -> None:
        """A call of the epoch was cancelled by its caller: the epoch is closed."""
        ...

    @property
    def native_link_port(self) -> int:
        """Where this worker serves native links (0: it offers none)."""
        ...

    @property
    def native_links(self) -> NativeLinkServer:
        """Its native links (``worker/calls/native_link_server.py``)."""
        ...


class ChainServicer(shard_pb2_grpc.ChainServicer):
    """The ``Chain`` service over one worker (``host``), its frame path and its chain hub."""

    def __init__(self, host: ChainHost, path: FramePath, hub: ChainHub) -> None:
        self.host = host
        self.path = path
        self.hub = hub

    async def Link(
        self, request: pb.LinkRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LinkReply:
        await self.path.refuse_undecodable(context, request, "link")
        try:
            frames.check_session_id(request.session_id)
            self.host.grants.check(request.session_id, int(request.epoch), request.session_secret)
            if self.host.info.is_last != request.ring:
                raise FrameRejected(
                    "DGR_E_FRAME: only the last stage links (back to the first) as a ring"
                    if request.ring
                    else "DGR_E_FRAME: the last stage links to no next stage but a ring's first"
                )
            self.path.check_open(request.session_id, int(request.epoch))
            if self.host.grants.enabled:  # only the next stage the route grant names
                self.host.grants.check_link(
                    request.session_id, int(request.epoch), request.next.endpoint
                )
            else:  # only a stage that holds this session and epoch with the secret given
                remaining = context.time_remaining()
                await self.hub.confirm_next(
                    request.session_id,
                    int(request.epoch),
                    request.next,
                    min(_CONFIRM_WAIT, remaining) if remaining is not None else _CONFIRM_WAIT,
                )
            if request.next.native_link:
                await self._link_native(request)
                return pb.LinkReply(session_id=request.session_id, epoch=request.epoch)
            port = 0
            if request.next.frame_link:  # the port is the next stage's own word, not the linker's
                port = await self.hub.frame_link_port(request.next, _CONFIRM_WAIT)
            self.hub.link(
                request.session_id,
                int(request.epoch),
                request.next,
                ring=request.ring,
                frame_link_port=port,
            )
        except Exception as exc:
            await self.path.refuse(context, exc, request, "link")
        self.host.log.bind(session=request.session_id, epoch=request.epoch).debug(
            "linked to {}", log_field(request.next.endpoint)
        )
        return pb.LinkReply(session_id=request.session_id, epoch=request.epoch)

    async def _link_native(self, request: pb.LinkRequest) -> None:
        """A link over native links: this stage dials the next stage's native link port (read
        from that stage's own advert) and introduces itself with the next stage's secret; the
        link starts when this stage has its input too (``worker/calls/native_link_server.py``)."""
        if not self.host.native_link_port:
            raise FrameRejected("DGR_E_FRAME: this stage offers no native link")
        port, sealed = await self.hub.native_link(request.next, _CONFIRM_WAIT)
        host, _ = split_endpoint(request.next.endpoint)
        try:
            await self.host.native_links.link_next(
                request.session_id,
                int(request.epoch),
                host,
                port,
                bytes(request.next.session_secret),
                int(request.next.native_hop),
                ring=request.ring,
                sealed=sealed,
            )
        except (ConnectionError, TimeoutError) as exc:
            raise ShardUnavailable(
                f"DGR_E_UNAVAILABLE: the next stage {request.next.endpoint!r} did not take a "
                f"native link ({exc!r}): not linked"
            ) from None

    async def ChainOutput(
        self, request: pb.ChainOutputRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ChainOutputReply]:
        await self.path.refuse_undecodable(context, request, "chain output")
        try:
            frames.check_session_id(request.session_id)
            self.host.grants.check(request.session_id, int(request.epoch), request.session_secret)
            if not self.host.info.is_last:
                raise FrameRejected("DGR_E_FRAME: only the last stage has an output stream")
            self.path.check_open(request.session_id, int(request.epoch))
            output = self.hub.open_output(request.session_id, int(request.epoch))
        except Exception as exc:
            await self.path.refuse(context, exc, request, "chain output")
        try:
            yield pb.ChainOutputReply()  # registered: frames may flow
            while (item := await output.queue.get()) is not None:
                if isinstance(item, ChainFailure):  # the ring failed
                    self.host.log.bind(session=request.session_id, epoch=request.epoch).warning(
                        "ring failed: {} {}", item.code.name, log_field(item.details, limit=1000)
                    )
                    await context.abort(item.code, item.details, trailing_metadata=item.trailers)
                    return  # unreachable: abort raises
                yield item
        finally:
            self.hub.drop_output(request.session_id, output)

    async def ChainStream(
        self,
        requests: AsyncIterator[pb.ForwardRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ChainAck]:
        # one task reads and runs the frames; a failure downstream wakes it while it waits for
        # the next frame (a cancel it takes back), and is seen between frames otherwise: no
        # task per frame
        task = asyncio.current_task()
        assert task is not None
        failed: asyncio.Future[ChainFailure] = asyncio.get_running_loop().create_future()
        waiting = False

        def wake(_: object) -> None:
            if waiting:
                task.cancel()

        failed.add_done_callback(wake)
        down: Downstream | None = None
        last: pb.ForwardRequest | None = None
        incoming = aiter(requests)
        finished = False
        sender = chain_sender(context.invocation_metadata())  # None: the client's stream
        try:
            while True:
                if failed.done():
                    await self._abort(context, failed.result(), last)
                waiting = True
                try:
                    request = await anext(incoming)
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    if failed.done() and task.uncancel() == 0:  # woken by the failure alone
                        await self._abort(context, failed.result(), last)
                    raise
                finally:
                    waiting = False
                await self.path.refuse_undecodable(context, request, _CHAINED, hop=sender or 0)
                last = request
                down = await self._one(context, request, down, failed, sender)
            if down is not None:
                await down.finish()
            finished = True
        except (asyncio.CancelledError, GeneratorExit):
            if last is not None and is_valid_session_id(last.session_id):
                self.host.abandon(last.session_id, int(last.epoch), "chain stream cancelled")
            raise
        finally:
            failed.remove_done_callback(wake)
            if down is not None and not finished:
                down.cancel()  # this stage refused, or the chain failed: the epoch is over
        if False:  # pragma: no cover - makes this an async generator (answers nothing)
            yield pb.ChainAck()

    async def _one(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        request: pb.ForwardRequest,
        down: Downstream | None,
        failed: asyncio.Future[ChainFailure],
        sender: int | None,
    ) -> Downstream | None:
        """Runs one chained frame (sent by ``sender``, as its stream says) and passes its
        output on; returns the downstream stream.
        The next frame leaves before this one is counted (``FramePath.account``): the
        counting then overlaps the next stage's engine."""
        hop = int(request.chain_hop)
        sid = request.session_id
        began = time.perf_counter_ns()
        try:
            if hop > MAX_CHAIN_HOP:
                raise FrameRejected(f"DGR_E_FRAME: chain_hop {hop} is over {MAX_CHAIN_HOP}")
            frames.check_session_id(sid)  # before it reaches the hub or a log line
        except Exception as exc:
            await self.path.refuse(context, exc, request, _CHAINED, hop=_blamed(exc, hop, sender))
        try:
            # where the output goes is checked before the rows touch the session's state
            link, ring = self._where_output_goes(request)
        except Exception as exc:
            await self.path.refuse(context, exc, request, _CHAINED, hop=hop)
        try:
            done = await self.path.run(request, None)
        except Exception as exc:
            await self.path.refuse(context, exc, request, _CHAINED, hop=_blamed(exc, hop, sender))
        try:
            return await self._pass_on(context, done, began, (link, ring), down, failed)
        finally:
            self.path.account(done)

    async def _pass_on(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        done: Forwarded,
        began: int,
        where: tuple[ChainLink | None, ChainLink | None],
        down: Downstream | None,
        failed: asyncio.Future[ChainFailure],
    ) -> Downstream | None:
        """Sends a run frame's output on: to the next stage (``where``'s link), or on the last
        stage to the client's output stream (and, on a ring, ``where``'s ring link, the next
        frame to the first stage, with the session's token the stage took)."""
        request, reply = done.request, done.reply
        link, ring = where
        hop = int(request.chain_hop)
        sid, epoch = request.session_id, int(request.epoch)
        t = reply.timings
        trace = pb.HopTrace(
            hop=hop,
            timings=pb.Timings(
                queue_us=t.queue_us,
                compute_us=t.compute_us,
                total_us=(time.perf_counter_ns() - began) // 1000,
                native_us=t.native_us,
            ),
            bytes_in=request.ByteSize(),
            bytes_out=reply.output.ByteSize() + 4 * len(reply.sampled),
        )
        if link is None:
            out = pb.ChainOutputReply(reply=reply)
            out.hops.extend(request.chain_trace)
            out.hops.append(trace)
            frame = None
            if ring is not None:
                drafting = self.hub.ring_drafting(sid, epoch, request)
                frame = ring_frame(request, reply, done.sampled, ring, drafting)
                if frame is not None:  # what it sends on, for the client to expect
                    out.ring_next.extend(frame.token_ids)
            try:
                self.hub.check_output(sid, epoch)  # no output stream: the ring goes no further
            except Exception as exc:
                await self.path.refuse(context, exc, request, _CHAINED, hop=hop)
            if ring is not None and frame is not None:
                await self.hub.ring_send(sid, ring, frame, sender=hop)  # the ring's next first
            try:
                self.hub.deliver(sid, epoch, out)
            except Exception as exc:
                await self.path.refuse(context, exc, request, _CHAINED, hop=hop)
            return down
        if down is None or down.link != link:
            if down is not None:
                await down.finish()
            down = Downstream(
                self.hub.stub(link), request, link, hop + 1, failed, self.hub.watchers, sender=hop
            )
        await down.send(next_frame(request, reply, link, trace))
        return down

    def _where_output_goes(
        self, request: pb.ForwardRequest
    ) -> tuple[ChainLink | None, ChainLink | None]:
        """The next stage's link (``None`` on the last stage) and, on a ring's last stage, its
        ring link. ``FrameRejected`` when there is none; but the hub forgets an epoch the
        session table closed, so a frame of an epoch that is not open here (checked after its
        secret, as any frame's) is refused as the table refuses it (unknown, stale)."""
        sid, epoch = request.session_id, int(request.epoch)
        try:
            if self.host.info.is_last:
                self.hub.check_output(sid, epoch)
                return None, self.hub.ring_link(sid, epoch)
            return self.hub.next_hop(sid, epoch), None
        except FrameRejected:
            self.host.grants.check(sid, epoch, request.session_secret)
            self.path.check_open(sid, epoch)
            raise

    async def _abort(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        failure: ChainFailure,
        last: pb.ForwardRequest | None,
    ) -> NoReturn:
        """Ends the stream with a failure downstream, passed up as it is."""
        log = self.host.log.bind(
            session=log_field(getattr(last, "session_id", "-")),
            epoch=log_field(getattr(last, "epoch", "-")),
        )
        details = log_field(failure.details, limit=1000)
        log.warning("chain failed downstream: {} {}", failure.code.name, details)
        await context.abort(failure.code, failure.details, trailing_metadata=failure.trailers)
        raise AssertionError("unreachable: abort raises")


def add_chain_service(servicer: ChainServicer, server: grpc.aio.Server) -> None:
    """Registers the ``Chain`` service's methods (lenient parsing, like ``Shard``'s)."""
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Link": unary(
            servicer.Link,
            request_deserializer=lenient(pb.LinkRequest),
            response_serializer=pb.LinkReply.SerializeToString,
        ),
        "ChainStream": grpc.stream_stream_rpc_method_handler(
            servicer.ChainStream,
            request_deserializer=lenient(pb.ForwardRequest),
            response_serializer=pb.ChainAck.SerializeToString,
        ),
        "ChainOutput": grpc.unary_stream_rpc_method_handler(
            servicer.ChainOutput,
            request_deserializer=lenient(pb.ChainOutputRequest),
            response_serializer=pb.ChainOutputReply.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(CHAIN_SERVICE_NAME, handlers),)
    )
    server.add_registered_method_handlers(CHAIN_SERVICE_NAME, handlers)


__all__ = [
    "CHAIN_SERVICE_NAME",
    "MAX_CHAIN_HOP",
    "ChainHost",
    "ChainServicer",
    "add_chain_service",
]
