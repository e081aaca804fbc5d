"""The chained route's transport: a :class:`~dgr_session.transport.StageTransport` where each
stage sends its output straight to the next one and only the last stage's output comes back
(``docs/chain.md``).

The route session is the relay's, untouched: it still asks for one forward per stage. The
transport sends the frame to the first stage only (``Chain.ChainStream``); the first stage's
forward waits for the chain's outcome, which comes back on the ``Chain.ChainOutput`` stream the
transport opened on the last stage (or, for a failure, on the first stage's stream, naming the
stage that refused or was lost). What the session relays between stages is a :class:`ChainTicket`
holding that outcome: every later stage's forward answers from it without a call, and the forward
of the stage that failed raises its typed error, so the session blames the right stage, ends the
epoch and re-prefills on a new route exactly as it does over the relay.

With ``ring=True`` the last stage also sends each next decode step's frame (the session's
token, its sampler's: ``docs/sampling.md``) straight to the first stage; the transport finds
that frame already sent when the session asks for it, so a token costs one pass around the
ring. A session that samples itself (a sampler that states no ``Sampling``) gets logits back;
its open carried no sampler, so the ring's last stage runs on with the greedy token and says so
(``ChainOutputReply.ring_next``), and a session whose own token differs fails the epoch
(``RingMismatch``: nobody is blamed) and re-prefills.

At the first forward of an epoch the transport links the route (``Chain.Link`` on every stage
but the last: the next stage's endpoint, expectations and session secret) and opens the output
stream; both are per ``(session, epoch)`` and torn down with the epoch's first close.

A frame that does not come back in time is not filed against the first stage, which is all
the client waited on: while it is overdue the transport probes the epoch's stages
(:mod:`~dgr_engine.client.chained.silence`) and fails the epoch at the stage that went silent;
when it cannot tell which, the epoch fails naming none (``RouteStalled``).

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
from loguru import logger

from dgr_engine.client.chained.epoch import ChainEpoch
from dgr_engine.client.chained.silence import SilenceWatch, find_silent_stage
from dgr_engine.client.chained.tickets import ChainRecord, ChainStats, ChainTicket, RingMismatch
from dgr_engine.client.channel import ChainChannel, StageFailure
from dgr_engine.client.frame_link_channel import FrameLinkChainChannel
from dgr_engine.client.grpc_channel import GrpcChainChannel
from dgr_engine.client.native_channel import native_route
from dgr_engine.client.relay import GrpcStageTransport, expectations_for
from dgr_engine.client.route_modes import DataPath
from dgr_engine.client.shard_client import client_call_error, mtp_drafts_of, session_metadata
from dgr_engine.errors import (
    FrameRejected,
    ShardDeadlineExceeded,
    ShardError,
    ShardRpcError,
)
from dgr_engine.status import Status, status_of
from dgr_engine.wire.advert import Advert
from dgr_engine.wire.frame_link import FrameLinkTarget, split_endpoint
from dgr_engine.wire.frames import (
    Frame,
    encode_frame,
    expectations_to_proto,
    output_from_reply,
    sampled_from_reply,
)
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_session.commands import Forward
from dgr_session.errors import DgrError, RouteStalled
from dgr_session.identifiers import check_session_id, log_field
from dgr_session.mtp_drafts import MtpDraftRequest
from dgr_session.prefixes import PrefixRef
from dgr_session.route import StageSpec
from dgr_session.sampling import Sampling
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

DATA_PATHS = tuple(DataPath)
"""The data paths a :class:`ChainStageTransport` can be told to take (``docs/data-paths.md``)."""

_LIMITS_KEPT = 65536
"""Sessions whose ring limits a transport keeps (the oldest are forgotten first)."""

__all__ = ["DATA_PATHS", "ChainStageTransport"]


@attrs.define(eq=False)
class _RingDrafts:
    """A drafting ring's session's draft source: the drafts of the pass the ring's last stage
    already sent (none when it sent none: the session then sends the newest token alone),
    named for what drafts them there (``ngram``, ``mtp``)."""

    transport: ChainStageTransport
    session_id: str
    name: str = "ngram"

    def propose(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        return self.transport.ring_drafts(self.session_id, len(history) - 1)[:k]

    def close(self) -> None:
        pass


_log = logger.bind(stage="client")

_NATIVE_REFUSALS = frozenset({Status.UNAVAILABLE, Status.CAPACITY, Status.DEADLINE})
"""How a stage says it took no native link: its port refused or was unreachable, or it had
no room. Any other refusal is the stage's own fault, on every path."""


