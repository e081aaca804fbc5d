"""The per-frame path of a worker, for the ``Shard`` and ``Chain`` services alike: decode a
forward frame, check it (well-formed first, the same answer for anyone and nothing touched;
then authorised: session secret, the session's frame rate), run it on the engine, encode the
reply and count it; and refuse a call as a typed refusal: its gRPC code, details and trailers
(``dgr-status``, ``wire/status.py``), plus ``dgr-chain-hop`` for a chained frame.

What the path needs of its worker is :class:`FrameHost` (``ShardWorker`` is one); it keeps
nothing of its own.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import attrs
import grpc

from dgr_engine.engine import ShardInfo
from dgr_engine.errors import FrameRejected, ShardError
from dgr_engine.status import is_worker_fault
from dgr_engine.wire import frames
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.status import CHAIN_HOP_KEY, grpc_status_for, refusal_trailers
from dgr_engine.worker.calls.registration import Undecodable
from dgr_engine.worker.engine_access.co_batch import FrameResult
from dgr_engine.worker.lifecycle.grant_gate import GrantGate
from dgr_engine.worker.lifecycle.peer_limits import PeerLimits
from dgr_engine.worker.reporting.load import LoadMeter
from dgr_engine.worker.reporting.metrics import WorkerMetrics
from dgr_engine.worker.reporting.usage import UsageBook
from dgr_session.identifiers import log_field

if TYPE_CHECKING:
    from loguru import Logger

_DETAILS_LOGGED = 1000
"""Characters of a refusal's reason a log line keeps (escaped: ``log_field``)."""


class SessionLookup(Protocol):
    """The session table's lookup the path needs (``SessionTable`` is one)."""

    def check_open(self, session_id: str, epoch: int) -> None:
        """``UnknownSession`` / ``StaleEpoch`` unless ``(session_id, epoch)`` is open."""
        ...

    def take_mtp_drafts(self, session_id: str, epoch: int) -> tuple[int, tuple[int, ...]] | None:
        """The MTP drafts of the session's last frame (position, drafts), once."""
        ...


class FrameHost(Protocol):
    """What the per-frame path needs of its worker."""

    @property
    def expect(self) -> frames.Expectations:
        """What every frame must state (model, layers, widths, schema)."""
        ...

    @property
    def info(self) -> ShardInfo:
        """The shard's shape (first, last, widths): how a frame is decoded and answered."""
        ...

    @property
    def log(self) -> Logger:
        """The worker's log (bound to its stage)."""
        ...

    @property
    def table(self) -> SessionLookup:
        """Which sessions are open, at which epoch."""
        ...

    @property
    def grants(self) -> GrantGate:
        """Session secrets (every frame carries its epoch's)."""
        ...

    @property
    def limits(self) -> PeerLimits:
        """Each session's frame rate."""
        ...

    @property
    def meter(self) -> LoadMeter:
        """Load and health for the advert (frames in flight, rows, the worker's own faults)."""
        ...

    @property
    def metrics(self) -> WorkerMetrics:
        """Prometheus counters (frames by kind, refusals by status)."""
        ...

    @property
    def usage(self) -> UsageBook:
        """Usage records by session and epoch."""
        ...

    async def run_forward(self, frame: frames.ForwardFrame, deadline: float | None) -> FrameResult:
        """Runs a decoded frame on the engine; raises the engine's refusal, or
        ``DGR_E_DEADLINE`` when ``deadline`` passed while it queued."""
        ...


def bind_request(log: Logger, request: Any) -> Logger:
    """``log`` bound to the session and epoch a request names, escaped (``log_field``): a
    session id is peer-supplied text until checked, and must never forge a log line."""
    return log.bind(
        session=log_field(getattr(request, "session_id", "-")),
        epoch=log_field(getattr(request, "epoch", "-")),
    )


def deadline_of(context: grpc.aio.ServicerContext[Any, Any]) -> float | None:
    """The call's deadline on ``time.monotonic``'s clock (``None``: it has none)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _details(exc: BaseException, status: str) -> str:
    text = str(exc)
    return text if text.startswith(status) else f"{status}: {text}"


@attrs.frozen
class Forwarded:
    """A frame :meth:`FramePath.run` ran, and what :meth:`FramePath.account` counts of it."""

    request: pb.ForwardRequest
    frame: frames.ForwardFrame
    reply: pb.ForwardReply
    rows: int
    compute_ns: int
    total_ns: int
    sampled: tuple[int, ...] | None = None
    """A last stage's tokens of the frame's logits rows (its session's sampler's), whether or
    not the reply carries them: a ring's last stage sends the next frame with the last."""


