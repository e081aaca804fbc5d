"""Chained routes: a :class:`~dgr_session.transport.StageTransport` where each stage sends its
output straight to the next one and only the last stage's output comes back (``docs/chain.md``).

The route session is the relay's, untouched: it still asks for one forward per stage. The
transport sends the frame to the first stage only (``Chain.ChainStream``); the first stage's
forward waits for the chain's outcome, which comes back on the ``Chain.ChainOutput`` stream the
transport opened on the last stage (or, for a failure, on the first stage's stream, naming the
stage that refused or was lost). What the session relays between stages is a :class:`ChainTicket`
holding that outcome: every later stage's forward answers from it without a call, and the forward
of the stage that failed raises its typed error, so the session blames the right stage, ends the
epoch and re-prefills on a new route exactly as it does over the relay.

With ``ring=True`` the last stage also sends each next decode step's frame (its greedy token)
straight to the first stage; the transport finds that frame already sent when the session asks
for it, so a token costs one pass around the ring (greedy sessions only: a session whose token
differs from the ring's fails the epoch with a protocol error).

At the first forward of an epoch the transport links the route (``Chain.Link`` on every stage
but the last: the next stage's endpoint, expectations and session secret) and opens the output
stream; both are per ``(session, epoch)`` and torn down with the epoch's first close.

A failure of the client's own making (a session id that cannot be metadata, a call gRPC fails
in this process) is raised as the client's (``InvalidIdentifier``, ``ClientCallError``: fault
kind ``client``), never filed against a stage of the chain.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import grpc

from dgr_engine.client.native_target import NativeLinkTarget, native_route
from dgr_engine.client.relay import GrpcStageTransport, expectations_for
from dgr_engine.client.shard_client import client_call_error, mtp_drafts_of, session_metadata
from dgr_engine.errors import (
    FrameRejected,
    ShardDeadlineExceeded,
    ShardError,
    ShardRpcError,
    ShardUnavailable,
)
from dgr_engine.wire.frame_link import FrameLinkTarget, split_endpoint
from dgr_engine.wire.frames import (
    Frame,
    encode_frame,
    expectations_to_proto,
    greedy_answered,
    greedy_from_reply,
    output_from_reply,
)
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.status import CHAIN_HOP_KEY, STATUS_KEY, error_from_trailers
from dgr_session.commands import Forward
from dgr_session.errors import DgrError
from dgr_session.faults import FaultKind
from dgr_session.identifiers import check_session_id
from dgr_session.mtp_drafts import MtpDraftRequest
from dgr_session.route import StageSpec
from dgr_session.speculation import (
    MAX_DRAFTS,
    AnyLength,
    Speculation,
    kept_drafts,
    verify_rows,
)
from dgr_session.transport import (
    Boundary,
    Logits,
    SessionStart,
    StageResult,
    TransportCapabilities,
)
from dgr_session.usage import StageCost

DATA_PATHS = ("auto", "grpc", "frame-link", "native")
"""The data paths a :class:`ChainStageTransport` can be told to take (``docs/data-paths.md``)."""

_LIMITS_KEPT = 65536
"""Sessions whose ring limits a transport keeps (the oldest are forgotten first)."""

__all__ = [
    "DATA_PATHS",
    "ChainRecord",
    "ChainStageTransport",
    "ChainStats",
    "ChainTicket",
    "RingMismatch",
]


@attrs.define(eq=False)
class _RingDrafts:
    """A drafting ring's session's draft source: the drafts of the pass the ring's last stage
    already sent (none when it sent none: the session then sends the newest token alone)."""

    transport: ChainStageTransport
    session_id: str
    name = "ring"

    def propose(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        return self.transport.ring_drafts(self.session_id, len(history) - 1)[:k]

    def close(self) -> None:
        pass


class RingMismatch(ShardRpcError):
    """The session's token differs from the greedy token a ring already ran (a sampler that is
    not greedy): the stages' state is no longer the session's. Nothing is wrong with them, so it
    is filed as ``state_lost``: the epoch ends, the session re-prefills, nobody is blamed."""

    fault_kind = FaultKind.STATE_LOST


@attrs.define(eq=False)
class ChainTicket:
    """One chained frame's outcome, relayed by the route session from stage to stage in place of
    boundary rows: the last stage's reply and every stage's trace, or the stage that failed."""

    step: int
    """The frame's step."""
    rows: int
    """The frame's rows."""
    done: asyncio.Future[None] = attrs.field(repr=False)
    """Resolved once the outcome is known."""
    reply: pb.ChainOutputReply | None = attrs.field(default=None, repr=False)
    """The last stage's output and every stage's trace (success)."""
    failed_hop: int | None = None
    """The index of the stage that refused or was lost (failure)."""
    error: Exception | None = None
    """Its typed error (failure)."""

    def succeed(self, reply: pb.ChainOutputReply) -> None:
        if not self.done.done():
            self.reply = reply
            self.done.set_result(None)

    def fail(self, hop: int, error: Exception) -> None:
        if not self.done.done():
            self.failed_hop, self.error = hop, error
            self.done.set_result(None)


