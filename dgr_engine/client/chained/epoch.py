"""One ``(session, epoch)`` of a chained route: its stages, the frames in flight and their
tickets, and the two streams its frames and outcomes take, through whichever data path the
epoch took (``client/channel.py``: the streams end with a typed stage failure, whatever carried
them). It knows nothing of the transport that links its route (``transport.py``)."""

from __future__ import annotations

import asyncio
import collections

from dgr_engine.client.chained.tickets import ChainTicket
from dgr_engine.client.channel import ChannelOver, FrameSink, OutcomeSource, StageFailure
from dgr_engine.errors import ShardRpcError, ShardUnavailable
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_session.errors import DgrError
from dgr_session.route import StageSpec

__all__ = ["ChainEpoch"]


class ChainEpoch:
    """One (session, epoch) of a chained route: its stages, streams and frames in flight.
    ``ring``: the last stage sends the next step's frame itself (its outcomes may come before
    the session asks for them); ``close_timeout``: how long a frame that could not be sent
    waits for the stream's end to say why."""

    def __init__(self, session_id: str, epoch: int, *, ring: bool, close_timeout: float) -> None:
        self.session_id = session_id
        self.epoch = epoch
        self.ring = ring
        self.close_timeout = close_timeout
        self.stages: dict[int, StageSpec] = {}  # by layer_begin, filled by opens
        self.route: list[StageSpec] = []
        self.pending: collections.deque[ChainTicket] = collections.deque()
        self.frames_ahead: list[ChainTicket] = []
        """The frames sent ahead of a forward's last one (``Forward.frame_rows``)."""
        self.broken: tuple[int, Exception] | None = None
        self.input: FrameSink | None = None
        self.output: OutcomeSource | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.setup: asyncio.Task[None] | None = None
        """The route's linking (the transport's), once started."""
        # a ring: the tokens (and kept drafts) of the frame the last stage sent on by itself for
        # each step ahead, and outputs of such frames that came back before the session asked
        # for them; a drafting ring: the drafts of the pass it sent, by its first position
        self.predicted: dict[int, tuple[tuple[int, ...], int | None]] = {}
        self.early: dict[int, pb.ChainOutputReply] = {}
        self.ring_drafts: dict[int, tuple[int, ...]] = {}
        self.sampled = False
        """The session's first frame asked for the last stage's tokens (a native link carries
        only such rings: its last stage takes them)."""
        self.native = False
        """The epoch's frames take native links (``docs/native-path.md``)."""
        self.frame_link = False
        """The epoch's frames take frame links."""

    def index(self, stage: StageSpec) -> int:
        for i, s in enumerate(self.route):
            if s.layer_begin == stage.layer_begin:
                return i
        raise ShardRpcError(
            f"{stage.endpoint} is not a stage of this chain", status="DGR_E_PROTOCOL"
        )

    def fail(self, hop: int, error: Exception) -> None:
        if self.broken is None:
            self.broken = (hop, error)
        while self.pending:
            self.pending.popleft().fail(*self.broken)

    def start(self, frames: FrameSink, outcomes: OutcomeSource) -> None:
        """The route is linked: its frames go to ``frames``, its outcomes come from
        ``outcomes`` (already registered), each watched from now on."""
        self.input, self.output = frames, outcomes
        loop = asyncio.get_running_loop()
        self.tasks += [
            loop.create_task(self._read_outputs(outcomes)),
            loop.create_task(self._watch_input(frames)),
        ]

    async def _read_outputs(self, output: OutcomeSource) -> None:
        last = len(self.route) - 1
        try:
            while (message := await output.next()) is not None:
                if not self.pending and self.ring and message.reply.epoch == self.epoch:
                    self.early[int(message.reply.step)] = message  # the ring ran ahead
                    continue
                if not self.pending:
                    self.fail(
                        last, ShardRpcError("an output nobody asked for", status="DGR_E_PROTOCOL")
                    )
                    return
                ticket = self.pending.popleft()
                if message.reply.step != ticket.step or message.reply.epoch != self.epoch:
                    got = (message.reply.epoch, message.reply.step)
                    ticket.fail(
                        last,
                        ShardRpcError(
                            f"output for (epoch, step) {got}, expected {(self.epoch, ticket.step)}",
                            status="DGR_E_PROTOCOL",
                        ),
                    )
                    assert ticket.error is not None
                    self.fail(last, ticket.error)
                    return
                ticket.succeed(message)
            self.fail(last, ShardUnavailable("the last stage ended the output stream"))
        except StageFailure as failure:
            self.fail(failure.hop, failure.error)

    async def _watch_input(self, frames: FrameSink) -> None:
        try:
            await frames.end()
        except StageFailure as failure:
            self.fail(failure.hop, failure.error)
            return
        if self.pending:
            self.fail(0, ShardRpcError("the first stage ended the chain", status="DGR_E_PROTOCOL"))

    def fold_frames(self, ticket: ChainTicket) -> None:
        """The frames sent ahead of ``ticket``'s (one forward's pinned chunks) end with it: a
        failure of theirs is the forward's (the oldest first, as the chain ran them), and on
        success each stage's cost of them joins its cost of the last frame (its trace), so the
        forward's answer counts all its rows."""
        ahead, self.frames_ahead = self.frames_ahead, []
        failed = next((f for f in ahead if f.error is not None), None)
        if failed is not None and failed.failed_hop is not None and failed.error is not None:
            ticket.failed_hop, ticket.error, ticket.reply = failed.failed_hop, failed.error, None
            return
        if ticket.reply is None:
            return
        for frame in ahead:
            if frame.reply is None:
                continue
            for hop in frame.reply.hops:
                mine = next((h for h in ticket.reply.hops if h.hop == hop.hop), None)
                if mine is None:
                    continue
                mine.bytes_in += hop.bytes_in
                mine.bytes_out += hop.bytes_out
                for name in ("compute_us", "native_us", "total_us", "queue_us"):
                    setattr(
                        mine.timings, name, getattr(mine.timings, name) + getattr(hop.timings, name)
                    )

    def expect(self, ticket: ChainTicket) -> None:
        """A frame the ring already sent: its outcome lands on ``ticket``."""
        early = self.early.pop(ticket.step, None)
        if early is not None:
            ticket.succeed(early)
        elif self.broken is not None:
            ticket.fail(*self.broken)
        else:
            self.pending.append(ticket)

    async def submit(self, ticket: ChainTicket, request: pb.ForwardRequest) -> None:
        """Sends one frame into the chain; its outcome lands on ``ticket``."""
        self.pending.append(ticket)
        if self.broken is not None:
            self.fail(*self.broken)
            return
        assert self.input is not None
        try:
            await self.input.send(request)
        except ChannelOver as exc:
            # the stream is over: its end (read by _watch_input) says why and where
            try:
                async with asyncio.timeout(self.close_timeout):
                    await asyncio.shield(ticket.done)
            except TimeoutError:
                self.fail(0, ShardUnavailable(f"the chain's first stage is gone: {exc}"))
        except DgrError as exc:  # failed in this client: not sent
            self.fail(0, exc)

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.setup is not None:
            self.setup.cancel()
        if self.input is not None:
            try:
                await asyncio.wait_for(self.input.finish(), self.close_timeout)
            except TimeoutError:
                pass
        if self.output is not None:
            self.output.cancel()
        self.fail(0, ShardRpcError("the epoch's chain was closed", status="DGR_E_PROTOCOL"))