class FramePath:
    """Decode, check, forward, refuse: one worker's frames, whichever service they came by."""

    def __init__(self, host: FrameHost) -> None:
        self._host = host

    async def forward(self, request: pb.ForwardRequest, deadline: float | None) -> pb.ForwardReply:
        """One frame: check, run on the engine (``FrameHost.run_forward``), encode, count;
        raises on refusal."""
        done = await self.run(request, deadline)
        self.account(done)
        return done.reply

    async def run(self, request: pb.ForwardRequest, deadline: float | None) -> Forwarded:
        """One frame, up to its encoded reply: check, run on the engine, encode; raises on
        refusal. The caller counts it with :meth:`account` once the reply is on its way (a
        chained stage sends the next stage its frame first: the counting is off the route's
        critical path)."""
        began = time.perf_counter_ns()
        host = self._host
        frames.check_session_id(request.session_id)  # before it reaches any table or log
        # well-formed first (the same answer for anyone; nothing touched), then authorised
        frame = frames.decode_forward(request, host.expect, host.info)
        host.grants.check(request.session_id, int(request.epoch), request.session_secret)
        host.limits.check_frame(request.session_id)
        if request.timeout_ms:
            own = time.monotonic() + request.timeout_ms / 1000
            deadline = own if deadline is None else min(deadline, own)
        host.meter.admitted()
        rows = 0
        try:
            result = await host.run_forward(frame, deadline)
            rows = frame.n_rows
        finally:
            host.meter.finished(rows)
        out, next_pos, compute_ns = result.rows, result.next_pos, result.compute_ns
        reply = pb.ForwardReply(
            session_id=frame.session_id,
            epoch=frame.epoch,
            step=frame.step,
            kind=pb.OUTPUT_KIND_LOGITS if host.info.is_last else pb.OUTPUT_KIND_BOUNDARY,
            next_pos=next_pos,
        )
        sampled = result.sampled  # the session's tokens of its logits rows (sessions.py)
        if frame.sampled_tokens and host.info.is_last:  # the tokens, not the logits
            reply.sampled.extend(sampled or ())
        else:
            frames.fill_tensor(reply.output, out)
        if frame.mtp_draft_max:
            held = host.table.take_mtp_drafts(frame.session_id, frame.epoch)
            if held is not None:
                reply.mtp_draft_pos, drafts = held
                reply.mtp_drafts.extend(drafts)
        reply.timings.queue_us = result.queue_ns // 1000
        reply.timings.compute_us = compute_ns // 1000
        reply.timings.native_us = result.native_ns // 1000
        total_ns = time.perf_counter_ns() - began
        reply.timings.total_us = total_ns // 1000
        return Forwarded(request, frame, reply, rows, compute_ns, total_ns, sampled)

    def account(self, done: Forwarded) -> None:
        """Counts a frame :meth:`run` ran: its debug line, metrics and usage record."""
        host, request, frame, reply = self._host, done.request, done.frame, done.reply
        kind = frames.ROW_KIND_NAMES.get(request.kind, "unspecified")
        host.log.bind(session=frame.session_id, epoch=frame.epoch, step=frame.step).debug(
            "forward {} rows ({}) at {}: engine {:.2f} ms, frame {:.2f} ms",
            done.rows,
            kind,
            int(request.expected_next_pos),
            done.compute_ns / 1e6,
            done.total_ns / 1e6,
        )
        bytes_in, bytes_out = request.ByteSize(), reply.ByteSize()
        compute_s = done.compute_ns / 1e9
        host.metrics.forwarded(kind, done.rows, compute_s, done.total_ns / 1e9, bytes_in, bytes_out)
        host.usage.forwarded(
            frame.session_id,
            frame.epoch,
            kind,
            done.rows,
            bytes_in,
            bytes_out,
            compute_s,
            frame.drafts,
            frame.kept_drafts,
        )

    def check_open(self, session_id: str, epoch: int) -> None:
        """``UnknownSession`` / ``StaleEpoch`` unless ``(session_id, epoch)`` is open here."""
        self._host.table.check_open(session_id, epoch)

    async def refuse_undecodable(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        request: Any,
        what: str,
        *,
        hop: int | None = None,
    ) -> None:
        """Refuses a request whose bytes were not a valid message (returns if they were)."""
        if isinstance(request, Undecodable):
            error = FrameRejected(f"DGR_E_FRAME: not a valid message: {request.what}")
            await self.refuse(context, error, request, what, hop=hop)

    async def refuse(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        exc: Exception,
        request: Any,
        what: str,
        *,
        hop: int | None = None,
    ) -> NoReturn:
        """Aborts the call with the code and dgr-status for ``exc`` (never returns), and, for a
        chained frame, the ``hop`` (this stage's index) that refused it. Only the worker's own
        faults count against its health (``dgr_engine.status.is_worker_fault``); a typed refusal is
        logged as one escaped line, anything else with its traceback."""
        host = self._host
        log = bind_request(host.log, request)
        code, status = grpc_status_for(exc)
        host.metrics.refusals.labels(status).inc()
        if is_worker_fault(exc):
            host.meter.error()  # the advert's health counts the worker's own faults only
        details = _details(exc, status)
        if isinstance(exc, ShardError) or status != "DGR_E_INTERNAL":  # any typed refusal
            log.warning(
                "{} refused: {} {}", what, code.name, log_field(details, limit=_DETAILS_LOGGED)
            )
        else:
            log.opt(exception=exc).error("{} failed: {!r}", what, exc)
        trailers = refusal_trailers(exc, status)
        if hop is not None:
            trailers += ((CHAIN_HOP_KEY, str(max(hop, 0))),)
        await context.abort(code, details, trailing_metadata=trailers)
        raise AssertionError("unreachable: abort raises")
