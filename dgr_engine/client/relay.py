"""Route sessions over real shard workers: a ``StageTransport`` over gRPC.

:class:`GrpcStageTransport` gives each stage a ``dgr worker`` reached through one
:class:`~dgr_engine.client.ShardClient` per endpoint, shared by every session; forwards use a
per-session stream, every call has a deadline, and per-endpoint counters (:meth:`stats`) give
timings and seam bytes. Failures are raised as the client raised them, each declaring its fault
kind (``docs/wire.md``). A session id that breaks ``dgr_session.identifiers``' rule is refused
with ``InvalidIdentifier`` before anything is sent, and a call that failed in the client
(``ClientCallError``) is not counted against the stage: both are filed as ``client`` faults.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NoReturn

import attrs
import numpy as np
from loguru import logger

from dgr_engine.client.shard_client import DEFAULT_MAX_MESSAGE_BYTES, ForwardResult, ShardClient
from dgr_engine.errors import (
    EngineError,
    ExpectationMismatch,
    FrameRejected,
    StaleEpoch,
    UnknownSession,
)
from dgr_engine.security.tls import ClientTls
from dgr_engine.wire.advert import Advert
from dgr_engine.wire.frames import SCHEMA_VERSION, Expectations, Frame
from dgr_session.commands import Forward
from dgr_session.errors import StageDead
from dgr_session.faults import FaultKind
from dgr_session.identifiers import check_session_id, log_field
from dgr_session.mtp_drafts import MtpDraftRequest, MtpDrafts
from dgr_session.prefixes import PrefixRef
from dgr_session.route import StageSpec
from dgr_session.sampling import Sampling
from dgr_session.speculation import MAX_DRAFTS, Speculation
from dgr_session.transport import (
    Boundary,
    Logits,
    SessionStart,
    StageResult,
    TransportCapabilities,
)
from dgr_session.usage import StageCost

if TYPE_CHECKING:
    from loguru import Logger

__all__ = ["ForwardRecord", "GrpcStageTransport", "StageStats", "expectations_for"]


_CLOSE_RETRY_LIMIT = 600.0
"""Seconds a failed close is retried when the stage's advert states no lease."""


def expectations_for(stage: StageSpec) -> Expectations:
    """What the route says the worker at ``stage.endpoint`` is (sent with every frame)."""
    return Expectations(
        model_sha256=stage.identity.content_hash,
        layer_begin=stage.layer_begin,
        layer_end=stage.layer_end,
        boundary_width=stage.boundary_in,
        schema_version=SCHEMA_VERSION,
    )


@attrs.frozen
class ForwardRecord:
    """One successful forward, as seen by the transport (handed to the ``observer``)."""

    endpoint: str
    """Stage endpoint."""
    layers: tuple[int, int]
    """Stage's layer range."""
    session_id: str
    """Session."""
    epoch: int
    """Epoch."""
    step: int
    """Step."""
    positions: range
    """Positions forwarded (``start == 0``: a prefill, or a re-prefill when ``epoch > 0``)."""
    bytes_sent: int
    """Payload sent: boundary rows + positions + token ids (as the advert's seam cost counts)."""
    bytes_received: int
    """Payload received: boundary rows or logits."""
    rtt_us: int
    """Round trip seen by the client."""
    wire_us: int
    """Part of ``rtt_us`` inside gRPC (request handed over to reply handed back)."""
    handler_us: int
    """Time in the worker's handler (frame checks, engine, reply built)."""
    compute_us: int
    """Engine time reported by the worker."""
    queue_us: int
    """Time the frame waited for the worker's engine."""
    native_us: int = 0
    """Of ``compute_us``, the part inside llama.cpp (0: a worker that does not say)."""


@attrs.frozen
class StageStats:
    """Counters of one endpoint over the transport's lifetime (successful forwards only)."""

    endpoint: str
    """Stage endpoint."""
    layers: tuple[int, int]
    """Layer range last seen for it."""
    forwards: int
    """Successful forwards."""
    rows: int
    """Rows forwarded."""
    bytes_sent: int
    """Payload bytes sent to the stage (boundary + positions + token ids)."""
    bytes_received: int
    """Payload bytes received from it (boundary rows or logits)."""
    rtt_us: int
    """Sum of client round trips."""
    compute_us: int
    """Sum of engine time the worker reported."""
    queue_us: int
    """Sum of time frames waited for the worker's engine."""
    failures: int
    """Calls (open, forward, close) that raised (a failure of the client's own making, fault
    kind ``client``, is not the stage's and is not counted)."""

    @property
    def overhead_us(self) -> int:
        """Round trips minus engine time: the seam's cost (encode, gRPC, loopback, checks)."""
        return self.rtt_us - self.compute_us