def _native_refused(error: Exception) -> bool:
    """A native link that could not be made (the epoch may take the next path)."""
    if isinstance(error, ShardError):
        return status_of(error) in _NATIVE_REFUSALS
    return isinstance(error, ConnectionError | TimeoutError)


class _AtStage(Exception):
    """A chain's setup failed at the stage of this index, with this error."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(index, error)
        self.index, self.error = index, error

    @classmethod
    def lacking(cls, index: int, stage: StageSpec, path: DataPath) -> _AtStage:
        """``stage`` offers no ``path``, which the transport was told to take."""
        what = "native link" if path is DataPath.NATIVE else "frame link"
        error = ShardRpcError(
            f"{stage.endpoint} offers no {what} (data_path={path.value!r})",
            status="DGR_E_PROTOCOL",
        )
        return cls(index, error)


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
        data_path: DataPath | str = DataPath.AUTO,
        prefill_frames: int = 4,
        silence: SilenceWatch | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.silence = silence if silence is not None else SilenceWatch()
        """When an overdue frame's route is probed for a silent stage, and how long each
        stage may take to answer."""
        self.ring = ring
        """Ring mode: the last stage sends each next decode step's frame to the first stage
        itself (the session's token, which its sampler takes there: ``docs/chain.md``)."""
        self.capabilities = TransportCapabilities(
            prefill_frames=prefill_frames,
            runs_ahead=ring,
            drafts_on_route=True,
            finds_silent_stages=True,
            keeps_prefixes=True,
        )
        """``prefill_frames``: pinned prompt chunks a session may send in one prefill forward:
        the transport sends them as frames back to back, so that stage k runs frame f + 1
        while stage k + 1 runs frame f, in the calls it runs one chunk a forward. A ring runs
        ahead of its sessions and drafts on its last stage. Stages keep prompt prefixes
        across sessions (``docs/prefix-cache.md``)."""
        # session -> (last step the ring may produce, stop tokens), from session_starting
        self._limits: collections.OrderedDict[str, tuple[int, tuple[int, ...]]] = (
            collections.OrderedDict()
        )
        self.chain_observer = chain_observer
        """Called with a :class:`ChainRecord` after each chained frame that came back; must
        not raise."""
        # (session, epoch) -> its chain; dropped at the epoch's first close
        self._chains: dict[tuple[str, int], ChainEpoch] = {}
        self.chain_stats = ChainStats()
        """What chained frames cost (for benchmarks: where a token's time goes)."""
        if data_path not in DATA_PATHS:
            known = [str(p) for p in DATA_PATHS]
            raise ValueError(f"data_path must be one of {known}, got {data_path!r}")
        self.data_path = DataPath(data_path)
        """Which path chained frames take: ``auto`` (the fastest every stage of the route
        offers: native links for a ring's session without drafts (over TLS: sealed
        links only, ``wire/link_seal.py``), else the frame
        link, else gRPC), ``grpc``, ``frame`` or ``native`` (required: a route or session
        it cannot carry fails at its first frame, naming the first stage that does not offer
        it)."""
        self._targets: dict[tuple[str, bool], FrameLinkTarget] = {}
        # session -> most drafts its ring may draft a pass (a drafting ring's sessions)
        self._ring_drafting: dict[str, int] = {}
        # drafting rings' sessions whose last stage drafts with its MTP block
        self._ring_mtp: set[str] = set()

    async def _linked(self, chain: ChainEpoch) -> None:
        """Links ``chain``'s route once (every later forward of the epoch waits for it)."""
        if chain.setup is None:
            chain.setup = asyncio.get_running_loop().create_task(self._link(chain))
        await asyncio.shield(chain.setup)

    async def _link(self, chain: ChainEpoch) -> None:
        """Links the epoch's route: every stage but the last to the next (``Chain.Link``), a
        ring's last to its first, and the last stage's outcome stream opened; then the first
        stage's frame stream. A failure is the epoch's, at the stage it names."""
        route = [chain.stages[b] for b in sorted(chain.stages)]
        n_layer = route[0].identity.n_layer if route else 0
        ends = [s.layer_begin for s in route[1:]] == [s.layer_end for s in route[:-1]]
        if not route or route[0].layer_begin != 0 or route[-1].layer_end != n_layer or not ends:
            got = [(s.layer_begin, s.layer_end) for s in route]
            chain.fail(
                0,
                ShardRpcError(
                    f"opened stages {got} do not cover [0, {n_layer}) once", status="DGR_E_PROTOCOL"
                ),
            )
            return
        chain.route = route
        failed = await self._link_over(chain, native=self.data_path in ("native", "auto"))
        if failed is not None and chain.native and _native_refused(failed[1]):
            if self.data_path is DataPath.AUTO:  # the next path the stages offer, not a fault
                self.chain_stats.native_fallbacks += 1
                _log.bind(session=log_field(chain.session_id), epoch=chain.epoch).warning(
                    "stage {} took no native link ({}): the epoch takes the next path",
                    failed[0],
                    log_field(str(failed[1]), limit=300),
                )
                failed = await self._link_over(chain, native=False)
        if failed is not None:
            chain.fail(*failed)
            return
        if chain.native:
            self.chain_stats.native_epochs += 1
        elif chain.frame_link:
            self.chain_stats.frame_link_epochs += 1

    async def _link_over(self, chain: ChainEpoch, *, native: bool) -> tuple[int, Exception] | None:
        """Links ``chain``'s route over the fastest path it may take (native links only when
        ``native``) and starts the epoch; the failing stage and its error when it could not."""
        route = chain.route
        sid, epoch = chain.session_id, chain.epoch
        secrets = [self.client(s.endpoint).session_secret(sid, epoch) for s in route]
        last = len(route) - 1
        channels: Sequence[ChainChannel] | None = None
        use_frame_link = False  # the epoch takes the frame link
        try:
            if native:
                channels = await self.native_links(route, sid, sampled=chain.sampled)
            chain.native = channels is not None
            if channels is None:
                channels = await self.frame_links(route)
                use_frame_link = channels is not None
        except _AtStage as exc:
            return exc.index, exc.error
        chain.frame_link = use_frame_link
        if channels is None:  # gRPC
            channels = [GrpcChainChannel(self.client(s.endpoint).chain, s.endpoint) for s in route]
        metadata = session_metadata(pb.ForwardRequest(session_id=sid, epoch=epoch, step=0))

        async def link(k: int, nxt: StageSpec, ring: bool = False) -> None:
            tls = self.tls is not None and (await self.advert(nxt.endpoint)).security.tls
            hop = pb.ChainHop(
                endpoint=nxt.endpoint,
                expect=expectations_to_proto(expectations_for(nxt)),
                session_secret=secrets[(k + 1) % len(route)],
                tls=tls,
                frame_link=use_frame_link,
                native_link=chain.native,
                # a ring's link back to the first stage says who sends on it: the last stage
                native_hop=k if ring else k + 1,
            )
            request = pb.LinkRequest(
                session_id=sid, epoch=epoch, session_secret=secrets[k], next=hop, ring=ring
            )
            await self.client(route[k].endpoint).link(
                request, (k + 1) % len(route), timeout=self.timeout
            )

        outcomes = None

        async def open_output() -> None:
            nonlocal outcomes
            request = pb.ChainOutputRequest(
                session_id=sid, epoch=epoch, session_secret=secrets[last]
            )
            outcomes = channels[last].outcomes(request, metadata, last)
            async with asyncio.timeout(self.timeout):
                ready = await outcomes.next()
            if ready is None:
                raise ShardRpcError("the output stream ended at once", status="DGR_E_PROTOCOL")

        steps = [(k, link(k, route[k + 1])) for k in range(last)] + [(last, open_output())]
        if self.ring:
            steps.append((last, link(last, route[0], ring=True)))
        results = await asyncio.gather(*(c for _, c in steps), return_exceptions=True)
        for (k, _), result in zip(steps, results, strict=True):
            if isinstance(result, BaseException):
                error: Exception
                if isinstance(result, StageFailure):
                    k, error = result.hop, result.error
                elif isinstance(result, TimeoutError):
                    error = ShardDeadlineExceeded(f"no answer within {self.timeout} s")
                elif isinstance(result, DgrError):
                    error = result
                elif isinstance(result, Exception):  # failed the call here: not sent
                    error = client_call_error(result)
                else:
                    raise result
                if outcomes is not None:
                    outcomes.cancel()
                return k, error
        assert outcomes is not None
        try:
            frames = channels[0].frames(metadata)
        except DgrError as exc:
            outcomes.cancel()
            return 0, exc
        chain.start(frames, outcomes)
        return None

    async def _advert_at(self, index: int, stage: StageSpec) -> Advert:
        """``stage``'s advert; :class:`_AtStage` naming it when it cannot be had."""
        try:
            return await self.advert(stage.endpoint)
        except DgrError as exc:
            raise _AtStage(index, exc) from None

    async def frame_links(self, route: Sequence[StageSpec]) -> list[ChainChannel] | None:
        """Each stage's frame link, when the route's frames take it (``data_path``); ``None``:
        gRPC. A stage whose advert cannot be had, or that offers no frame link when one is
        required, raises :class:`_AtStage` with its index."""
        if self.data_path == "grpc":
            return None
        targets: list[ChainChannel] = []
        for index, stage in enumerate(route):
            advert = await self._advert_at(index, stage)
            port = advert.data_paths.frame_link_port
            if not port:
                if self.data_path == "auto":
                    return None
                raise _AtStage.lacking(index, stage, DataPath.FRAME)
            tls = self.tls is not None and advert.security.tls
            key = (stage.endpoint, tls)
            target = self._targets.get(key)
            if target is None or target.port != port:
                host, _ = split_endpoint(stage.endpoint)
                target = FrameLinkTarget(host, port, self.tls if tls else None)
                self._targets[key] = target
            targets.append(FrameLinkChainChannel(target, stage.endpoint))
        return targets

    async def native_links(
        self, route: Sequence[StageSpec], session_id: str, *, sampled: bool
    ) -> list[ChainChannel] | None:
        """Each stage's native link, for a ring's session that drafts nothing and whose tokens
        its last stage takes (``Forward.sampled``), over a
        route whose every stage offers one (``docs/native-path.md``); ``None`` when the epoch
        takes another path (``auto``). With ``data_path="native"`` a session or route it
        cannot carry raises :class:`_AtStage` instead (the first stage that does not offer it,
        or the first stage for the session)."""
        required = self.data_path == "native"
        limits = self._limits.get(session_id)
        eligible = (
            self.ring
            and sampled
            and session_id not in self._ring_drafting  # drafts on the ring
            and session_id not in self._mtp  # MTP drafts
            and (limits is None or limits[0] >= 0)  # drafts of its own (every pass its own)
        )
        if not eligible:
            if not required:
                return None
            error = ShardRpcError(
                "a native link carries rings whose last stage samples, without drafts or MTP, "
                "only "
                "(data_path='native')",
                status="DGR_E_PROTOCOL",
            )
            raise _AtStage(0, error)
        hosts: list[tuple[str, int]] = []
        sealed: list[bool] = []
        for index, stage in enumerate(route):
            advert = await self._advert_at(index, stage)
            port = advert.data_paths.native_link_port
            if port and self.tls is not None and not advert.data_paths.native_link_sealed:
                port = 0  # over TLS, only sealed links: never the frames in the clear
            if not port:
                if not required:
                    return None
                raise _AtStage.lacking(index, stage, DataPath.NATIVE)
            host, _ = split_endpoint(stage.endpoint)
            hosts.append((host, port))
            sealed.append(advert.data_paths.native_link_sealed)
        widths = [(s.boundary_in, s.boundary_out) for s in route]
        return list(native_route(hosts, widths, ring=True, sealed=sealed))

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
            speculation,
            drafter=_RingDrafts(self, sid, "mtp" if sid in self._ring_mtp else "ngram"),
            length=AnyLength(),
            max_drafts=k_max,
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

    async def open(
        self,
        stage: StageSpec,
        session_id: str,
        epoch: int,
        sampling: Sampling | None = None,
        *,
        prefix: PrefixRef | None = None,
    ) -> int:
        held = await super().open(stage, session_id, epoch, sampling, prefix=prefix)
        chain = self._chains.get((session_id, epoch))
        if chain is None:
            chain = self._chains[(session_id, epoch)] = ChainEpoch(
                session_id, epoch, ring=self.ring, close_timeout=self.close_timeout
            )
        chain.stages[stage.layer_begin] = stage
        return held

    async def close(
        self, stage: StageSpec, session_id: str, epoch: int, *, keep: PrefixRef | None = None
    ) -> None:
        chain = self._chains.pop((session_id, epoch), None)
        if chain is not None:
            await chain.aclose()
        await super().close(stage, session_id, epoch, keep=keep)

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
        if not chain.sampled and chain.route == []:
            chain.sampled = call.sampled  # the epoch's first frame says how it samples
        await self._linked(chain)
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
                    f"{call.kept_drafts}): the ring's last stage took another token",
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
            await self._await_outcome(chain, ticket)
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

    async def _await_outcome(self, chain: ChainEpoch, ticket: ChainTicket) -> None:
        """Waits for ``ticket``'s outcome for ``timeout`` at most. While it is overdue, the
        epoch's stages are probed every ``silence.after`` s: the first that went silent fails
        the epoch at its index; past ``timeout`` with none found, the epoch fails naming no
        stage (``RouteStalled``)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.timeout
        watch = self.silence
        while not ticket.done.done():
            left = end - loop.time()
            if left <= 0:
                chain.fail(
                    0,
                    RouteStalled(
                        f"no chained output within {self.timeout} s, and no stage of the route"
                        " was found silent: the client cannot tell which stage held it"
                    ),
                )
                return
            try:
                async with asyncio.timeout(min(watch.after, left)):
                    await asyncio.shield(ticket.done)
                return
            except TimeoutError:
                pass
            if chain.route:
                silent = await find_silent_stage(chain.route, self._probe)
                if silent is not None:
                    chain.fail(silent.index, silent.error)
                    return

    async def _probe(self, stage: StageSpec) -> None:
        """A stage's health check within ``silence.timeout`` (its typed error if none)."""
        await self.client(stage.endpoint).require_serving(timeout=self.silence.timeout)

    async def _frames_ahead(self, chain: ChainEpoch, call: Forward, frame: Frame) -> int:
        """A forward of several pinned prefill chunks (``Forward.frame_rows``): sends every
        frame but the last, back to back, without waiting for their outputs, so that the
        route's stages work on them at once; their outcomes fold into the last frame's ticket
        (:meth:`ChainEpoch.fold_frames`). ``frame`` is the call's whole frame. Returns the rows
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
        chain: ChainEpoch,
        call: Forward,
        reply: pb.ChainOutputReply,
        stops: tuple[int, ...],
        drafting: bool,
    ) -> None:
        """What the ring sent on by itself after ``call``'s frame: the next step's tokens, and
        on a drafting ring the pass's kept drafts (the tokens of its rows, as the ring's last
        stage took them) and the next pass's drafts. After a reply of logits (a session that
        samples them itself) the frame the ring sent on says its token (``ring_next``)."""
        sent = tuple(int(t) for t in reply.ring_next)
        try:
            answered = sampled_from_reply(reply.reply)
        except FrameRejected:
            return  # malformed: the session's answer (_answer) says so
        if not answered:  # logits (a session that samples them itself): what the ring sent
            if sent and not call.drafts and not drafting:
                chain.predicted[call.step + 1] = ((sent[0],), None)
            return
        start = call.positions.start
        if not call.drafts:
            taken, kept = [answered[-1]], None
            position = call.positions.stop
        else:
            if len(answered) != len(call.positions):
                return
            taken = list(answered)
            kept = kept_drafts(taken, call.token_ids[1:])
            taken, position = taken[: kept + 1], start + 1 + kept
        if any(token in stops for token in taken):
            return
        step = call.step + len(taken)
        if drafting:  # the frame it sent (none when it sent none), drafts and all
            if sent and sent[0] == taken[-1]:
                chain.predicted[step] = (sent, kept)
                chain.ring_drafts[position] = sent[1:]
        elif not call.drafts:
            chain.predicted[step] = ((taken[-1],), None)

    def _answer(self, chain: ChainEpoch, stage: StageSpec, ticket: ChainTicket) -> StageResult:
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
            sampled = sampled_from_reply(ticket.reply.reply)
            if sampled is not None:
                return Logits.sampled_tokens(sampled, cost)
            logits = output_from_reply(ticket.reply.reply)
        except FrameRejected as exc:
            error = FrameRejected(f"DGR_E_FRAME: malformed chained output: {exc}")
            self._raise(stage, sid, epoch, f"chained forward step {ticket.step}", error)
        return Logits.last_row(logits, cost)