@attrs.frozen
class ChainRecord:
    """One chained frame that came back (handed to ``chain_observer``)."""

    session_id: str
    epoch: int
    step: int
    rows: int
    """Rows of the frame."""
    rtt_us: int
    """Client time from sending the frame to the first stage to its output's arrival."""
    handler_us: tuple[int, ...]
    """Each stage's handler time (checks, engine, the frame to the next stage built)."""
    compute_us: tuple[int, ...]
    """Each stage's engine time."""
    native_us: tuple[int, ...] = ()
    """Of each stage's engine time, the part inside llama.cpp (0 from a worker that does not
    say: ``Timings.native_us``)."""


@attrs.define
class ChainStats:
    """What chained frames cost, summed over the transport's lifetime (successful frames)."""

    frames: int = 0
    """Chained frames that came back."""
    sent: int = 0
    """Frames the client sent to the first stage (on a ring, the rest the last stage sent)."""
    rtt_us: int = 0
    """Client time from sending each frame to the first stage to its output's arrival."""
    handler_us: int = 0
    """Time the stages spent in their handlers (checks, engine, reply), summed over stages."""
    compute_us: int = 0
    """Engine time, summed over stages."""
    native_us: int = 0
    """Of the engine time, the part inside llama.cpp, summed over stages."""
    frame_link_epochs: int = 0
    """Epochs whose frames took the frame link (the rest took gRPC or native links)."""
    native_epochs: int = 0
    """Epochs whose frames took native links (``docs/native-link.md``)."""

    @property
    def transit_us(self) -> int:
        """The rest: every hop's gRPC transit (network included) and the client's own code."""
        return self.rtt_us - self.handler_us


