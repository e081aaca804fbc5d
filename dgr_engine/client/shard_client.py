"""A typed asyncio client for one shard worker (``dgr.shard.v1.Shard``).

Every failed call raises the typed refusal the worker's engine raised (an ``EngineError``:
``StaleEpoch``, ``UnknownSession``, ``CapacityExceeded``, ...), read back from the ``dgr-status``
trailing metadata, or one of the client's own transport errors of ``dgr_engine.errors`` (a
``ShardTransportError``: ``ShardUnavailable`` is a ``dgr_session.errors.StageDead``,
``ShardDeadlineExceeded`` a ``TimeoutError``). Each call has
a deadline (``timeout``, per call or the client's default). A session id that breaks
``dgr_session.identifiers``' rule is refused with ``InvalidIdentifier`` before any call, and a
call gRPC fails in this process (nothing sent) raises ``ClientCallError``: both are the
client's faults (``client``), never the worker's.

::

    async with ShardClient("127.0.0.1:50051") as shard:
        advert = await shard.describe()
        expect = expectations_of(advert)
        await shard.open("s1", 0, expect)
        result = await shard.forward("s1", 0, 0, expect, range(16), tokens=prompt)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import attrs
import grpc
import numpy as np
import numpy.typing as npt
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dgr_engine.client.channel import StageFailure
from dgr_engine.errors import (
    ClientCallError,
    FrameRejected,
    ShardDeadlineExceeded,
    ShardError,
    ShardRpcError,
    ShardTransportError,
    ShardUnavailable,
)
from dgr_engine.security.tls import ClientTls
from dgr_engine.status import Status
from dgr_engine.wire.advert import Advert, advert_from_proto
from dgr_engine.wire.frames import (
    SCHEMA_VERSION,
    Expectations,
    FloatRows,
    Frame,
    encode_frame,
    expectations_to_proto,
    output_from_reply,
    sampled_from_reply,
    sampling_from_proto,
    sampling_to_proto,
)
from dgr_engine.wire.keepalive import GRPC_CHANNEL_OPTIONS
from dgr_engine.wire.metadata import DEFAULT_MAX_MESSAGE_BYTES, session_metadata
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.wire.status import STATUS_KEY, error_from_trailers
from dgr_session.errors import DgrError
from dgr_session.identifiers import check_session_id
from dgr_session.prefixes import PrefixRef
from dgr_session.sampling import Sampling
from dgr_session.usage import UsageRecord

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "SCHEMA_VERSION",
    "Expectations",
    "ForwardResult",
    "ShardClient",
    "WorkerTimings",
    "client_call_error",
    "expectations_of",
    "session_metadata",
]


USAGE_SECRETS_KEPT = 4096
"""Sessions whose last secret a client keeps after their close, for ``usage``."""

_NO_ROWS: FloatRows = np.zeros((0, 0), dtype=np.float32)
"""The output of a reply that carries sampled tokens instead of logits rows."""


def expectations_of(advert: Advert) -> Expectations:
    """What to expect of the worker that sent ``advert``."""
    return Expectations(
        model_sha256=advert.identity.content_hash,
        layer_begin=advert.span.layer_begin,
        layer_end=advert.span.layer_end,
        boundary_width=advert.seam.width_in,
        schema_version=advert.schema_version,
    )


@attrs.frozen
class WorkerTimings:
    """Where the worker spent a forward, in microseconds."""

    queue_us: int
    """Waiting for the engine."""
    compute_us: int
    """In the engine."""
    total_us: int
    """In the handler, decode and encode included."""
    native_us: int = 0
    """Of ``compute_us``, inside llama.cpp (0: a worker that does not say)."""


@attrs.frozen
class ForwardResult:
    """One forward's answer."""

    output: FloatRows = attrs.field(repr=False)
    """Boundary rows ``[n, width]`` or logits ``[n_wanted, n_vocab]`` (read-only view)."""
    is_logits: bool
    """The worker is the last stage."""
    next_pos: int
    """The session's next position on the worker."""
    step: int
    """The request's step, echoed."""
    timings: WorkerTimings
    rtt_us: int
    """Round trip seen by the client (encode, call, decode)."""
    mtp_drafts: tuple[int, tuple[int, ...]] | None = None
    """A last stage's MTP drafts (``mtp_draft_max``): the position of the token they follow,
    and the drafts; ``None``: none came."""
    wire_us: int = 0
    """Part of ``rtt_us`` inside gRPC: from the request handed to it (serialised there) to the
    reply handed back (parsed there). ``wire_us - timings.total_us`` is the transit both ways;
    ``rtt_us - wire_us`` is this client's own code."""
    sampled: tuple[int, ...] | None = None
    """A last stage asked for the session's tokens (``sampled_tokens``): the token of each
    wanted row, and ``output`` is empty (``[0, 0]``); ``None``: it answered logits."""


