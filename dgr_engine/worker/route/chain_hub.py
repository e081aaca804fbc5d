"""Where each session's output goes from this stage of a chained route (``docs/chain.md``):
its link to the next stage, or, on the last stage, its output stream (and, on a ring, its
stream back to the first stage); and the channels to next stages, one per endpoint, reused by
every session.

The hub forgets a session's link, output stream and ring stream when the session table says
it closed that epoch (the hub is one of its close listeners, ``worker/lifecycle/closes.py``):
a ring's stream is half-closed, and an output stream ends if its client closed the epoch (see
:meth:`ChainHub.session_closed`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
import grpc

from dgr_engine.errors import FrameRejected, GrantDenied, ShardUnavailable
from dgr_engine.security.tls import ClientTls
from dgr_engine.wire.frame_link import FrameLinkTarget, split_endpoint
from dgr_engine.wire.keepalive import GRPC_CHANNEL_OPTIONS
from dgr_engine.wire.metadata import DEFAULT_MAX_MESSAGE_BYTES
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.wire.status import STATUS_KEY
from dgr_engine.worker.lifecycle.closes import CloseCause, SessionClosed
from dgr_engine.worker.route.chain_downstream import (
    ChainDialer,
    ChainFailure,
    ChainLink,
    Downstream,
)
from dgr_engine.worker.route.ring_drafts import RingDrafting
from dgr_session.drafts import PassTimes

PASS_TIMES_KEPT = 64
"""Rings whose pass times a last stage keeps for their next drafting session (the most recent)."""


@attrs.define(eq=False)
class OutputStream:
    """A last stage's ``ChainOutput`` stream of one session epoch: replies, a failure of its
    ring, or ``None`` (the stream ends)."""

    epoch: int
    queue: asyncio.Queue[pb.ChainOutputReply | ChainFailure | None]


class ChainHub:
    """Per worker: where each session's output goes (links, output streams) and the channels
    to next stages (one per endpoint, reused by every session). ``tls``: how this worker dials
    a next stage that serves TLS (its CA and client certificate); ``None``: it cannot."""

    def __init__(self, tls: ClientTls | None) -> None:
        self.tls = tls
        self._links: dict[str, ChainLink] = {}
        self._outputs: dict[str, OutputStream] = {}
        # a ring's stream from this (last) stage to the first, per session (with its link)
        self._rings: dict[str, tuple[ChainLink, Downstream]] = {}
        # a drafting ring's last stage: each session's tokens and drafts (ring_drafts.py)
        self._drafting: dict[str, RingDrafting] = {}
        # what a pass around each ring cost its last drafting session, by the ring's first stage
        self._pass_times: dict[str, PassTimes] = {}
        self._stubs: dict[tuple[str, bool], shard_pb2_grpc.ChainStub] = {}
        # the Shard service over the same channels (confirm_next asks a next stage's Usage)
        self._shard_stubs: dict[tuple[str, bool], shard_pb2_grpc.ShardStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._data_paths_of: dict[tuple[str, bool], pb.DataPaths] = {}
        self._targets: dict[tuple[str, int, bool], FrameLinkTarget] = {}
        # downstream streams' watchers still running (kept referenced; cancelled at close)
        self.watchers: set[asyncio.Task[None]] = set()

    def link(
        self,
        session_id: str,
        epoch: int,
        hop: pb.ChainHop,
        *,
        ring: bool = False,
        frame_link_port: int = 0,
    ) -> None:
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
        self._links[session_id] = ChainLink(
            epoch,
            hop.endpoint,
            expect,
            bytes(hop.session_secret),
            bool(hop.tls),
            ring,
            frame_link_port,
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

    async def frame_link_port(self, hop: pb.ChainHop, timeout: float) -> int:
        """The next stage's frame link port, read from its own advert (``Describe``, once per
        endpoint): a link names the data path, never a port, so a linker cannot make this stage
        dial a port of its choosing. ``FrameRejected`` when the next stage offers none,
        ``ShardUnavailable`` when it does not answer."""
        if hop.tls and self.tls is None:
            return 0  # link() refuses it
        port = int((await self._data_paths(hop, timeout)).frame_link_port)
        if port == 0:
            raise FrameRejected(
                f"DGR_E_FRAME: the next stage {hop.endpoint!r} offers no frame link: link it "
                "over gRPC"
            )
        return port

    async def native_link(self, hop: pb.ChainHop, timeout: float) -> tuple[int, bool]:
        """The next stage's native link port and whether it is sealed, read from its own
        advert as the frame link's port (:meth:`frame_link_port`); ``FrameRejected`` when it
        offers none."""
        paths = await self._data_paths(hop, timeout)
        port = int(paths.native_link_port)
        if port == 0:
            raise FrameRejected(
                f"DGR_E_FRAME: the next stage {hop.endpoint!r} offers no native link: link it "
                "over the frame link or gRPC"
            )
        return port, bool(paths.native_link_sealed)

    async def _data_paths(self, hop: pb.ChainHop, timeout: float) -> pb.DataPaths:
        """The next stage's data paths, from its advert (``Describe``, once per endpoint);
        ``ShardUnavailable`` when it does not answer."""
        key = (hop.endpoint, bool(hop.tls))
        paths = self._data_paths_of.get(key)
        if paths is None:
            self._ensure_channel(*key)
            try:
                advert = await self._shard_stubs[key].Describe(
                    pb.DescribeRequest(), timeout=timeout
                )
            except grpc.aio.AioRpcError as exc:
                raise ShardUnavailable(
                    f"DGR_E_UNAVAILABLE: the next stage {hop.endpoint!r} did not describe itself "
                    f"({exc.code().name}): not linked"
                ) from None
            paths = self._data_paths_of[key] = advert.data_paths
        return paths

    def next_hop(self, session_id: str, epoch: int) -> ChainLink:
        link = self._links.get(session_id)
        if link is None or link.epoch != epoch:
            raise FrameRejected(
                f"DGR_E_FRAME: session {session_id!r} epoch {epoch} is not linked to a next "
                "stage (Chain.Link)"
            )
        return link

    def ring_drafting(
        self, session_id: str, epoch: int, request: pb.ForwardRequest
    ) -> RingDrafting | None:
        """On a ring's last stage, after it ran ``request``: the session's drafting (made at
        its epoch's first frame asking for it, ``ring_draft_max``), told of the frame's
        tokens; ``None`` when the ring does not draft, or the stage missed tokens before."""
        held = self._drafting.get(session_id)
        if not request.ring_draft_max:
            return None
        if held is None or held.epoch != epoch:
            if held is not None and held.epoch > epoch:
                return None
            link = self._links.get(session_id)
            warm = self._pass_times.get(link.endpoint) if link is not None else None
            held = RingDrafting(epoch, int(request.ring_draft_max), warm=warm)
            self._drafting[session_id] = held
        if not held.ran(int(request.expected_next_pos), request.token_ids):
            return None
        return held

    def ring_link(self, session_id: str, epoch: int) -> ChainLink | None:
        """The last stage's ring link of ``(session_id, epoch)``, if the route is a ring."""
        link = self._links.get(session_id)
        return link if link is not None and link.ring and link.epoch == epoch else None

    async def ring_send(
        self, session_id: str, link: ChainLink, frame: pb.ForwardRequest, *, sender: int
    ) -> None:
        """Sends a ring's next frame to the first stage, over the session's ring stream (opened
        as from ``sender``, this last stage's index); a failure of that stream ends the
        session's output stream with it."""
        held = self._rings.get(session_id)
        if held is None or held[0] is not link:
            if held is not None:
                held[1].cancel()
            failed: asyncio.Future[ChainFailure] = asyncio.get_running_loop().create_future()
            down = Downstream(self.stub(link), frame, link, 0, failed, self.watchers, sender=sender)
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

    def open_output(self, session_id: str, epoch: int) -> OutputStream:
        held = self._outputs.get(session_id)
        if held is not None and held.epoch >= epoch:
            raise FrameRejected(
                f"DGR_E_FRAME: session {session_id!r} already has an output stream at epoch "
                f"{held.epoch}"
            )
        if held is not None:
            held.queue.put_nowait(None)  # the older epoch's stream ends
        output = OutputStream(epoch, asyncio.Queue())
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

    def drop_output(self, session_id: str, output: OutputStream) -> None:
        if self._outputs.get(session_id) is output:
            del self._outputs[session_id]

    def session_closed(self, closed: SessionClosed) -> None:
        """The session table closed an epoch (or an older one held): forget its link and
        half-close its ring stream; forget its output stream, and end it only when its client
        closed the epoch. An end the worker chose (a lease, a stall, an abandoned call) would
        read to the client as the last stage lost, while the chain's own failure, or the
        table's refusal of the epoch's next frame, says what happened and where; the client
        ends that stream itself when it closes the epoch. A newer epoch's open changes nothing
        here: its ``Link`` and ``ChainOutput`` replace the older epoch's."""
        if closed.still_held:
            return
        session_id, epoch = closed.session_id, closed.epoch
        link = self._links.get(session_id)
        if link is not None and link.epoch <= epoch:
            del self._links[session_id]
        output = self._outputs.get(session_id)
        if output is not None and output.epoch <= epoch:
            del self._outputs[session_id]
            if closed.cause is CloseCause.CLIENT:
                output.queue.put_nowait(None)
        ring = self._rings.get(session_id)
        if ring is not None and ring[0].epoch <= epoch:
            self._rings.pop(session_id)[1].finish_soon()
        drafting = self._drafting.get(session_id)
        if drafting is not None and drafting.epoch <= epoch:
            del self._drafting[session_id]
            self._keep_pass_times(link if link is not None and link.ring else None, drafting)

    def _keep_pass_times(self, link: ChainLink | None, drafting: RingDrafting) -> None:
        """Keeps what ``drafting``'s passes around the ring of ``link`` cost, for the next
        session over it (the most recent :data:`PASS_TIMES_KEPT` rings)."""
        times = drafting.length.times
        if link is None or times is None:
            return
        self._pass_times.pop(link.endpoint, None)
        self._pass_times[link.endpoint] = times
        while len(self._pass_times) > PASS_TIMES_KEPT:
            del self._pass_times[next(iter(self._pass_times))]

    def dialled(self) -> frozenset[str]:
        """The endpoints this stage keeps a channel to: next stages it was linked to (an
        endpoint a ``Link`` named but that never confirmed is not among them)."""
        return frozenset(endpoint for endpoint, _tls in self._stubs)

    def _open_channel(self, endpoint: str, tls: bool) -> grpc.aio.Channel:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            *GRPC_CHANNEL_OPTIONS,  # a silent next stage is found out (wire/keepalive.py)
        ]
        if tls:
            assert self.tls is not None  # checked by link()
            options += self.tls.channel_options()
            return grpc.aio.secure_channel(endpoint, self.tls.credentials(), options=options)
        return grpc.aio.insecure_channel(endpoint, options=options)

    def _ensure_channel(self, endpoint: str, tls: bool) -> shard_pb2_grpc.ChainStub:
        key = (endpoint, tls)
        stub = self._stubs.get(key)
        if stub is None:
            channel = self._open_channel(*key)
            self._channels.append(channel)
            stub = self._stubs[key] = shard_pb2_grpc.ChainStub(channel)
            self._shard_stubs[key] = shard_pb2_grpc.ShardStub(channel)
        return stub

    def stub(self, link: ChainLink) -> ChainDialer:
        """Where a link's frames go: the next stage's frame link, or its gRPC channel."""
        stub = self._ensure_channel(link.endpoint, link.tls)
        if not link.frame_link_port:
            return stub
        key = (link.endpoint, link.frame_link_port, link.tls)
        target = self._targets.get(key)
        if target is None:
            host, _ = split_endpoint(link.endpoint)
            tls = self.tls if link.tls else None
            target = self._targets[key] = FrameLinkTarget(host, link.frame_link_port, tls)
        return target

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
        self._targets.clear()
        self._data_paths_of.clear()
        channels, self._channels = self._channels, []
        for channel in channels:
            await channel.close()


__all__ = ["ChainHub", "OutputStream"]
