"""The ``dgr.shard.v1.Chain`` service of a worker: chained routes (``docs/chain.md``).

A chained frame arrives on ``ChainStream`` (from the client at the first stage, from the stage
before elsewhere) and is run exactly like a ``ForwardStream`` frame (the same checks, epoch
fence, session secret and engine call: :meth:`ShardServicer._forward`). Its output then goes
where :class:`ChainHub` was told by ``Link`` for that session and epoch: to the next stage's
``ChainStream`` (one stream per upstream stream, over one channel per next endpoint), or, on
the last stage, to the session's ``ChainOutput`` stream, which the client opened there.

Nothing is answered upstream while all goes well. A frame refused here, or a refusal or a
lost stage downstream (the downstream stream ended with an error), ends the upstream stream
with that refusal's code and trailers plus ``dgr-chain-hop``, the index of the stage that
refused or was lost: each stage passes a downstream failure up as it is, so the client learns
which stage failed and why, one hop back per stage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any, NoReturn

import attrs
import grpc
import numpy as np

from dgr_engine.errors import FrameRejected, GrantDenied, ShardError, ShardUnavailable
from dgr_engine.security.tls import ClientTls
from dgr_engine.wire import frames
from dgr_engine.wire.metadata import DEFAULT_MAX_MESSAGE_BYTES, session_metadata
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.wire.status import (
    CHAIN_HOP_KEY,
    STATUS_KEY,
    grpc_status_for,
    is_worker_fault,
    refusal_trailers,
)
from dgr_engine.worker.registration import Undecodable, lenient
from dgr_session.identifiers import is_valid_session_id, log_field

if TYPE_CHECKING:
    from dgr_engine.worker.servicer import ShardServicer

CHAIN_SERVICE_NAME = "dgr.shard.v1.Chain"
"""Full gRPC name of the chain service."""

_FAILURE_WAIT = 5.0
"""Seconds a stage whose write downstream failed waits for the downstream's status."""

_CONFIRM_WAIT = 5.0
"""Seconds a stage without grant keys waits for a next stage to confirm a link."""

MAX_CHAIN_HOP = 1 << 16
"""The largest ``chain_hop`` a chained frame may carry (a route has far fewer stages; a larger
one is malformed, and ``chain_hop + 1`` must fit the next frame's uint32)."""

Trailers = tuple[tuple[str, str], ...]


@attrs.frozen
class ChainFailure:
    """How a chained stream ends: a gRPC code, details and trailers (with ``dgr-chain-hop``)."""

    code: grpc.StatusCode
    details: str
    trailers: Trailers


@attrs.frozen
class _Link:
    epoch: int
    endpoint: str
    expect: pb.Expectations
    secret: bytes
    tls: bool
    ring: bool = False
    """The last stage's link to the first: a ring (``LinkRequest.ring``)."""


@attrs.define(eq=False)
class _Output:
    epoch: int
    queue: asyncio.Queue[pb.ChainOutputReply | ChainFailure | None]