def mtp_drafts_of(reply: pb.ForwardReply) -> tuple[int, tuple[int, ...]] | None:
    """A reply's MTP drafts: (the position of the token they follow, the drafts); ``None``
    when it carries none."""
    if not reply.mtp_drafts:
        return None
    return int(reply.mtp_draft_pos), tuple(int(t) for t in reply.mtp_drafts)


class ShardClient:
    """One channel to one worker. Use ``async with`` or ``await aclose()``.

    ``streaming`` (default): forwards go over one ``ForwardStream`` per session, about half the
    per-frame cost of unary calls; a refused frame ends that session's stream (the error is
    raised as for a unary call) and the next forward opens a new one. Forwards of one session
    are serialized; different sessions run concurrently. ``streaming=False`` uses unary
    ``Forward`` calls. ``tls``: dial the worker over TLS, trusting that CA (and showing that
    client certificate to a worker that asks for one); ``None``: plaintext.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        streaming: bool = True,
        tls: ClientTls | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.streaming = streaming
        self._streams: dict[str, _SessionStream] = {}
        # session id -> (epoch, secret) the worker answered the open with
        self._secrets: dict[str, tuple[int, bytes]] = {}
        # session id -> the last secret an open answered, kept after the close for usage()
        # (the newest USAGE_SECRETS_KEPT sessions)
        self._usage_secrets: dict[str, bytes] = {}
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            *GRPC_CHANNEL_OPTIONS,  # a silent worker is found out (wire/keepalive.py)
        ]
        if tls is None:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        else:
            options += tls.channel_options()
            self._channel = grpc.aio.secure_channel(target, tls.credentials(), options=options)
        self._stub = shard_pb2_grpc.ShardStub(self._channel)
        self.chain = shard_pb2_grpc.ChainStub(self._channel)
        """The worker's ``Chain`` service over this client's channel (chained routes:
        ``dgr_engine.client.chained``)."""
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def __aenter__(self) -> ShardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancels this client's streams and closes the channel. A worker closes the sessions
        a cancelled stream carried (their client is gone): close sessions first to keep none
        open beyond this client."""
        for stream in self._streams.values():
            stream.cancel()
        self._streams.clear()
        await self._channel.close()

    # -- calls -------------------------------------------------------------------------------

    async def serving(self, *, timeout: float | None = None) -> bool:
        """True if the worker's health service says SERVING (False if not, or unreachable)."""
        try:
            await self.require_serving(timeout=timeout)
        except ShardTransportError:
            return False
        return True

    async def require_serving(self, *, timeout: float | None = None) -> None:
        """Returns once the worker's health service says SERVING; else raises why not: the
        typed error of a call that got no answer (``ShardUnavailable``: nothing listens, the
        connection failed; ``ShardDeadlineExceeded``), or ``ShardUnavailable`` naming the
        status it answered (shutting down)."""
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(service="dgr.shard.v1.Shard"),
                timeout=timeout if timeout is not None else self.timeout,
            )
        except grpc.aio.AioRpcError as exc:
            error = _error_of(exc)
            if isinstance(error, ShardTransportError):
                raise error from exc
            raise ShardRpcError(f"health check: {error}", status=error.status) from exc
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            raise ShardUnavailable(f"the worker answers {name}, not SERVING")

    async def describe(self, *, timeout: float | None = None) -> Advert:
        """The worker's capability advert."""
        reply = await self._call(self._stub.Describe, pb.DescribeRequest(), timeout)
        return advert_from_proto(reply)

    async def usage(
        self, session_id: str, *, grant: bytes = b"", timeout: float | None = None
    ) -> list[UsageRecord]:
        """The worker's own usage records of ``session_id``, per epoch (none if it has none).
        The worker answers the session's holder: this client sends the secret its last open
        of the session answered; ``grant``: the tracker's credential instead
        (``GrantIssuer.usage_grant``). Refused (``GrantUnauthenticated``) otherwise."""
        check_session_id(session_id)
        request = pb.UsageRequest(
            session_id=session_id,
            session_secret=self._usage_secrets.get(session_id, b""),
            grant=grant,
        )
        reply = await self._call(self._stub.Usage, request, timeout)
        return [
            UsageRecord(
                session_id=r.session_id,
                epoch=int(r.epoch),
                stage_index=-1,  # the worker does not know the route
                endpoint=self.target,
                layers=(int(r.layer_begin), int(r.layer_end)),
                forwards=int(r.forwards),
                rows_prefill=int(r.rows_prefill),
                rows_decode=int(r.rows_decode),
                rows_replay=int(r.rows_replay),
                bytes_in=int(r.bytes_in),
                bytes_out=int(r.bytes_out),
                engine_seconds=float(r.engine_seconds),
                replay_cause=None,
                rows_draft=int(r.rows_draft),
                rows_rejected=int(r.rows_rejected),
                sampling=sampling_from_proto(r.sampling, r.HasField("sampling")),
            )
            for r in reply.records
        ]

    async def open(
        self,
        session_id: str,
        epoch: int,
        expect: Expectations,
        *,
        grant: bytes = b"",
        timeout: float | None = None,
        sampling: Sampling | None = None,
        prefix: PrefixRef | None = None,
    ) -> int:
        """Opens ``(session_id, epoch)``; a newer epoch discards the older one's state.
        ``grant``: the tracker's route grant, for a worker that needs one; the session secret
        it answers with goes with this epoch's frames and close. ``sampling``: the session's
        sampler, which the last stage applies (``docs/sampling.md``; ``None``: greedy).
        ``prefix``: start from a prompt prefix the stage kept (``docs/prefix-cache.md``).
        Returns the positions the epoch holds (0 unless it started from ``prefix``)."""
        check_session_id(session_id)
        request = pb.OpenSessionRequest(
            session_id=session_id, epoch=epoch, expect=expectations_to_proto(expect), grant=grant
        )
        if sampling is not None and not sampling.is_greedy:
            request.sampling.CopyFrom(sampling_to_proto(sampling))
        if prefix is not None:
            request.prefix.CopyFrom(pb.PrefixRef(digest=prefix.digest, length=prefix.length))
        reply = await self._call(self._stub.OpenSession, request, timeout)
        self._check_echo(reply, session_id, epoch)
        if reply.session_secret:
            self._secrets[session_id] = (epoch, reply.session_secret)
            self._usage_secrets.pop(session_id, None)
            self._usage_secrets[session_id] = reply.session_secret
            while len(self._usage_secrets) > USAGE_SECRETS_KEPT:
                del self._usage_secrets[next(iter(self._usage_secrets))]
        else:
            self._secrets.pop(session_id, None)
        return int(reply.next_pos)

    async def close(
        self,
        session_id: str,
        epoch: int,
        *,
        timeout: float | None = None,
        secret: bytes | None = None,
        keep: PrefixRef | None = None,
    ) -> None:
        """Closes ``(session_id, epoch)`` and frees its state on the worker (with ``secret``:
        the secret another client's open answered, to close a session under that client;
        ``keep``: the prompt prefix the stage keeps of it first, ``docs/prefix-cache.md``)."""
        check_session_id(session_id)
        stream = self._streams.pop(session_id, None)
        if stream is not None:
            await stream.finish()
        held = self._secrets.get(session_id)
        if secret is None:
            # the close of a newer epoch closes the older one held there: it takes its secret
            secret = held[1] if held is not None and held[0] <= epoch else b""
        request = pb.CloseSessionRequest(session_id=session_id, epoch=epoch, session_secret=secret)
        if keep is not None:
            request.keep_prefix.CopyFrom(pb.PrefixRef(digest=keep.digest, length=keep.length))
        reply = await self._call(self._stub.CloseSession, request, timeout)
        self._check_echo(reply, session_id, epoch)
        held = self._secrets.get(session_id)
        if held is not None and held[0] <= epoch:
            del self._secrets[session_id]

    async def forward(
        self,
        session_id: str,
        epoch: int,
        step: int,
        expect: Expectations,
        positions: Sequence[int] | npt.NDArray[np.integer],
        *,
        logits: bool = True,
        timeout: float | None = None,
        **fields: Any,
    ) -> ForwardResult:
        """Runs rows at ``positions`` (contiguous, continuing the session's KV): the frame
        ``Frame(session_id, epoch, step, expect, positions, **fields)`` (``tokens`` on the
        first stage and where the range needs them, ``boundary`` rows elsewhere, ...), with
        this client's secret for the session and its timeout unless given. The last stage
        returns the logits of ``logit_rows`` (default: the last row); ``logits=False``: none
        (``[0, n_vocab]``; it skips the output head; other stages ignore it)."""
        check_session_id(session_id)
        return await self.send(
            Frame(
                session_id,
                epoch,
                step,
                expect,
                positions,
                no_logits=not logits,
                timeout=timeout if timeout is not None else self.timeout,
                session_secret=self._secret(session_id, epoch),
                **fields,
            )
        )

    async def send(self, frame: Frame) -> ForwardResult:
        """Runs one frame (:class:`~dgr_engine.wire.frames.Frame`, passed whole) and answers
        its result. ``frame.sampled_tokens``: the last stage answers the session's token of
        each wanted row instead of its logits (:attr:`ForwardResult.sampled`)."""
        began = time.perf_counter_ns()
        session_id, epoch, step = frame.session_id, frame.epoch, frame.step
        check_session_id(session_id)
        timeout = frame.timeout
        request = encode_frame(frame)
        if self.streaming:
            reply, wire_ns = await self._stream_call(session_id, request, timeout)
        else:
            sent = time.perf_counter_ns()
            reply = await self._call(self._stub.Forward, request, timeout)
            wire_ns = time.perf_counter_ns() - sent
        self._check_echo(reply, session_id, epoch)
        if reply.step != step:
            raise ShardRpcError(
                f"reply for step {reply.step}, asked {step}", status="DGR_E_PROTOCOL"
            )
        try:
            sampled = sampled_from_reply(reply)
            output = _NO_ROWS if sampled is not None else output_from_reply(reply)
        except FrameRejected as exc:  # the stage's own output: its fault, as on a chain
            raise FrameRejected(f"DGR_E_FRAME: malformed reply: {exc}") from exc
        t = reply.timings
        return ForwardResult(
            output=output,
            is_logits=reply.kind == pb.OUTPUT_KIND_LOGITS,
            next_pos=reply.next_pos,
            step=reply.step,
            timings=WorkerTimings(t.queue_us, t.compute_us, t.total_us, t.native_us),
            rtt_us=(time.perf_counter_ns() - began) // 1000,
            wire_us=wire_ns // 1000,
            mtp_drafts=mtp_drafts_of(reply),
            sampled=sampled,
        )

    async def link(
        self, request: pb.LinkRequest, next_hop: int, timeout: float | None = None
    ) -> None:
        """``Chain.Link``: links this stage of a chained route to the next, of index
        ``next_hop`` (``docs/chain.md``); its refusal is raised as its typed error, except that
        a refusal saying the next stage could not be reached (``DGR_E_UNAVAILABLE`` from the
        worker) is a :class:`~dgr_engine.client.channel.StageFailure` naming that stage."""
        try:
            await self.chain.Link(
                request,
                timeout=timeout if timeout is not None else self.timeout,
                metadata=session_metadata(request),
            )
        except grpc.aio.AioRpcError as exc:
            error = _error_of(exc)
            said = dict(exc.trailing_metadata() or ())
            if said.get(STATUS_KEY) == Status.UNAVAILABLE:
                raise StageFailure(next_hop, error) from exc
            raise error from exc
        except DgrError:
            raise
        except Exception as exc:  # noqa: BLE001 - gRPC failed it here: nothing was sent
            raise client_call_error(exc) from exc

    def session_secret(self, session_id: str, epoch: int) -> bytes:
        """The secret the worker's open of ``(session_id, epoch)`` answered (empty without
        grants, or if this client did not open that epoch)."""
        return self._secret(session_id, epoch)

    # -- internals ---------------------------------------------------------------------------

    def _secret(self, session_id: str, epoch: int) -> bytes:
        held = self._secrets.get(session_id)
        return held[1] if held is not None and held[0] == epoch else b""

    async def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(
                request,
                timeout=timeout if timeout is not None else self.timeout,
                metadata=session_metadata(request),
            )
        except grpc.aio.AioRpcError as exc:
            raise _error_of(exc) from exc
        except DgrError:
            raise
        except Exception as exc:  # noqa: BLE001 - gRPC failed it here: nothing was sent
            raise client_call_error(exc) from exc

    async def _stream_call(
        self, session_id: str, request: pb.ForwardRequest, timeout: float | None
    ) -> tuple[pb.ForwardReply, int]:
        """The reply and the time (ns) inside gRPC, over the session's stream."""
        stream = self._streams.get(session_id)
        if stream is None or stream.done():
            metadata = session_metadata(request)
            try:
                call = self._stub.ForwardStream(metadata=metadata)
            except Exception as exc:  # noqa: BLE001 - gRPC failed it here: nothing was sent
                raise client_call_error(exc) from exc
            stream = _SessionStream(call)
            self._streams[session_id] = stream
        try:
            return await stream.exchange(request, timeout)
        except BaseException:
            # the stream is over (refused frame, timeout, cancellation): never reuse it
            if self._streams.get(session_id) is stream:
                del self._streams[session_id]
            stream.cancel()
            raise

    @staticmethod
    def _check_echo(reply: Any, session_id: str, epoch: int) -> None:
        if reply.session_id != session_id or reply.epoch != epoch:
            raise ShardRpcError(
                f"reply for ({reply.session_id!r}, {reply.epoch}), asked ({session_id!r}, {epoch})",
                status="DGR_E_PROTOCOL",
            )


