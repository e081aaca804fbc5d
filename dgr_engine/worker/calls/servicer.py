"""The ``dgr.shard.v1.Shard`` service of a worker: each call checked, run, answered; each
refusal aborted with its gRPC code and ``dgr-status`` (``dgr_engine.wire.status``). Forward
frames take the per-frame path (``worker/calls/frame_path.py``); what the session calls need of the
worker is :class:`ShardHost` (``ShardWorker`` is one)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from dgr_engine.errors import EngineError
from dgr_engine.security.grants import Grant
from dgr_engine.wire import frames
from dgr_engine.wire.advert import Advert, advert_to_proto
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.worker.calls.frame_path import FramePath, bind_request, deadline_of
from dgr_engine.worker.lifecycle.grant_gate import GrantGate
from dgr_engine.worker.lifecycle.peer_limits import PeerLimits, client_identity
from dgr_engine.worker.reporting.usage import UsageBook
from dgr_session.identifiers import is_valid_session_id
from dgr_session.prefixes import PrefixRef
from dgr_session.sampling import Sampling

if TYPE_CHECKING:
    from loguru import Logger


class ShardHost(Protocol):
    """What the ``Shard`` service's session calls need of the worker."""

    @property
    def expect(self) -> frames.Expectations:
        """What an open must state (model, layers, widths, schema)."""
        ...

    @property
    def log(self) -> Logger:
        """The worker's log (bound to its stage)."""
        ...

    @property
    def grants(self) -> GrantGate:
        """Grants at open, session secrets after."""
        ...

    @property
    def limits(self) -> PeerLimits:
        """Sessions per client identity, and who holds a session."""
        ...

    @property
    def usage(self) -> UsageBook:
        """Usage records, served to a session's holder."""
        ...

    def advert(self) -> Advert:
        """The capability advert now."""
        ...

    def admit_grant(self, token: bytes, session_id: str, epoch: int) -> Grant | None:
        """The route grant that permits this open (spent); raises when none does."""
        ...

    async def open_session(
        self, session_id: str, epoch: int, sampling: Sampling, *, wait: float | None
    ) -> bool:
        """Opens the epoch with the session's sampler (waiting in line for a slot); True if an
        older one was discarded."""
        ...

    async def close_session(self, session_id: str, epoch: int) -> int:
        """Closes the epoch (or an older one held); returns the epoch closed."""
        ...

    async def keep_prefix(self, session_id: str, epoch: int, client: str, keep: PrefixRef) -> bool:
        """Keeps the open epoch's first positions for ``client`` (``docs/prefix-cache.md``)."""
        ...

    async def start_from_prefix(
        self, session_id: str, epoch: int, client: str, prefix: PrefixRef
    ) -> int:
        """Sets the open epoch to a prefix ``client`` kept (or empty); the positions held."""
        ...

    def permits_usage(self, token: bytes, session_id: str) -> bool:
        """Whether ``token`` is the tracker's credential for the session's usage here."""
        ...

    def abandon(self, session_id: str, epoch: int, why: str) -> None:
        """A call of the epoch was cancelled by its caller: the epoch is closed."""
        ...