class _AtStage(Exception):
    """A chain's setup failed at the stage of this index, with this error."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index, error)
        self.index, self.error = index, error


def _hop_of(trailers: Any, default: int) -> int:
    for key, value in trailers or ():
        if key == CHAIN_HOP_KEY:
            text = value if isinstance(value, str) else bytes(value).decode()
            return int(text) if text.isdigit() else default
    return default


def _error_of(exc: grpc.aio.AioRpcError) -> ShardError:
    return error_from_trailers(exc.code(), exc.trailing_metadata(), exc.details() or "")


class _Chain:
    """One (session, epoch) of a chained route: its stages, streams and frames in flight."""

    def __init__(self, transport: ChainStageTransport, session_id: str, epoch: int) -> None:
        self.t = transport
        self.session_id = session_id
        self.epoch = epoch
        self.stages: dict[int, StageSpec] = {}  # by layer_begin, filled by opens
        self.route: list[StageSpec] = []
        self.pending: collections.deque[ChainTicket] = collections.deque()
        self.frames_ahead: list[ChainTicket] = []
        """The frames sent ahead of a forward's last one (``Forward.frame_rows``)."""
        self.broken: tuple[int, Exception] | None = None
        self.input: Any = None
        self.output: Any = None
        self.tasks: list[asyncio.Task[None]] = []
        self._setup: asyncio.Task[None] | None = None
        # a ring: the tokens (and kept drafts) of the frame the last stage sent on by itself for
        # each step ahead, and outputs of such frames that came back before the session asked
        # for them; a drafting ring: the drafts of the pass it sent, by its first position
        self.predicted: dict[int, tuple[tuple[int, ...], int | None]] = {}
        self.early: dict[int, pb.ChainOutputReply] = {}
        self.ring_drafts: dict[int, tuple[int, ...]] = {}
        self.greedy = False
        """The session's first frame asked for greedy tokens (a native link carries only
        such rings)."""
        self.native = False
        """The epoch's frames take native links (``docs/native-link.md``)."""

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

    def metadata(self, step: int = 0) -> tuple[tuple[str, str], ...]:
        return session_metadata(
            pb.ForwardRequest(session_id=self.session_id, epoch=self.epoch, step=step)
        )

    async def ensure_linked(self) -> None:
        if self._setup is None:
            self._setup = asyncio.get_running_loop().create_task(self._link())
        await asyncio.shield(self._setup)

    async def _link(self) -> None:
        route = [self.stages[b] for b in sorted(self.stages)]
        n_layer = route[0].identity.n_layer if route else 0
        ends = [s.layer_begin for s in route[1:]] == [s.layer_end for s in route[:-1]]
        if not route or route[0].layer_begin != 0 or route[-1].layer_end != n_layer or not ends:
            got = [(s.layer_begin, s.layer_end) for s in route]
            self.fail(
                0,
                ShardRpcError(
                    f"opened stages {got} do not cover [0, {n_layer}) once", status="DGR_E_PROTOCOL"
                ),
            )
            return
        self.route = route
        sid, epoch, t = self.session_id, self.epoch, self.t
        secrets = [t.client(s.endpoint).session_secret(sid, epoch) for s in route]
        last = len(route) - 1
        targets: Sequence[Any] | None = None
        try:
            if t.data_path in ("native", "auto"):
                targets = await t.native_links(route, sid, greedy=self.greedy)
            self.native = targets is not None
            if targets is None:
                targets = await t.frame_links(route)
        except _AtStage as exc:
            self.fail(exc.index, exc.error)
            return
        use_link = targets is not None and not self.native

        async def link(k: int) -> None:
            nxt = route[k + 1]
            tls = False
            if t.tls is not None:
                tls = (await t.advert(nxt.endpoint)).security.tls
            hop = pb.ChainHop(
                endpoint=nxt.endpoint,
                expect=expectations_to_proto(expectations_for(nxt)),
                session_secret=secrets[k + 1],
                tls=tls,
                frame_link=use_link,
                native_link=self.native,
                native_hop=k + 1,
            )
            request = pb.LinkRequest(
                session_id=sid, epoch=epoch, session_secret=secrets[k], next=hop
            )
            await t.client(route[k].endpoint).chain.Link(
                request, timeout=t.timeout, metadata=self.metadata()
            )

        async def open_output() -> None:
            request = pb.ChainOutputRequest(
                session_id=sid, epoch=epoch, session_secret=secrets[last]
            )
            dialer = targets[last] if targets is not None else t.client(route[last].endpoint).chain
            self.output = dialer.ChainOutput(request, metadata=self.metadata())
            async with asyncio.timeout(t.timeout):
                ready = await self.output.read()
            if ready is grpc.aio.EOF:
                raise ShardRpcError("the output stream ended at once", status="DGR_E_PROTOCOL")

        async def ring() -> None:
            head = route[0]
            tls = False
            if t.tls is not None:
                tls = (await t.advert(head.endpoint)).security.tls
            hop = pb.ChainHop(
                endpoint=head.endpoint,
                expect=expectations_to_proto(expectations_for(head)),
                session_secret=secrets[0],
                tls=tls,
                frame_link=use_link,
                native_link=self.native,
                native_hop=0,
            )
            request = pb.LinkRequest(
                session_id=sid, epoch=epoch, session_secret=secrets[last], next=hop, ring=True
            )
            await t.client(route[last].endpoint).chain.Link(
                request, timeout=t.timeout, metadata=self.metadata()
            )

        steps = [(k, link(k)) for k in range(last)] + [(last, open_output())]
        if t.ring:
            steps.append((last, ring()))
        results = await asyncio.gather(*(c for _, c in steps), return_exceptions=True)
        for i, ((k, _), result) in enumerate(zip(steps, results, strict=True)):
            if isinstance(result, BaseException):
                error: Exception
                if isinstance(result, grpc.aio.AioRpcError):
                    error = _error_of(result)
                    said = dict(result.trailing_metadata() or ())
                    linking = k < last or (t.ring and i == len(steps) - 1)
                    if linking and said.get(STATUS_KEY) == "DGR_E_UNAVAILABLE":
                        k = (k + 1) % len(route)  # it could not reach the stage it links to
                elif isinstance(result, TimeoutError):
                    error = ShardDeadlineExceeded(f"no answer within {t.timeout} s")
                elif isinstance(result, DgrError):
                    error = result
                elif isinstance(result, Exception):  # gRPC failed the call here: not sent
                    error = client_call_error(result)
                else:
                    raise result
                self.fail(k, error)
                return
        try:
            dialer = targets[0] if targets is not None else t.client(route[0].endpoint).chain
            self.input = dialer.ChainStream(metadata=self.metadata())
        except DgrError as exc:
            self.fail(0, exc)
            return
        except Exception as exc:  # noqa: BLE001 - gRPC failed the call here: not sent
            self.fail(0, client_call_error(exc))
            return
        loop = asyncio.get_running_loop()
        self.tasks += [
            loop.create_task(self._read_outputs()),
            loop.create_task(self._watch_input()),
        ]

    async def _read_outputs(self) -> None:
        last = len(self.route) - 1
        try:
            while (message := await self.output.read()) is not grpc.aio.EOF:
                if not self.pending and self.t.ring and message.reply.epoch == self.epoch:
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
            code = await self.output.code()
            details = await self.output.details() or ""
            trailers = await self.output.trailing_metadata()
            if code == grpc.StatusCode.OK:
                self.fail(
                    last, ShardUnavailable(f"the last stage ended the output stream: {details}")
                )
            else:
                self.fail(_hop_of(trailers, last), error_from_trailers(code, trailers, details))
        except grpc.aio.AioRpcError as exc:
            self.fail(_hop_of(exc.trailing_metadata(), last), _error_of(exc))
        except asyncio.InvalidStateError:
            self.fail(last, ShardUnavailable("the output stream is over"))

    async def _watch_input(self) -> None:
        try:
            while await self.input.read() is not grpc.aio.EOF:
                pass  # nothing is answered while all goes well
            code = await self.input.code()
            if code != grpc.StatusCode.OK:
                trailers = await self.input.trailing_metadata()
                details = await self.input.details() or ""
                self.fail(_hop_of(trailers, 0), error_from_trailers(code, trailers, details))
            elif self.pending:
                self.fail(
                    0, ShardRpcError("the first stage ended the chain", status="DGR_E_PROTOCOL")
                )
        except grpc.aio.AioRpcError as exc:
            self.fail(_hop_of(exc.trailing_metadata(), 0), _error_of(exc))
        except asyncio.InvalidStateError:
            pass

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
        try:
            await self.input.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            # the stream is over: its status (read by _watch_input) says why and where
            try:
                async with asyncio.timeout(self.t.close_timeout):
                    await asyncio.shield(ticket.done)
            except TimeoutError:
                self.fail(0, ShardUnavailable(f"the chain's first stage is gone: {exc!r}"))
        except Exception as exc:  # noqa: BLE001 - gRPC failed the write here: not sent
            self.fail(0, client_call_error(exc))

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self._setup is not None:
            self._setup.cancel()
        if self.input is not None:
            try:
                await asyncio.wait_for(self.input.done_writing(), self.t.close_timeout)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
                pass
        if self.output is not None:
            self.output.cancel()
        self.fail(0, ShardRpcError("the epoch's chain was closed", status="DGR_E_PROTOCOL"))