def client_call_error(exc: BaseException) -> ClientCallError:
    """``exc``, an error gRPC (or protobuf) raised in this process for a call it never sent
    (``ExecuteBatchError`` on invalid metadata, ``UsageError`` on a closed channel, a message
    that does not serialise), as the client's own typed fault."""
    return ClientCallError(f"the call failed in this client, nothing was sent: {exc!r}")


def _error_of(exc: grpc.aio.AioRpcError) -> ShardError:
    return error_from_trailers(exc.code(), exc.trailing_metadata(), exc.details() or "")


class _SessionStream:
    """One session's ``ForwardStream``: one request out, one reply in, one at a time."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self._lock = asyncio.Lock()

    def done(self) -> bool:
        return bool(self.call.done())

    def cancel(self) -> None:
        self.call.cancel()

    async def finish(self) -> None:
        """Half-closes the stream and lets the worker end it."""
        async with self._lock:
            if not self.call.done():
                try:
                    await self.call.done_writing()
                    await asyncio.wait_for(self.call.code(), 5.0)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
                    pass
            self.call.cancel()

    async def exchange(
        self, request: pb.ForwardRequest, timeout: float | None
    ) -> tuple[pb.ForwardReply, int]:
        """Sends ``request``, returns the reply and the ns from the write to the read's end."""
        async with self._lock:
            deadline = asyncio.timeout(timeout)  # no extra task, unlike wait_for
            try:
                async with deadline:
                    return await self._exchange(request)
            except TimeoutError:
                if not deadline.expired():  # the worker's own DGR_E_DEADLINE refusal
                    raise
                raise ShardDeadlineExceeded(
                    f"no reply within {timeout} s (stream cancelled)"
                ) from None

    async def _exchange(self, request: pb.ForwardRequest) -> tuple[pb.ForwardReply, int]:
        try:
            sent = time.perf_counter_ns()
            await self.call.write(request)
            reply = await self.call.read()
            wire_ns = time.perf_counter_ns() - sent
        except grpc.aio.AioRpcError as exc:
            error = _error_of(exc)
            if exc.code() == grpc.StatusCode.INTERNAL and error.status == "GRPC_INTERNAL":
                # gRPC reports a send on a stream whose connection died as INTERNAL, with no
                # dgr-status (a worker's own refusals always carry one); a stream it refused
                # for its metadata does too, but session_metadata refuses those beforehand
                raise ShardUnavailable(f"the stream broke: {exc.debug_error_string()}") from exc
            raise error from exc
        except asyncio.InvalidStateError:
            reply = grpc.aio.EOF
        except DgrError:
            raise
        except Exception as exc:  # noqa: BLE001 - gRPC failed it here: nothing was sent
            raise client_call_error(exc) from exc
        if reply is grpc.aio.EOF:
            code = await self.call.code()
            if code == grpc.StatusCode.OK:
                raise ShardRpcError("the worker ended the stream", status="DGR_E_PROTOCOL")
            trailers = await self.call.trailing_metadata()
            raise error_from_trailers(code, trailers, await self.call.details() or "")
        return reply, wire_ns