class ShardServicer(shard_pb2_grpc.ShardServicer):
    """The ``Shard`` service over one worker's sessions (``host``) and frame path."""

    def __init__(self, host: ShardHost, path: FramePath) -> None:
        self.host = host
        self.path = path

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.Advert:
        await self.path.refuse_undecodable(context, request, "describe")
        return advert_to_proto(self.host.advert())

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OpenSessionReply:
        await self.path.refuse_undecodable(context, request, "open")
        log = bind_request(self.host.log, request)
        try:
            frames.check_session_id(request.session_id)
            frames.check_expectations(request.expect, self.host.expect)
            sampling = frames.sampling_from_proto(request.sampling, request.HasField("sampling"))
            client = client_identity(context.peer(), context.auth_context())
            self.host.limits.check_open(client, request.session_id)
            if not self.host.grants.enabled:  # without grants, a held session is its client's
                self.host.limits.check_owner(client, request.session_id)
            grant = self.host.admit_grant(request.grant, request.session_id, int(request.epoch))
            try:
                discarded = await self.host.open_session(
                    request.session_id,
                    int(request.epoch),
                    sampling,
                    wait=context.time_remaining(),
                )
            except BaseException:
                self.host.grants.refund(grant)
                raise
            self.host.limits.opened(client, request.session_id)
            next_pos = 0
            if request.HasField("prefix"):
                prefix = frames.prefix_from_proto(request.prefix)
                next_pos = await self.host.start_from_prefix(
                    request.session_id, int(request.epoch), client, prefix
                )
            secret = self.host.grants.opened(request.session_id, int(request.epoch))
            self.host.usage.opened(request.session_id, int(request.epoch), secret, sampling)
        except asyncio.CancelledError:
            if is_valid_session_id(request.session_id):  # else nothing was opened
                self.host.abandon(request.session_id, int(request.epoch), "open cancelled")
            raise
        except Exception as exc:
            await self.path.refuse(context, exc, request, "open")
        log.info(
            "session opened{}{}",
            " (older epoch discarded)" if discarded else "",
            f" from a kept prefix of {next_pos} positions" if next_pos else "",
        )
        return pb.OpenSessionReply(
            session_id=request.session_id,
            epoch=request.epoch,
            next_pos=next_pos,
            session_secret=secret,
        )

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CloseSessionReply:
        await self.path.refuse_undecodable(context, request, "close")
        log = bind_request(self.host.log, request)
        try:
            frames.check_session_id(request.session_id)
            held = self.host.grants.held_epoch(request.session_id)
            reply_lost = held is not None and (
                held < request.epoch
                or not self.host.grants.knows(request.session_id, held, request.session_secret)
            )
            if not self.host.grants.enabled and reply_lost:
                # A close of the held epoch or a newer one may come from a client that never got
                # the held epoch's secret (that open's reply was lost: it timed out at a stalled
                # worker, which then opened it). It has the authority an open of its epoch has,
                # which discards the held one too (a re-open of the held epoch is allowed and
                # answers a new secret): the session's owner's (without grants; OpenSession
                # checks the same). With grants the secret is needed; the lease frees the slot.
                client = client_identity(context.peer(), context.auth_context())
                self.host.limits.check_owner(client, request.session_id, "close")
            else:
                self.host.grants.check(
                    request.session_id, int(request.epoch), request.session_secret, close=True
                )
            if request.HasField("keep_prefix"):
                keep = frames.prefix_from_proto(request.keep_prefix)
                holder = client_identity(context.peer(), context.auth_context())
                try:
                    await self.host.keep_prefix(
                        request.session_id, int(request.epoch), holder, keep
                    )
                except EngineError as exc:  # nothing kept; the close goes on
                    log.warning("prefix not kept: {}", exc)
            # the grant gate, the limits and the chain hub hear of it from the session table
            closed = await self.host.close_session(request.session_id, int(request.epoch))
        except Exception as exc:
            await self.path.refuse(context, exc, request, "close")
        log.info("session closed{}", "" if closed == request.epoch else f" (epoch {closed})")
        return pb.CloseSessionReply(session_id=request.session_id, epoch=request.epoch)

    async def Usage(
        self, request: pb.UsageRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.UsageReply:
        await self.path.refuse_undecodable(context, request, "usage")
        try:
            frames.check_session_id(request.session_id)
            if request.held:  # a stage confirming its next stage (Chain.Link)
                self.host.grants.check_held(
                    request.session_id, int(request.epoch), request.session_secret
                )
                return pb.UsageReply()
            if not self.host.permits_usage(request.grant, request.session_id):
                self.host.usage.check(request.session_id, request.session_secret)
        except Exception as exc:
            await self.path.refuse(context, exc, request, "usage")
        return self.host.usage.reply(request.session_id)

    async def Forward(
        self, request: pb.ForwardRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ForwardReply:
        await self.path.refuse_undecodable(context, request, "forward")
        try:
            return await self.path.forward(request, deadline_of(context))
        except asyncio.CancelledError:
            if is_valid_session_id(request.session_id):  # else nothing ran
                self.host.abandon(request.session_id, int(request.epoch), "forward cancelled")
            raise
        except Exception as exc:
            await self.path.refuse(context, exc, request, f"forward step {request.step}")

    async def ForwardStream(
        self,
        requests: AsyncIterator[pb.ForwardRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ForwardReply]:
        last: pb.ForwardRequest | None = None
        try:
            async for request in requests:
                await self.path.refuse_undecodable(context, request, "forward (stream)")
                last = request
                try:
                    reply = await self.path.forward(request, None)
                except Exception as exc:
                    what = f"forward step {request.step} (stream)"
                    await self.path.refuse(context, exc, request, what)
                yield reply
        except (asyncio.CancelledError, GeneratorExit):
            if last is not None and is_valid_session_id(last.session_id):
                self.host.abandon(last.session_id, int(last.epoch), "stream cancelled")
            raise