@attrs.define
class _Counters:
    layers: tuple[int, int]
    forwards: int = 0
    rows: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rtt_us: int = 0
    compute_us: int = 0
    queue_us: int = 0
    failures: int = 0


class GrpcStageTransport:
    """:class:`~dgr_session.transport.StageTransport` over ``dgr worker`` processes.

    ``timeout``: deadline of each open/forward call, seconds (keep it at or below the failure
    policy's step deadline). ``close_timeout``: deadline of each close (closing a hung or dead
    stage must not hold anything up). ``streaming``: forwards over per-session streams
    (default) or unary calls. ``adverts``: adverts already known, by endpoint (else fetched
    with ``Describe`` on first contact). ``observer`` is called with a :class:`ForwardRecord`
    after each successful forward; it must not raise.

    Use from one event loop; ``await aclose()`` (or ``async with``) closes every channel.
    """

    def __init__(
        self,
        *,
        timeout: float = 10.0,
        close_timeout: float = 2.0,
        streaming: bool = True,
        adverts: Mapping[str, Advert] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        observer: Callable[[ForwardRecord], None] | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        self.tls = tls
        self.timeout = timeout
        self.close_timeout = close_timeout
        self.streaming = streaming
        self.observer = observer
        self._max_message_bytes = max_message_bytes
        # One client per endpoint, created on first use. Invariant: never closed while the
        # transport is open (a dead worker's channel just fails fast; gRPC reconnects by itself).
        self._clients: dict[str, ShardClient] = {}
        # Adverts by endpoint; dropped when the endpoint is found dead (a restarted worker at
        # the same address may serve another range).
        self._adverts: dict[str, Advert] = dict(adverts or {})
        self._counters: dict[str, _Counters] = {}
        # Newest epoch an open was sent for, by (endpoint, session); dropped once closed. A
        # close for a pair never opened here is a no-op without a call (nothing can be held).
        self._sent_open: dict[tuple[str, str], int] = {}
        # Opens in flight, by (endpoint, session, epoch): a close of that epoch first waits
        # (bounded) for its open to land, so that the worker cannot open after the close.
        self._opening: dict[tuple[str, str, int], asyncio.Event] = {}
        # Closes that failed (a hung or unreachable stage), retried in the background until the
        # worker answers, by (endpoint, session, epoch).
        self._close_retries: dict[tuple[str, str, int], asyncio.Task[None]] = {}
        # session -> its MTP drafts (session_starting): the last stage's replies feed them
        self._mtp: dict[str, MtpDrafts] = {}

    async def __aenter__(self) -> GrpcStageTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stops retrying failed closes and closes every channel (sessions still open on
        workers stay there until their worker frees them: lease, stall rule)."""
        retries, self._close_retries = self._close_retries, {}
        for task in retries.values():
            task.cancel()
        await asyncio.gather(*retries.values(), return_exceptions=True)
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.aclose()

    # -- what the transport knows --------------------------------------------------------------

    def learn(self, endpoint: str, advert: Advert) -> None:
        """Records the advert of ``endpoint`` (saves the ``Describe`` on first contact)."""
        self._adverts[endpoint] = advert

    async def advert(self, endpoint: str) -> Advert:
        """The endpoint's advert: cached, else fetched with ``Describe`` (an unreachable worker
        raises ``ShardUnavailable``, a :class:`~dgr_session.errors.StageDead`)."""
        advert = self._adverts.get(endpoint)
        if advert is None:
            advert = await self.client(endpoint).describe(timeout=self.timeout)
            self._adverts[endpoint] = advert
        return advert

    def client(self, endpoint: str) -> ShardClient:
        """The endpoint's client (one channel, created on first use)."""
        client = self._clients.get(endpoint)
        if client is None:
            client = ShardClient(
                endpoint,
                timeout=self.timeout,
                streaming=self.streaming,
                max_message_bytes=self._max_message_bytes,
                tls=self.tls,
            )
            self._clients[endpoint] = client
        return client

    @property
    def pending_closes(self) -> int:
        """Failed closes still being retried in the background."""
        return len(self._close_retries)

    async def settle_closes(self, timeout: float) -> int:
        """Waits (at most ``timeout`` s) for the closes being retried to land or give up;
        returns how many are still pending."""
        pending = list(self._close_retries.values())
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        return self.pending_closes

    def stats(self) -> dict[str, StageStats]:
        """Counters per endpoint, in first-contact order."""
        return {
            endpoint: StageStats(endpoint=endpoint, **attrs.asdict(c))
            for endpoint, c in self._counters.items()
        }

    # -- StageTransport ------------------------------------------------------------------------

    async def open(
        self,
        stage: StageSpec,
        session_id: str,
        epoch: int,
        sampling: Sampling | None = None,
        *,
        prefix: PrefixRef | None = None,
    ) -> int:
        check_session_id(session_id)  # before anything is recorded or sent
        log = _log(stage, session_id, epoch)
        key = (stage.endpoint, session_id)
        # recorded before any await: a close issued from now on knows the stage may hold it
        before = self._sent_open.get(key)
        self._sent_open[key] = max(epoch, before if before is not None else epoch)
        landed = self._opening[(*key, epoch)] = asyncio.Event()
        sent = False
        try:
            await self.advert(stage.endpoint)  # the token-id sideband is decided by the advert
            sent = True
            held = await self.client(stage.endpoint).open(
                session_id,
                epoch,
                expectations_for(stage),
                grant=stage.grant,
                timeout=self.timeout,
                sampling=sampling,
                prefix=prefix,
            )
        except Exception as exc:
            if not sent or _client_made(exc):  # never reached the stage: it holds no more
                if before is None:
                    self._sent_open.pop(key, None)
                else:
                    self._sent_open[key] = before
            self._raise(stage, session_id, epoch, "open", exc)
        finally:
            landed.set()
            if self._opening.get((*key, epoch)) is landed:
                del self._opening[(*key, epoch)]
        log.debug("opened")
        return held

    capabilities = TransportCapabilities(drafts_on_route=True, keeps_prefixes=True)
    """A last stage that loaded the MTP block drafts for a session that asks it to; stages keep
    prompt prefixes across sessions (``docs/prefix-cache.md``)."""

    def session_starting(self, start: SessionStart) -> Speculation | None:
        """Called by the ``SessionManager`` as a session starts: a session drafting with the
        MTP block (:class:`~dgr_session.mtp_drafts.MtpDraftRequest`) speculates with its
        :class:`~dgr_session.mtp_drafts.MtpDrafts`, fed by the last stage's replies; its frames
        to a last stage that loaded the block ask for drafts (``mtp_draft_max``). Any other
        draft source is left as it is."""
        speculation = start.speculation
        if speculation is None or not isinstance(speculation.drafter, MtpDraftRequest):
            return speculation
        k_max = min(speculation.drafter.k_max, speculation.max_drafts, MAX_DRAFTS)
        drafts = MtpDrafts(k_max)
        self._mtp[start.session_id] = drafts
        while len(self._mtp) > _MTP_KEPT:
            self._mtp.pop(next(iter(self._mtp)))
        return attrs.evolve(speculation, drafter=drafts)

    def mtp_draft_max(self, session_id: str, advert: Advert, call: Forward) -> int:
        """The drafts to ask of ``advert``'s stage with ``call`` (0: none): its session drafts
        with MTP, the stage is the last and loaded the block, and the call wants logits."""
        drafts = self._mtp.get(session_id)
        if drafts is None or not (advert.span.is_last and advert.span.mtp) or not call.wants_logits:
            return 0
        return drafts.k_max

    def mtp_offer(self, session_id: str, held: tuple[int, tuple[int, ...]] | None) -> None:
        """The last stage's MTP drafts for ``session_id`` (from a reply)."""
        drafts = self._mtp.get(session_id)
        if drafts is not None and held is not None:
            drafts.offer(*held)

    async def forward(self, call: Forward) -> StageResult:
        stage, session_id, epoch, step = call.stage, call.session_id, call.epoch, call.step
        positions = call.positions
        check_session_id(session_id)
        n = len(positions)
        try:
            advert = self._adverts.get(stage.endpoint) or await self.advert(stage.endpoint)
            # the last stage too: a penalised sampler there reads the tokens before each row
            send_ids = advert.span.is_first or advert.span.needs_token_ids or advert.span.is_last
            rows = None if call.boundary is None else _rows(call.boundary)
            client = self.client(stage.endpoint)
            frame = Frame.of_call(
                call,
                expectations_for(stage),
                session_secret=client.session_secret(session_id, epoch),
                timeout=self.timeout,
                tokens=send_ids,
                boundary=rows,
                last_stage=advert.span.is_last,
                mtp_draft_max=self.mtp_draft_max(session_id, advert, call),
            )
            result = await client.send(frame)
        except Exception as exc:
            self._raise(stage, session_id, epoch, f"forward step {step}", exc)
        self.mtp_offer(session_id, result.mtp_drafts)
        sent = 4 * n + (4 * n if send_ids else 0) + (0 if rows is None else rows.nbytes)
        self._account(stage, positions, session_id, epoch, step, sent, result)
        received = int(result.output.nbytes) + 4 * len(result.sampled or ())
        cost = StageCost(sent, received, result.timings.compute_us / 1e6)
        if not result.is_logits:
            return Boundary(result.output, cost)
        if result.sampled is not None:
            return Logits.sampled_tokens(result.sampled, cost)
        return Logits.last_row(result.output, cost)

    async def close(
        self, stage: StageSpec, session_id: str, epoch: int, *, keep: PrefixRef | None = None
    ) -> None:
        check_session_id(session_id)
        key = (stage.endpoint, session_id)
        if key not in self._sent_open:
            return  # never asked to open it: the stage holds nothing of this session
        log = _log(stage, session_id, epoch)
        opening = self._opening.get((*key, epoch))
        if opening is not None:  # its open is in flight: let it land first (bounded)
            try:
                async with asyncio.timeout(self.close_timeout):
                    await opening.wait()
            except TimeoutError:
                pass  # close anyway, bounded: an open landing later holds its slot until the
                # session's next epoch there or a close
            if key not in self._sent_open:
                return  # the open never reached the stage
        try:
            await self._close_once(stage, session_id, epoch, keep)
        except Exception as exc:
            if not _client_made(exc):  # a close this client cannot send would fail again
                self._retry_close_later(stage, session_id, epoch)
            self._raise(stage, session_id, epoch, "close", exc)
        log.debug("closed")

    async def _close_once(
        self, stage: StageSpec, session_id: str, epoch: int, keep: PrefixRef | None = None
    ) -> None:
        """One close call (keeping ``keep`` first); returns once the stage holds nothing of
        ``epoch``."""
        key = (stage.endpoint, session_id)
        client = self.client(stage.endpoint)
        try:
            # the client drops the session's stream at once (before any await), so a close of an
            # old epoch never touches the stream of a newer one opened after it was issued
            async with asyncio.timeout(self.close_timeout):
                await client.close(session_id, epoch, timeout=self.close_timeout, keep=keep)
        except UnknownSession:
            pass  # not held: nothing to release
        except StaleEpoch:
            return  # a newer epoch is held: nothing of this one to release
        self._forget(key, epoch)

    def _retry_close_later(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        """Retries a failed close in the background (backoff 0.25 s doubling to 4 s) until the
        stage answers, a newer epoch is opened there, the stage's lease would have freed the
        session anyway, or the transport closes: a stalled stage that resumes gets its slot
        back within one backoff step."""
        key = (stage.endpoint, session_id, epoch)
        if key in self._close_retries:
            return
        advert = self._adverts.get(stage.endpoint)
        lease = advert.capacity.session_lease_seconds if advert is not None else 0.0
        task = asyncio.get_running_loop().create_task(
            self._keep_closing(stage, session_id, epoch, lease or _CLOSE_RETRY_LIMIT),
            name=f"dgr-close-retry {stage.endpoint} {session_id}/{epoch}",
        )
        self._close_retries[key] = task
        task.add_done_callback(lambda _t: self._close_retries.pop(key, None))

    async def _keep_closing(
        self, stage: StageSpec, session_id: str, epoch: int, limit: float
    ) -> None:
        log = _log(stage, session_id, epoch)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + limit
        delay = 0.25
        for attempt in itertools.count(2):
            await asyncio.sleep(delay)
            if self._sent_open.get((stage.endpoint, session_id), -1) > epoch:
                return  # a newer epoch's open discards this one there
            try:
                await self._close_once(stage, session_id, epoch)
            except Exception as exc:  # noqa: BLE001 - keep trying within the limit
                if loop.time() + delay >= give_up:
                    log.warning(
                        "close still failing after {} attempts; giving up: {}",
                        attempt,
                        log_field(str(exc)),
                    )
                    return
                delay = min(delay * 2, 4.0)
                continue
            log.info("closed on attempt {}", attempt)
            return

    def _forget(self, key: tuple[str, str], epoch: int) -> None:
        if self._sent_open.get(key, epoch + 1) <= epoch:
            del self._sent_open[key]

    # -- internals -----------------------------------------------------------------------------

    def _counter(self, stage: StageSpec) -> _Counters:
        layers = (stage.layer_begin, stage.layer_end)
        counter = self._counters.get(stage.endpoint)
        if counter is None:
            counter = self._counters[stage.endpoint] = _Counters(layers)
        counter.layers = layers
        return counter

    def _account(
        self,
        stage: StageSpec,
        positions: range,
        session_id: str,
        epoch: int,
        step: int,
        sent: int,
        result: ForwardResult,
    ) -> None:
        c = self._counter(stage)
        received = int(result.output.nbytes) + 4 * len(result.sampled or ())
        t = result.timings
        c.forwards += 1
        c.rows += len(positions)
        c.bytes_sent += sent
        c.bytes_received += received
        c.rtt_us += result.rtt_us
        c.compute_us += t.compute_us
        c.queue_us += t.queue_us
        if self.observer is not None:
            self.observer(
                ForwardRecord(
                    endpoint=stage.endpoint,
                    layers=c.layers,
                    session_id=session_id,
                    epoch=epoch,
                    step=step,
                    positions=positions,
                    bytes_sent=sent,
                    bytes_received=received,
                    rtt_us=result.rtt_us,
                    wire_us=result.wire_us,
                    handler_us=t.total_us,
                    compute_us=t.compute_us,
                    queue_us=t.queue_us,
                    native_us=t.native_us,
                )
            )

    def _raise(
        self,
        stage: StageSpec,
        session_id: str,
        epoch: int,
        what: str,
        exc: Exception,
    ) -> NoReturn:
        """Re-raises ``exc`` as it is (each error declares its fault kind; see the module's
        table), its message prefixed with the endpoint and the call; counts and logs it. Call
        from the ``except`` block that caught ``exc``."""
        if not _client_made(exc):
            self._counter(stage).failures += 1  # the client's own failure is not the stage's
        endpoint = stage.endpoint
        if isinstance(exc, StageDead | ExpectationMismatch | FrameRejected):
            # gone, or not what we knew: ask it again next time
            self._adverts.pop(endpoint, None)
        if isinstance(exc, StaleEpoch):  # the wire names the held epoch, not the refused call
            exc.session_id = session_id if exc.session_id is None else exc.session_id
            exc.epoch = epoch if exc.epoch is None else exc.epoch
        exc.args = (f"{endpoint}: {what}: {exc}", *exc.args[1:])
        _log(stage, session_id, epoch).debug(
            "{} failed: {}: {}", what, type(exc).__name__, log_field(str(exc))
        )
        raise exc


_MTP_KEPT = 65536
"""Sessions whose MTP drafts a transport keeps (the oldest are forgotten first)."""


def _client_made(exc: BaseException) -> bool:
    """``exc`` failed in this client before anything was sent (fault kind ``client``)."""
    return getattr(exc, "fault_kind", None) is FaultKind.CLIENT


def _log(stage: StageSpec, session_id: str, epoch: int) -> Logger:
    return logger.bind(
        session=session_id,
        epoch=epoch,
        stage=f"{log_field(stage.endpoint)}[{stage.layer_begin}:{stage.layer_end})",
    )


def _rows(boundary: object) -> np.ndarray:
    """The previous stage's rows as a float32 ``[n, width]`` array (no copy if already one)."""
    rows = np.asarray(boundary, dtype=np.float32)
    if rows.ndim != 2:
        raise EngineError(
            f"boundary rows must be [n, width], got shape {rows.shape}", status="DGR_E_SHAPE"
        )
    return rows