class ChainHub:
    """Per worker: where each session's output goes (links, output streams) and the channels
    to next stages (one per endpoint, reused by every session). ``tls``: how this worker dials
    a next stage that serves TLS (its CA and client certificate); ``None``: it cannot."""

    def __init__(self, tls: ClientTls | None, holds: Callable[[str], bool]) -> None:
        self.tls = tls
        self._holds = holds
        self._links: dict[str, _Link] = {}
        self._outputs: dict[str, _Output] = {}
        # a ring's stream from this (last) stage to the first, per session (with its link)
        self._rings: dict[str, tuple[_Link, _Downstream]] = {}
        self._stubs: dict[tuple[str, bool], shard_pb2_grpc.ChainStub] = {}
        # the Shard service over the same channels (confirm_next asks a next stage's Usage)
        self._shard_stubs: dict[tuple[str, bool], shard_pb2_grpc.ShardStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        # downstream streams' watchers still running (kept referenced; cancelled at close)
        self.watchers: set[asyncio.Task[None]] = set()

    def _sweep(self) -> None:
        """Forgets the links and outputs of sessions this worker no longer holds (closed by
        a lease, a stall or an abandoned call)."""
        for gone in [s for s in self._links if not self._holds(s)]:
            del self._links[gone]
        for gone in [s for s in self._outputs if not self._holds(s)]:
            self._outputs.pop(gone).queue.put_nowait(None)
        for gone in [s for s in self._rings if not self._holds(s)]:
            self._rings.pop(gone)[1].cancel()

    def link(self, session_id: str, epoch: int, hop: pb.ChainHop, *, ring: bool = False) -> None:
        self._sweep()
        held = self._links.get(session_id)
        if held is not None and held.epoch > epoch:
            raise FrameRejected(
                f"DGR_E_FRAME: session {session_id!r} is linked at epoch {held.epoch}, newer "
                f"than {epoch}"
            )
        if hop.tls and self.tls is None:
            raise FrameRejected(
                f"DGR_E_FRAME: the next stage {hop.endpoint} serves TLS and this worker has no "
                "chain TLS credentials"
            )
        expect = pb.Expectations()
        expect.CopyFrom(hop.expect)
        self._links[session_id] = _Link(
            epoch, hop.endpoint, expect, bytes(hop.session_secret), bool(hop.tls), ring
        )
        held_ring = self._rings.get(session_id)
        if held_ring is not None and held_ring[0].epoch < epoch:
            self._rings.pop(session_id)[1].cancel()

    async def confirm_next(
        self, session_id: str, epoch: int, hop: pb.ChainHop, timeout: float
    ) -> None:
        """Without grant keys, before a link: the named next stage must say that it holds
        ``(session_id, epoch)`` with the secret the linking client gave for it (a ``Usage``
        with ``held``), or a newer epoch of it (its epoch fence then refuses the frames, as it
        would have). One call, and no frame ever goes to an endpoint that does neither; raises
        ``GrantDenied`` when it answers no, ``ShardUnavailable`` when it does not answer (the
        client then blames the next stage, not this one)."""
        if hop.tls and self.tls is None:
            return  # link() refuses it
        key = (hop.endpoint, bool(hop.tls))
        shard = self._shard_stubs.get(key)
        # an endpoint not linked to yet gets a channel of its own for this one call, closed
        # after it: only a confirmed next stage's channel is kept (link() opens it)
        probe = None if shard is not None else self._open_channel(*key)
        if probe is not None:
            shard = shard_pb2_grpc.ShardStub(probe)
        assert shard is not None
        request = pb.UsageRequest(
            session_id=session_id, session_secret=bytes(hop.session_secret), held=True, epoch=epoch
        )
        try:
            await shard.Usage(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            said = dict(exc.trailing_metadata() or ())
            if said.get(STATUS_KEY) == "DGR_E_STALE_EPOCH":
                return  # it holds a newer epoch: its fence refuses the frames, naming it
            if STATUS_KEY not in said:  # not a dgr worker's refusal: unreachable, or no worker
                raise ShardUnavailable(
                    f"DGR_E_UNAVAILABLE: the next stage {hop.endpoint!r} did not answer whether "
                    f"it holds session {session_id!r} epoch {epoch} ({exc.code().name}): "
                    "not linked"
                ) from None
            raise GrantDenied(
                f"DGR_E_PERMISSION: the next stage {hop.endpoint!r} does not hold session "
                f"{session_id!r} epoch {epoch} with the secret given ({said[STATUS_KEY]}): "
                "not linked"
            ) from None
        finally:
            if probe is not None:
                await probe.close()

    def next_hop(self, session_id: str, epoch: int) -> _Link:
        link = self._links.get(session_id)
        if link is None or link.epoch != epoch:
            raise FrameRejected(
                f"DGR_E_FRAME: session {session_id!r} epoch {epoch} is not linked to a next "
                "stage (Chain.Link)"
            )
        return link

    def ring_link(self, session_id: str, epoch: int) -> _Link | None:
        """The last stage's ring link of ``(session_id, epoch)``, if the route is a ring."""
        link = self._links.get(session_id)
        return link if link is not None and link.ring and link.epoch == epoch else None

    async def ring_send(self, session_id: str, link: _Link, frame: pb.ForwardRequest) -> None:
        """Sends a ring's next frame to the first stage, over the session's ring stream; a
        failure of that stream ends the session's output stream with it."""
        held = self._rings.get(session_id)
        if held is None or held[0] is not link:
            if held is not None:
                held[1].cancel()
            failed: asyncio.Future[ChainFailure] = asyncio.get_running_loop().create_future()
            down = _Downstream(self.stub(link), frame, link, 0, failed, self.watchers)
            failed.add_done_callback(
                lambda f: (
                    self._fail_output(session_id, link.epoch, f.result())
                    if not f.cancelled()
                    else None
                )
            )
            self._rings[session_id] = held = (link, down)
        await held[1].send(frame)

    def _fail_output(self, session_id: str, epoch: int, failure: ChainFailure) -> None:
        output = self._outputs.get(session_id)
        if output is not None and output.epoch == epoch:
            output.queue.put_nowait(failure)

    def open_output(self, session_id: str, epoch: int) -> _Output:
        self._sweep()
        held = self._outputs.get(session_id)
        if held is not None and held.epoch >= epoch:
            raise FrameRejected(
                f"DGR_E_FRAME: session {session_id!r} already has an output stream at epoch "
                f"{held.epoch}"
            )
        if held is not None:
            held.queue.put_nowait(None)  # the older epoch's stream ends
        output = _Output(epoch, asyncio.Queue())
        self._outputs[session_id] = output
        return output

    def check_output(self, session_id: str, epoch: int) -> None:
        output = self._outputs.get(session_id)
        if output is None or output.epoch != epoch:
            raise FrameRejected(
                f"DGR_E_FRAME: session {session_id!r} epoch {epoch} has no output stream "
                "(Chain.ChainOutput)"
            )

    def deliver(self, session_id: str, epoch: int, reply: pb.ChainOutputReply) -> None:
        self.check_output(session_id, epoch)
        self._outputs[session_id].queue.put_nowait(reply)

    def drop_output(self, session_id: str, output: _Output) -> None:
        if self._outputs.get(session_id) is output:
            del self._outputs[session_id]

    def closed(self, session_id: str, epoch: int) -> None:
        """The session's ``epoch`` (or an older one) was closed here: forget its link and end
        its output stream."""
        link = self._links.get(session_id)
        if link is not None and link.epoch <= epoch:
            del self._links[session_id]
        output = self._outputs.get(session_id)
        if output is not None and output.epoch <= epoch:
            del self._outputs[session_id]
            output.queue.put_nowait(None)
        ring = self._rings.get(session_id)
        if ring is not None and ring[0].epoch <= epoch:
            self._rings.pop(session_id)[1].finish_soon()

    def dialled(self) -> frozenset[str]:
        """The endpoints this stage keeps a channel to: next stages it was linked to (an
        endpoint a ``Link`` named but that never confirmed is not among them)."""
        return frozenset(endpoint for endpoint, _tls in self._stubs)

    def _open_channel(self, endpoint: str, tls: bool) -> grpc.aio.Channel:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
        ]
        if tls:
            assert self.tls is not None  # checked by link()
            options += self.tls.channel_options()
            return grpc.aio.secure_channel(endpoint, self.tls.credentials(), options=options)
        return grpc.aio.insecure_channel(endpoint, options=options)

    def stub(self, link: _Link) -> shard_pb2_grpc.ChainStub:
        key = (link.endpoint, link.tls)
        stub = self._stubs.get(key)
        if stub is None:
            channel = self._open_channel(*key)
            self._channels.append(channel)
            stub = self._stubs[key] = shard_pb2_grpc.ChainStub(channel)
            self._shard_stubs[key] = shard_pb2_grpc.ShardStub(channel)
        return stub

    async def aclose(self) -> None:
        for _link, down in self._rings.values():
            down.cancel()
        self._rings.clear()
        for task in self.watchers:
            task.cancel()
        for output in self._outputs.values():
            output.queue.put_nowait(None)
        self._outputs.clear()
        self._links.clear()
        self._stubs.clear()
        self._shard_stubs.clear()
        channels, self._channels = self._channels, []
        for channel in channels:
            await channel.close()


def _failure_of(
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


class _Downstream:
    """This stage's stream to the next stage for one upstream stream: frames out; its end, if
    it is an error, resolves ``failed``."""

    def __init__(
        self,
        stub: shard_pb2_grpc.ChainStub,
        first: pb.ForwardRequest,
        link: _Link,
        hop: int,
        failed: asyncio.Future[ChainFailure],
        watchers: set[asyncio.Task[None]],
    ) -> None:
        self.link = link
        self.hop = hop
        self.failed = failed
        self.watchers = watchers
        self.call = stub.ChainStream(metadata=session_metadata(first))
        self.watcher = asyncio.get_running_loop().create_task(self._watch())
        watchers.add(self.watcher)
        self.watcher.add_done_callback(watchers.discard)

    def _fail(self, failure: ChainFailure) -> None:
        if not self.failed.done():
            self.failed.set_result(failure)

    async def _watch(self) -> None:
        try:
            while await self.call.read() is not grpc.aio.EOF:
                pass  # nothing is answered while all goes well
            code = await self.call.code()
            if code == grpc.StatusCode.OK:
                return
            details = await self.call.details() or ""
            trailers = await self.call.trailing_metadata()
            self._fail(_failure_of(code, details, trailers, self.hop, self.link.endpoint))
        except grpc.aio.AioRpcError as exc:
            self._fail(
                _failure_of(
                    exc.code(),
                    exc.details() or "",
                    exc.trailing_metadata(),
                    self.hop,
                    self.link.endpoint,
                )
            )
        except asyncio.InvalidStateError:
            pass

    async def send(self, request: pb.ForwardRequest) -> None:
        try:
            await self.call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            try:  # the stream is over: its status says why
                async with asyncio.timeout(_FAILURE_WAIT):
                    await asyncio.shield(self.failed)
            except TimeoutError:
                self._fail(
                    _failure_of(
                        grpc.StatusCode.UNAVAILABLE, repr(exc), None, self.hop, self.link.endpoint
                    )
                )

    async def finish(self) -> None:
        """The upstream stream ended: half-close this one (the next stage ends in turn)."""
        try:
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass

    def cancel(self) -> None:
        self.call.cancel()
        self.watcher.cancel()

    def finish_soon(self) -> None:
        """Half-closes in the background (a ring whose epoch was closed)."""
        task = asyncio.get_running_loop().create_task(self.finish())
        self.watchers.add(task)
        task.add_done_callback(self.watchers.discard)


def _next_frame(
    request: pb.ForwardRequest, reply: pb.ForwardReply, link: _Link, trace: pb.HopTrace
) -> pb.ForwardRequest:
    """The frame for the next stage: the same rows, positions and token ids, this stage's
    output as the boundary, the next stage's expectations and secret."""
    out = pb.ForwardRequest(
        session_id=request.session_id,
        epoch=request.epoch,
        step=request.step,
        expect=link.expect,
        expected_next_pos=request.expected_next_pos,
        positions=request.positions,
        token_ids=request.token_ids,
        boundary=reply.output,
        logit_rows=request.logit_rows,
        timeout_ms=request.timeout_ms,
        no_logits=request.no_logits,
        session_secret=link.secret,
        kind=request.kind,
        chain_hop=request.chain_hop + 1,
        ring_until_step=request.ring_until_step,
        ring_stop=request.ring_stop,
    )
    out.chain_trace.extend(request.chain_trace)
    out.chain_trace.append(trace)
    return out


def _ring_frame(
    request: pb.ForwardRequest, reply: pb.ForwardReply, link: _Link
) -> pb.ForwardRequest | None:
    """A ring's next frame after ``request``: the greedy token of its last logits row at the
    next position, for the next step; ``None`` when the ring stops there (no logits, the
    step limit, a stop token)."""
    n = len(request.positions)
    if request.ring_until_step <= request.step or request.no_logits or n == 0:
        return None
    if request.logit_rows and request.logit_rows[-1] != n - 1:
        return None
    rows = frames.output_from_reply(reply)
    if rows.shape[0] == 0:
        return None
    token = int(np.argmax(rows[-1]))  # dgr_session.sampling.greedy's choice
    if token in request.ring_stop:
        return None
    position = int(request.positions[-1]) + 1
    out = pb.ForwardRequest(
        session_id=request.session_id,
        epoch=request.epoch,
        step=request.step + 1,
        expect=link.expect,
        expected_next_pos=position,
        positions=[position],
        token_ids=[token],
        timeout_ms=request.timeout_ms,
        session_secret=link.secret,
        kind=pb.ROW_KIND_DECODE,
        chain_hop=0,
        ring_until_step=request.ring_until_step,
    )
    out.ring_stop.extend(request.ring_stop)
    return out


class ChainServicer(shard_pb2_grpc.ChainServicer):
    """The ``Chain`` service over one worker's :class:`ShardServicer`."""

    def __init__(self, shard: ShardServicer, hub: ChainHub) -> None:
        self.shard = shard
        self.w = shard.w
        self.hub = hub

    async def Link(
        self, request: pb.LinkRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LinkReply:
        await self.shard._refuse_undecodable(context, request, "link")
        try:
            frames.check_session_id(request.session_id)
            self.w.grants.check(request.session_id, int(request.epoch), request.session_secret)
            if self.w.info.is_last != request.ring:
                raise FrameRejected(
                    "DGR_E_FRAME: only the last stage links (back to the first) as a ring"
                    if request.ring
                    else "DGR_E_FRAME: the last stage links to no next stage but a ring's first"
                )
            self._check_open(request.session_id, int(request.epoch))
            if self.w.grants.enabled:  # only the next stage the route grant names
                self.w.grants.check_link(
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
            self.hub.link(request.session_id, int(request.epoch), request.next, ring=request.ring)
        except Exception as exc:
            await self.shard._refuse(context, exc, request, "link")
        self.w.log.bind(session=request.session_id, epoch=request.epoch).debug(
            "linked to {}", log_field(request.next.endpoint)
        )
        return pb.LinkReply(session_id=request.session_id, epoch=request.epoch)

    async def ChainOutput(
        self, request: pb.ChainOutputRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ChainOutputReply]:
        await self.shard._refuse_undecodable(context, request, "chain output")
        try:
            frames.check_session_id(request.session_id)
            self.w.grants.check(request.session_id, int(request.epoch), request.session_secret)
            if not self.w.info.is_last:
                raise FrameRejected("DGR_E_FRAME: only the last stage has an output stream")
            self._check_open(request.session_id, int(request.epoch))
            output = self.hub.open_output(request.session_id, int(request.epoch))
        except Exception as exc:
            await self.shard._refuse(context, exc, request, "chain output")
        try:
            yield pb.ChainOutputReply()  # registered: frames may flow
            while (item := await output.queue.get()) is not None:
                if isinstance(item, ChainFailure):  # the ring failed
                    self.w.log.bind(session=request.session_id, epoch=request.epoch).warning(
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
        loop = asyncio.get_running_loop()
        failed: asyncio.Future[ChainFailure] = loop.create_future()
        down: _Downstream | None = None
        last: pb.ForwardRequest | None = None
        incoming = aiter(requests)
        finished = False
        pending: asyncio.Future[pb.ForwardRequest] | None = None
        try:
            while True:
                pending = asyncio.ensure_future(anext(incoming))
                await asyncio.wait((pending, failed), return_when=asyncio.FIRST_COMPLETED)
                if failed.done():
                    pending.cancel()
                    await self._abort(context, failed.result(), last)
                try:
                    request = pending.result()
                except StopAsyncIteration:
                    break
                if isinstance(request, Undecodable):
                    await self._refuse(
                        context,
                        FrameRejected(f"DGR_E_FRAME: not a valid message: {request.what}"),
                        request,
                        -1,
                    )
                last = request
                down = await self._one(context, request, down, failed)
            if down is not None:
                await down.finish()
            finished = True
        except (asyncio.CancelledError, GeneratorExit):
            if last is not None and is_valid_session_id(last.session_id):
                self.w.abandon(last.session_id, int(last.epoch), "chain stream cancelled")
            raise
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
            if down is not None and not finished:
                down.cancel()  # this stage refused, or the chain failed: the epoch is over
        if False:  # pragma: no cover - makes this an async generator (answers nothing)
            yield pb.ChainAck()

    async def _one(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        request: pb.ForwardRequest,
        down: _Downstream | None,
        failed: asyncio.Future[ChainFailure],
    ) -> _Downstream | None:
        """Runs one chained frame and passes its output on; returns the downstream stream."""
        hop = int(request.chain_hop)
        sid, epoch = request.session_id, int(request.epoch)
        began = time.perf_counter_ns()
        try:
            if hop > MAX_CHAIN_HOP:
                raise FrameRejected(f"DGR_E_FRAME: chain_hop {hop} is over {MAX_CHAIN_HOP}")
            frames.check_session_id(sid)  # before it reaches the hub or a log line
            # where the output goes is checked before the rows touch the session's state
            ring = None
            if self.w.info.is_last:
                self.hub.check_output(sid, epoch)
                link = None
                ring = self.hub.ring_link(sid, epoch)
            else:
                link = self.hub.next_hop(sid, epoch)
            reply = await self.shard._forward(request, None)
        except Exception as exc:
            await self._refuse(context, exc, request, hop)
        t = reply.timings
        trace = pb.HopTrace(
            hop=hop,
            timings=pb.Timings(
                queue_us=t.queue_us,
                compute_us=t.compute_us,
                total_us=(time.perf_counter_ns() - began) // 1000,
            ),
            bytes_in=request.ByteSize(),
            bytes_out=reply.output.ByteSize(),
        )
        if link is None:
            out = pb.ChainOutputReply(reply=reply)
            out.hops.extend(request.chain_trace)
            out.hops.append(trace)
            try:
                self.hub.deliver(sid, epoch, out)
            except Exception as exc:
                await self._refuse(context, exc, request, hop)
            if ring is not None:
                frame = _ring_frame(request, reply, ring)
                if frame is not None:
                    await self.hub.ring_send(sid, ring, frame)
            return down
        if down is None or down.link != link:
            if down is not None:
                await down.finish()
            down = _Downstream(
                self.hub.stub(link), request, link, hop + 1, failed, self.hub.watchers
            )
        await down.send(_next_frame(request, reply, link, trace))
        return down

    def _check_open(self, session_id: str, epoch: int) -> None:
        """``UnknownSession`` / ``StaleEpoch`` unless ``(session_id, epoch)`` is open here."""
        table = self.w.table
        with table._lock:
            table._live(session_id, epoch)

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        exc: Exception,
        request: Any,
        hop: int,
    ) -> NoReturn:
        """Ends the stream with this stage's refusal of a frame, naming its hop."""
        code, status = grpc_status_for(exc)
        self.w.metrics.refusals.labels(status).inc()
        if is_worker_fault(exc):
            self.w.meter.error()  # the advert's health counts the worker's own faults only
        log = self.w.log.bind(
            session=log_field(getattr(request, "session_id", "-")),
            epoch=log_field(getattr(request, "epoch", "-")),
        )
        text = str(exc) if str(exc).startswith(status) else f"{status}: {exc}"
        if isinstance(exc, ShardError) or status != "DGR_E_INTERNAL":  # any typed refusal
            log.warning("chained frame refused: {} {}", code.name, log_field(text, limit=1000))
        else:
            log.opt(exception=exc).error("chained frame failed: {!r}", exc)
        trailers = refusal_trailers(exc, status) + ((CHAIN_HOP_KEY, str(max(hop, 0))),)
        await context.abort(code, text, trailing_metadata=trailers)
        raise AssertionError("unreachable: abort raises")

    async def _abort(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        failure: ChainFailure,
        last: pb.ForwardRequest | None,
    ) -> NoReturn:
        """Ends the stream with a failure downstream, passed up as it is."""
        log = self.w.log.bind(
            session=log_field(getattr(last, "session_id", "-")),
            epoch=log_field(getattr(last, "epoch", "-")),
        )
        details = log_field(failure.details, limit=1000)
        log.warning("chain failed downstream: {} {}", failure.code.name, details)
        await context.abort(failure.code, failure.details, trailing_metadata=failure.trailers)
        raise AssertionError("unreachable: abort raises")


def chain_tls_of(worker: Any) -> ClientTls | None:
    """The worker's credentials for dialling next stages (``WorkerConfig.chain_tls``)."""
    tls = getattr(worker.config, "chain_tls", None)
    return tls if isinstance(tls, ClientTls) else None


def add_chain_service(shard: ShardServicer, server: grpc.aio.Server) -> ChainServicer:
    """Registers the ``Chain`` service over ``shard`` (lenient parsing, like ``Shard``'s);
    returns its servicer (its ``hub`` is closed by :func:`close_chain`)."""
    servicer = ChainServicer(shard, ChainHub(chain_tls_of(shard.w), shard.w.table.holds))
    shard.chain = servicer.hub
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
    return servicer


__all__ = [
    "CHAIN_SERVICE_NAME",
    "ChainFailure",
    "ChainHub",
    "ChainServicer",
    "add_chain_service",
    "chain_tls_of",
]
