"""The ``dgr.shard.v1.Shard`` service of a :class:`~dgr_engine.worker.server.ShardWorker`: each
call checked, run on the engine, answered; each refusal aborted with its gRPC code and
``dgr-status`` (``dgr_engine.wire.status``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from dgr_engine.errors import FrameRejected, ShardError
from dgr_engine.wire import frames
from dgr_engine.wire.advert import advert_to_proto
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.wire.status import grpc_status_for, is_worker_fault, refusal_trailers
from dgr_engine.worker.peer_limits import client_identity
from dgr_engine.worker.registration import Undecodable
from dgr_session.identifiers import is_valid_session_id, log_field

if TYPE_CHECKING:
    from loguru import Logger

    from dgr_engine.worker.chain import ChainHub
    from dgr_engine.worker.server import ShardWorker

_DETAILS_LOGGED = 1000
"""Characters of a refusal's reason a log line keeps (escaped: ``log_field``)."""


def bind_request(log: Logger, request: Any) -> Logger:
    """``log`` bound to the session and epoch a request names, escaped (``log_field``): a
    session id is peer-supplied text until checked, and must never forge a log line."""
    return log.bind(
        session=log_field(getattr(request, "session_id", "-")),
        epoch=log_field(getattr(request, "epoch", "-")),
    )


def _deadline(context: grpc.aio.ServicerContext[Any, Any]) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _details(exc: BaseException, status: str) -> str:
    text = str(exc)
    return text if text.startswith(status) else f"{status}: {text}"


