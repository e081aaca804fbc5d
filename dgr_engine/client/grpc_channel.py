"""The gRPC implementation of the chained data path (``client/channel.py``): a stage's ``Chain``
service over gRPC. gRPC's error model ends here: every failure leaves as a
:class:`~dgr_engine.client.channel.StageFailure` with its typed error (``wire/status.py``) and
the stage its ``dgr-chain-hop`` trailer names.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from dgr_engine.client.channel import ChannelOver, Metadata, StageFailure
from dgr_engine.client.shard_client import client_call_error
from dgr_engine.errors import ShardUnavailable
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.status import chain_hop_of, error_from_trailers
from dgr_session.errors import DgrError

__all__ = ["GrpcChainChannel"]


def _failure(exc: grpc.aio.AioRpcError, default_hop: int) -> StageFailure:
    trailers = exc.trailing_metadata()
    error = error_from_trailers(exc.code(), trailers, exc.details() or "")
    return StageFailure(chain_hop_of(trailers, default_hop), error)


async def _ended(call: Any, default_hop: int) -> StageFailure | None:
    """How a call that was read to its end ended: ``None`` for OK."""
    code = await call.code()
    if code == grpc.StatusCode.OK:
        return None
    trailers = await call.trailing_metadata()
    error = error_from_trailers(code, trailers, await call.details() or "")
    return StageFailure(chain_hop_of(trailers, default_hop), error)


def _made_here(exc: Exception) -> DgrError:
    """A call gRPC failed in this process (nothing was sent)."""
    return exc if isinstance(exc, DgrError) else client_call_error(exc)


class _Frames:
    def __init__(self, call: Any) -> None:
        self._call = call

    async def send(self, request: pb.ForwardRequest) -> None:
        try:
            await self._call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise ChannelOver(repr(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - gRPC failed the write here: not sent
            raise _made_here(exc) from exc

    async def finish(self) -> None:
        try:
            await self._call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass

    async def end(self) -> None:
        try:
            while await self._call.read() is not grpc.aio.EOF:
                pass  # nothing is answered while all goes well
            failure = await _ended(self._call, 0)
        except grpc.aio.AioRpcError as exc:
            failure = _failure(exc, 0)
        except asyncio.InvalidStateError:
            return
        if failure is not None:
            raise failure

    def cancel(self) -> None:
        self._call.cancel()


class _Outcomes:
    def __init__(self, call: Any, hop: int) -> None:
        self._call, self._hop = call, hop

    async def next(self) -> pb.ChainOutputReply | None:
        try:
            message = await self._call.read()
            if message is not grpc.aio.EOF:
                return message
            failure = await _ended(self._call, self._hop)
        except grpc.aio.AioRpcError as exc:
            failure = _failure(exc, self._hop)
        except asyncio.InvalidStateError:
            failure = StageFailure(self._hop, ShardUnavailable("the output stream is over"))
        if failure is not None:
            raise failure
        return None

    def cancel(self) -> None:
        self._call.cancel()


class GrpcChainChannel:
    """A stage's chained calls through ``dialer``, its ``Chain`` stub."""

    def __init__(self, dialer: Any, endpoint: str) -> None:
        self._dialer = dialer
        self.endpoint = endpoint

    def frames(self, metadata: Metadata) -> _Frames:
        try:
            return _Frames(self._dialer.ChainStream(metadata=metadata))
        except Exception as exc:  # noqa: BLE001 - gRPC failed the call here: not sent
            raise _made_here(exc) from exc

    def outcomes(self, request: pb.ChainOutputRequest, metadata: Metadata, hop: int) -> _Outcomes:
        try:
            return _Outcomes(self._dialer.ChainOutput(request, metadata=metadata), hop)
        except Exception as exc:  # noqa: BLE001 - gRPC failed the call here: not sent
            raise _made_here(exc) from exc