class ChainStageTransport(GrpcStageTransport):
    """:class:`~dgr_engine.client.relay.GrpcStageTransport` for chained routes (the same
    options): the client sends each frame to the first stage only, each stage sends its output
    to the next, and the last stage's output comes back on a stream the transport opened on it.
    A forward whose boundary is not a :class:`ChainTicket` of an opened route (a caller relaying
    itself) goes over the relay as before.

    With ``tls``, a next stage that serves TLS is linked to as such: its previous stage must
    hold chain TLS credentials (``WorkerConfig.chain_tls``)."""

    def __init__(
        self,
        *,
        chain_observer: Callable[[ChainRecord], None] | None = None,
        ring: bool = False,
        data_path: str = "auto",
        prefill_frames: int = 4,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.ring = ring
        """Ring mode: the last stage sends each next decode step's frame to the first stage
        itself (its greedy token); sessions must sample greedily (``docs/chain.md``)."""
        self.capabilities = TransportCapabilities(
            prefill_frames=prefill_frames, runs_ahead=ring, drafts_on_route=True
        )
        """``prefill_frames``: pinned prompt chunks a session may send in one prefill forward:
        the transport sends them as frames back to back, so that stage k runs frame f + 1
        while stage k + 1 runs frame f, in the calls it runs one chunk a forward. A ring runs
        ahead of its sessions and drafts on its last stage."""
        # session -> (last step the ring may produce, stop tokens), from session_starting
        self._limits: collections.OrderedDict[str, tuple[int, tuple[int, ...]]] = (
            collections.OrderedDict()
        )
        self.chain_observer = chain_observer
        """Called with a :class:`ChainRecord` after each chained frame that came back; must
        not raise."""
        # (session, epoch) -> its chain; dropped at the epoch's first close
        self._chains: dict[tuple[str, int], _Chain] = {}
        self.chain_stats = ChainStats()
        """What chained frames cost (for benchmarks: where a token's time goes)."""
        if data_path not in DATA_PATHS:
            raise ValueError(f"data_path must be one of {DATA_PATHS}, got {data_path!r}")
        self.data_path = data_path
        """Which path chained frames take: ``auto`` (the fastest every stage of the route
        offers: native links for a ring's greedy session without drafts (over TLS: sealed
        links only, ``wire/link_seal.py``), else the frame
        link, else gRPC), ``grpc``, ``frame-link`` or ``native`` (required: a route or session
        it cannot carry fails at its first frame, naming the first stage that does not offer
        it)."""
        self._targets: dict[tuple[str, bool], FrameLinkTarget] = {}
        # session -> most drafts its ring may draft a pass (a drafting ring's sessions)
        self._ring_drafting: dict[str, int] = {}
        # drafting rings' sessions whose last stage drafts with its MTP block
        self._ring_mtp: set[str] = set()

    async def frame_links(self, route: Sequence[StageSpec]) -> list[FrameLinkTarget] | None:
        """Each stage's frame link, when the route's frames take it (``data_path``); ``None``:
        gRPC. A stage whose advert cannot be had, or that offers no frame link when one is
        required, raises :class:`_AtStage` with its index."""
        if self.data_path == "grpc":
            return None
        targets: list[FrameLinkTarget] = []
        for index, stage in enumerate(route):
            try:
                advert = await self.advert(stage.endpoint)
            except DgrError as exc:
                raise _AtStage(index, exc) from None
            port = advert.data_paths.frame_link_port
            if not port:
                if self.data_path == "auto":
                    return None
                error = ShardRpcError(
                    f"{stage.endpoint} offers no frame link (data_path='frame-link')",
                    status="DGR_E_PROTOCOL",
                )
                raise _AtStage(index, error)
            tls = self.tls is not None and advert.security.tls
            key = (stage.endpoint, tls)
            target = self._targets.get(key)
            if target is None or target.port != port:
                host, _ = split_endpoint(stage.endpoint)
                target = FrameLinkTarget(host, port, self.tls if tls else None)
                self._targets[key] = target
            targets.append(target)
        self.chain_stats.frame_link_epochs += 1
        return targets

    async def native_links(
        self, route: Sequence[StageSpec], session_id: str, *, greedy: bool
    ) -> list[NativeLinkTarget] | None:
        """Each stage's native link, for a ring's greedy session that drafts nothing, over a
        route whose every stage offers one (``docs/native-link.md``); ``None`` when the epoch
        takes another path (``auto``). With ``data_path="native"`` a session or route it
        cannot carry raises :class:`_AtStage` instead (the first stage that does not offer it,
        or the first stage for the session)."""
        required = self.data_path == "native"
        limits = self._limits.get(session_id)
        eligible = (
            self.ring
            and greedy
            and session_id not in self._ring_drafting  # drafts on the ring
            and session_id not in self._mtp  # MTP drafts
            and (limits is None or limits[0] >= 0)  # drafts of its own (every pass its own)
        )
        if not eligible:
            if not required:
                return None
            error = ShardRpcError(
                "a native link carries greedy rings without drafts or MTP only "
                "(data_path='native')",
                status="DGR_E_PROTOCOL",
            )
            raise _AtStage(0, error)
        hosts: list[tuple[str, int]] = []
        sealed: list[bool] = []
        for index, stage in enumerate(route):
            try:
                advert = await self.advert(stage.endpoint)
            except DgrError as exc:
                raise _AtStage(index, exc) from None
            port = advert.data_paths.native_link_port
            if port and self.tls is not None and not advert.data_paths.native_link_sealed:
                port = 0  # over TLS, only sealed links: never the frames in the clear
            if not port:
                if not required:
                    return None
                error = ShardRpcError(
                    f"{stage.endpoint} offers no native link (data_path='native')",
                    status="DGR_E_PROTOCOL",
                )
                raise _AtStage(index, error)
            host, _ = split_endpoint(stage.endpoint)
            hosts.append((host, port))
            sealed.append(advert.data_paths.native_link_sealed)
        self.chain_stats.native_epochs += 1
        widths = [(s.boundary_in, s.boundary_out) for s in route]
        return native_route(hosts, widths, ring=True, sealed=sealed)

    def session_starting(self, start: SessionStart) -> Speculation | None:
        """Called by the ``SessionManager`` as a session starts. A ring runs on its own within
        the session's limits (without them, its frames ask for no ring); prompt lookup drafts
        are made by its last stage itself (its own ``NgramDrafter`` and ``DraftLength`` over
        the session's tokens), so a pass never waits for the client, and the session
        speculates with the drafts of the pass the ring sent. Any other draft source is the
        client's, and the ring runs nothing on its own for the session. Off a ring: the relay's
        (a last stage's MTP drafts)."""
        if not self.ring:
            return super().session_starting(start)
        sid, speculation = start.session_id, start.speculation
        self._limits[sid] = (start.max_new_tokens - 1, start.stop_tokens)
        while len(self._limits) > _LIMITS_KEPT:
            self._limits.popitem(last=False)
        if speculation is None:
            return None
        mtp = isinstance(speculation.drafter, MtpDraftRequest)
        if getattr(speculation.drafter, "name", "") != "ngram" and not mtp:
            self._limits[sid] = (-1, start.stop_tokens)  # every frame is the session's own
            return speculation
        k_max = min(speculation.max_drafts, getattr(speculation.length, "k_max", MAX_DRAFTS))
        if isinstance(speculation.drafter, MtpDraftRequest):  # the last stage drafts with MTP
            k_max = min(k_max, speculation.drafter.k_max)
            self._ring_mtp.add(sid)
        self._ring_drafting[sid] = k_max
        while len(self._ring_drafting) > _LIMITS_KEPT:
            self._ring_mtp.discard(next(iter(self._ring_drafting)))
            self._ring_drafting.pop(next(iter(self._ring_drafting)))
        # the tally stays the caller's: the counts are the session's, wherever drafts come from
        return attrs.evolve(
            speculation, drafter=_RingDrafts(self, sid), length=AnyLength(), max_drafts=k_max
        )

    def ring_drafts(self, session_id: str, position: int) -> tuple[int, ...]:
        """The drafts of the pass the ring sent for ``session_id`` at ``position`` (its newest
        epoch), if it sent one."""
        epochs = [e for (sid, e) in self._chains if sid == session_id]
        if not epochs:
            return ()
        return self._chains[(session_id, max(epochs))].ring_drafts.pop(position, ())

    async def aclose(self) -> None:
        chains, self._chains = self._chains, {}
        for chain in chains.values():
            await chain.aclose()
        await super().aclose()

    async def open(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        await super().open(stage, session_id, epoch)
        chain = self._chains.get((session_id, epoch))
        if chain is None:
            chain = self._chains[(session_id, epoch)] = _Chain(self, session_id, epoch)
        chain.stages[stage.layer_begin] = stage

    async def close(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        chain = self._chains.pop((session_id, epoch), None)
        if chain is not None:
            await chain.aclose()
        await super().close(stage, session_id, epoch)

    async def forward(self, call: Forward) -> StageResult:
        stage, session_id, epoch, step = call.stage, call.session_id, call.epoch, call.step
        positions, token_ids, boundary = call.positions, call.token_ids, call.boundary
        check_session_id(session_id)
        chain = self._chains.get((session_id, epoch))
        if isinstance(boundary, ChainTicket) and chain is not None:
            return self._answer(chain, stage, boundary)
        if chain is None or boundary is not None or stage.layer_begin != 0:
            return await super().forward(call)
        loop = asyncio.get_running_loop()
        ticket = ChainTicket(step, len(positions), loop.create_future())
        if not chain.greedy and chain.route == []:
            chain.greedy = call.greedy  # the epoch's first frame says how it samples
        await chain.ensure_linked()
        began = loop.time()  # the frame's round trip: the epoch's links are not its
        limits = self._limits.get(session_id) if self.ring else None
        until, stops = limits if limits is not None else (0, ())
        draft_max = self._ring_drafting.get(session_id, 0) if until > step else 0
        predicted = chain.predicted.pop(step, None)
        if chain.broken is not None:
            ticket.fail(*chain.broken)
        elif predicted is not None:
            if predicted == (tuple(token_ids), call.kept_drafts):
                chain.expect(ticket)  # the ring sent this frame already
            else:
                error = RingMismatch(
                    f"the ring ran step {step} with tokens {list(predicted[0])} (kept drafts "
                    f"{predicted[1]}), the session asked for {list(token_ids)} (kept drafts "
                    f"{call.kept_drafts}): a ring needs greedy sampling",
                    status="DGR_E_RING_MISMATCH",
                )
                chain.fail(0, error)
                ticket.fail(0, error)
        else:
            mtp_max = 0  # a chain (not a drafting ring) asks its last stage for MTP drafts
            if not draft_max and chain.route:
                last = await self.advert(chain.route[-1].endpoint)
                mtp_max = self.mtp_draft_max(session_id, last, call)
            frame = Frame.of_call(
                call,
                expectations_for(stage),
                session_secret=self.client(stage.endpoint).session_secret(session_id, epoch),
                timeout=self.timeout,
                mtp_draft_max=mtp_max,
            )
            ahead = await self._frames_ahead(chain, call, frame)
            request = encode_frame(frame.part(ahead))
            if until > step:
                request.ring_until_step = until
                request.ring_stop.extend(stops)
                if draft_max:  # rows the route's every stage takes, the newest token's too,
                    rows = [s.max_rows for s in chain.route if s.max_rows > 0]
                    rows += [  # and that keep the bits plain decoding gives on each stage
                        verify_rows(s.recipe.quant_types, s.lane.hardware) for s in chain.route
                    ]
                    request.ring_draft_max = max(min([draft_max + 1, *rows]) - 1, 0)
                    if session_id in self._ring_mtp:
                        request.mtp_draft_max = request.ring_draft_max
            self.chain_stats.sent += 1
            await chain.submit(ticket, request)
        if not ticket.done.done():
            try:
                async with asyncio.timeout(self.timeout):
                    await asyncio.shield(ticket.done)
            except TimeoutError:
                chain.fail(0, ShardDeadlineExceeded(f"no chained output within {self.timeout} s"))
        chain.fold_frames(ticket)
        if ticket.reply is not None and until > step and call.wants_logits:
            self._predict(chain, call, ticket.reply, stops, draft_max > 0)
        if ticket.reply is not None:
            self.mtp_offer(session_id, mtp_drafts_of(ticket.reply.reply))
        if ticket.reply is not None:
            s = self.chain_stats
            rtt_us = round((loop.time() - began) * 1e6)
            s.frames += 1
            s.rtt_us += rtt_us
            for hop in ticket.reply.hops:
                s.handler_us += hop.timings.total_us
                s.compute_us += hop.timings.compute_us
                s.native_us += hop.timings.native_us
            if self.chain_observer is not None:
                hops = ticket.reply.hops
                self.chain_observer(
                    ChainRecord(
                        session_id,
                        epoch,
                        step,
                        len(call.positions),
                        rtt_us,
                        tuple(int(h.timings.total_us) for h in hops),
                        tuple(int(h.timings.compute_us) for h in hops),
                        tuple(int(h.timings.native_us) for h in hops),
                    )
                )
        return self._answer(chain, stage, ticket)

    async def _frames_ahead(self, chain: _Chain, call: Forward, frame: Frame) -> int:
        """A forward of several pinned prefill chunks (``Forward.frame_rows``): sends every
        frame but the last, back to back, without waiting for their outputs, so that the
        route's stages work on them at once; their outcomes fold into the last frame's ticket
        (:meth:`_Chain.fold_frames`). ``frame`` is the call's whole frame. Returns the rows
        sent (the last frame's start)."""
        rows, n = call.frame_rows, len(call.positions)
        if rows <= 0 or n <= rows:
            return 0
        loop = asyncio.get_running_loop()
        sent = 0
        while n - sent > rows:
            request = encode_frame(frame.part(sent, sent + rows))
            ticket = ChainTicket(call.step, rows, loop.create_future())
            chain.frames_ahead.append(ticket)
            self.chain_stats.sent += 1
            await chain.submit(ticket, request)
            sent += rows
        return sent

    @staticmethod
    def _predict(
        chain: _Chain,
        call: Forward,
        reply: pb.ChainOutputReply,
        stops: tuple[int, ...],
        drafting: bool,
    ) -> None:
        """What the ring sent on by itself after ``call``'s frame: the next step's tokens, and
        on a drafting ring the pass's kept drafts (the greedy tokens of its rows, as the ring's
        last stage took them) and the next pass's drafts."""
        try:  # the greedy tokens it answered, or those of its logits
            answered = greedy_answered(reply.reply)
        except FrameRejected:
            return  # malformed: the session's answer (_answer) says so
        if not answered:
            return
        start = call.positions.start
        if not call.drafts:
            greedy, kept = [answered[-1]], None
            position = call.positions.stop
        else:
            if len(answered) != len(call.positions):
                return
            greedy = list(answered)
            kept = kept_drafts(greedy, call.token_ids[1:])
            greedy, position = greedy[: kept + 1], start + 1 + kept
        if any(token in stops for token in greedy):
            return
        step = call.step + len(greedy)
        sent = tuple(int(t) for t in reply.ring_next)
        if drafting:  # the frame it sent (none when it sent none), drafts and all
            if sent and sent[0] == greedy[-1]:
                chain.predicted[step] = (sent, kept)
                chain.ring_drafts[position] = sent[1:]
        elif not call.drafts:
            chain.predicted[step] = ((greedy[-1],), None)

    def _answer(self, chain: _Chain, stage: StageSpec, ticket: ChainTicket) -> StageResult:
        """Stage ``stage``'s part of the ticket's outcome: its output, or its error."""
        index = chain.index(stage) if chain.route else 0
        sid, epoch = chain.session_id, chain.epoch
        if ticket.error is not None and ticket.failed_hop is not None:
            if ticket.failed_hop <= index:
                self._raise(stage, sid, epoch, f"chained forward step {ticket.step}", ticket.error)
            return Boundary(ticket)  # a later stage failed: it raises
        if ticket.reply is None:
            raise ShardRpcError("a chained forward with no outcome", status="DGR_E_PROTOCOL")
        trace = next((h for h in ticket.reply.hops if h.hop == index), None)
        cost = None
        if trace is not None:
            cost = StageCost(
                int(trace.bytes_in), int(trace.bytes_out), trace.timings.compute_us / 1e6
            )
            c = self._counter(stage)
            c.forwards += 1
            c.rows += ticket.rows
            c.bytes_sent += int(trace.bytes_in)
            c.bytes_received += int(trace.bytes_out)
            c.compute_us += int(trace.timings.compute_us)
            c.queue_us += int(trace.timings.queue_us)
        if index < len(chain.route) - 1:
            return Boundary(ticket, cost)
        try:
            greedy = greedy_from_reply(ticket.reply.reply)
            if greedy is not None:
                return Logits.greedy_tokens(greedy, cost)
            logits = output_from_reply(ticket.reply.reply)
        except FrameRejected as exc:
            error = FrameRejected(f"DGR_E_FRAME: malformed chained output: {exc}")
            self._raise(stage, sid, epoch, f"chained forward step {ticket.step}", error)
        return Logits.last_row(logits, cost)