class ShardServicer(shard_pb2_grpc.ShardServicer):
    """The ``Shard`` service over one :class:`ShardWorker`."""

    def __init__(self, worker: ShardWorker) -> None:
        self.w = worker
        self.chain: ChainHub | None = None
        """Links and output streams of chained routes (``worker/chain.py``), once registered."""

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.Advert:
        await self._refuse_undecodable(context, request, "describe")
        return advert_to_proto(self.w.advert())

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OpenSessionReply:
        await self._refuse_undecodable(context, request, "open")
        log = bind_request(self.w.log, request)
        try:
            frames.check_session_id(request.session_id)
            frames.check_expectations(request.expect, self.w.expect)
            client = client_identity(context.peer(), context.auth_context())
            self.w.limits.check_open(client, request.session_id)
            if not self.w.grants.enabled:  # without grants, a held session is its client's
                self.w.limits.check_owner(client, request.session_id)
            grant = self.w.admit_grant(request.grant, request.session_id, int(request.epoch))
            try:
                discarded = await self.w.open_session(
                    request.session_id, int(request.epoch), wait=context.time_remaining()
                )
            except BaseException:
                self.w.grants.refund(grant)
                raise
            self.w.limits.opened(client, request.session_id)
            secret = self.w.grants.opened(request.session_id, int(request.epoch))
            self.w.usage.opened(request.session_id, secret)
        except asyncio.CancelledError:
            if is_valid_session_id(request.session_id):  # else nothing was opened
                self.w.abandon(request.session_id, int(request.epoch), "open cancelled")
            raise
        except Exception as exc:
            await self._refuse(context, exc, request, "open")
        log.info("session opened{}", " (older epoch discarded)" if discarded else "")
        return pb.OpenSessionReply(
            session_id=request.session_id, epoch=request.epoch, session_secret=secret
        )

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CloseSessionReply:
        await self._refuse_undecodable(context, request, "close")
        log = bind_request(self.w.log, request)
        try:
            frames.check_session_id(request.session_id)
            held = self.w.grants.held_epoch(request.session_id)
            if not self.w.grants.enabled and held is not None and held < request.epoch:
                # A close of a newer epoch than the one held may come from a client that never
                # got the held epoch's secret (that open's reply was lost). It has the authority
                # an open of its epoch has, which discards the held one too: the session's
                # owner's (without grants; OpenSession checks the same).
                client = client_identity(context.peer(), context.auth_context())
                self.w.limits.check_owner(client, request.session_id, "close")
            else:
                self.w.grants.check(
                    request.session_id, int(request.epoch), request.session_secret, close=True
                )
            closed = await self.w.close_session(request.session_id, int(request.epoch))
            self.w.grants.closed(request.session_id, int(request.epoch))
            if self.chain is not None:
                self.chain.closed(request.session_id, int(request.epoch))
        except Exception as exc:
            await self._refuse(context, exc, request, "close")
        log.info("session closed{}", "" if closed == request.epoch else f" (epoch {closed})")
        return pb.CloseSessionReply(session_id=request.session_id, epoch=request.epoch)

    async def Usage(
        self, request: pb.UsageRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.UsageReply:
        await self._refuse_undecodable(context, request, "usage")
        try:
            frames.check_session_id(request.session_id)
            if request.held:  # a stage confirming its next stage (Chain.Link)
                self.w.grants.check_held(
                    request.session_id, int(request.epoch), request.session_secret
                )
                return pb.UsageReply()
            if not self.w.permits_usage(request.grant, request.session_id):
                self.w.usage.check(request.session_id, request.session_secret)
        except Exception as exc:
            await self._refuse(context, exc, request, "usage")
        return self.w.usage.reply(request.session_id)

    async def Forward(
        self, request: pb.ForwardRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ForwardReply:
        await self._refuse_undecodable(context, request, "forward")
        try:
            return await self._forward(request, _deadline(context))
        except asyncio.CancelledError:
            if is_valid_session_id(request.session_id):  # else nothing ran
                self.w.abandon(request.session_id, int(request.epoch), "forward cancelled")
            raise
        except Exception as exc:
            await self._refuse(context, exc, request, f"forward step {request.step}")

    async def ForwardStream(
        self,
        requests: AsyncIterator[pb.ForwardRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ForwardReply]:
        last: pb.ForwardRequest | None = None
        try:
            async for request in requests:
                await self._refuse_undecodable(context, request, "forward (stream)")
                last = request
                try:
                    reply = await self._forward(request, None)
                except Exception as exc:
                    what = f"forward step {request.step} (stream)"
                    await self._refuse(context, exc, request, what)
                yield reply
        except (asyncio.CancelledError, GeneratorExit):
            if last is not None and is_valid_session_id(last.session_id):
                self.w.abandon(last.session_id, int(last.epoch), "stream cancelled")
            raise

    async def _forward(self, request: pb.ForwardRequest, deadline: float | None) -> pb.ForwardReply:
        """One frame: check, run on the engine (``ShardWorker.run_forward``), encode; raises
        on refusal."""
        began = time.perf_counter_ns()
        w = self.w
        frames.check_session_id(request.session_id)  # before it reaches any table or log
        # well-formed first (the same answer for anyone; nothing touched), then authorised
        frame = frames.decode_forward(request, w.expect, w.info)
        w.grants.check(request.session_id, int(request.epoch), request.session_secret)
        w.limits.check_frame(request.session_id)
        if request.timeout_ms:
            own = time.monotonic() + request.timeout_ms / 1000
            deadline = own if deadline is None else min(deadline, own)
        w.meter.admitted()
        rows = 0
        try:
            out, next_pos, queue_ns, compute_ns = await w.run_forward(frame, deadline)
            rows = frame.n_rows
        finally:
            w.meter.finished(rows)
        reply = pb.ForwardReply(
            session_id=frame.session_id,
            epoch=frame.epoch,
            step=frame.step,
            kind=pb.OUTPUT_KIND_LOGITS if w.info.is_last else pb.OUTPUT_KIND_BOUNDARY,
            next_pos=next_pos,
        )
        frames.fill_tensor(reply.output, out)
        reply.timings.queue_us = queue_ns // 1000
        reply.timings.compute_us = compute_ns // 1000
        total_ns = time.perf_counter_ns() - began
        reply.timings.total_us = total_ns // 1000
        kind = frames.ROW_KIND_NAMES.get(request.kind, "unspecified")
        w.log.bind(session=frame.session_id, epoch=frame.epoch, step=frame.step).debug(
            "forward {} rows ({}) at {}: engine {:.2f} ms, frame {:.2f} ms",
            rows,
            kind,
            int(request.expected_next_pos),
            compute_ns / 1e6,
            total_ns / 1e6,
        )
        bytes_in, bytes_out = request.ByteSize(), reply.ByteSize()
        w.metrics.forwarded(kind, rows, compute_ns / 1e9, total_ns / 1e9, bytes_in, bytes_out)
        w.usage.forwarded(
            frame.session_id, frame.epoch, kind, rows, bytes_in, bytes_out, compute_ns / 1e9
        )
        return reply

    async def _refuse_undecodable(
        self, context: grpc.aio.ServicerContext[Any, Any], request: Any, what: str
    ) -> None:
        """Refuses a request whose bytes were not a valid message (returns if they were)."""
        if isinstance(request, Undecodable):
            error = FrameRejected(f"DGR_E_FRAME: not a valid message: {request.what}")
            await self._refuse(context, error, request, what)

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        exc: Exception,
        request: Any,
        what: str,
    ) -> NoReturn:
        """Aborts the call with the code and dgr-status for ``exc`` (never returns). Only the
        worker's own faults count against its health (``wire.status.is_worker_fault``); a
        typed refusal is logged as one escaped line, anything else with its traceback."""
        log = bind_request(self.w.log, request)
        code, status = grpc_status_for(exc)
        self.w.metrics.refusals.labels(status).inc()
        if is_worker_fault(exc):
            self.w.meter.error()  # the advert's health counts the worker's own faults only
        if isinstance(exc, ShardError) or status != "DGR_E_INTERNAL":  # any typed refusal
            reason = log_field(_details(exc, status), limit=_DETAILS_LOGGED)
            log.warning("{} refused: {} {}", what, code.name, reason)
        else:
            log.opt(exception=exc).error("{} failed: {!r}", what, exc)
        await context.abort(
            code, _details(exc, status), trailing_metadata=refusal_trailers(exc, status)
        )
        raise AssertionError("unreachable: abort raises")
