"""The frame link implementation of the chained data path (``client/channel.py``): a stage's
``Chain`` calls over its frame link (``wire/frame_link.py``). A call that ends with a status
other than OK leaves as a :class:`~dgr_engine.client.channel.StageFailure`: the typed error of
its ``dgr-status`` (``wire/status.py``) and the stage its ``dgr-chain-hop`` names.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dgr_engine.client.channel import ChannelOver, Metadata, StageFailure
from dgr_engine.wire.frame_link import FrameLinkCall, FrameLinkTarget, LinkCallFailed
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.status import chain_hop_of, error_from_number

__all__ = ["FrameLinkChainChannel"]


def _failure(failed: LinkCallFailed, default_hop: int) -> StageFailure:
    error = error_from_number(failed.code, failed.trailers, failed.details)
    return StageFailure(chain_hop_of(failed.trailers, default_hop), error)


class _Frames:
    def __init__(self, call: FrameLinkCall[Any]) -> None:
        self._call = call

    async def send(self, request: pb.ForwardRequest) -> None:
        try:
            await self._call.write(request)
        except asyncio.InvalidStateError as exc:
            raise ChannelOver(repr(exc)) from exc

    async def finish(self) -> None:
        try:
            await self._call.done_writing()
        except asyncio.InvalidStateError:
            pass

    async def end(self) -> None:
        try:
            while await self._call.read() is not None:
                pass  # nothing is answered while all goes well
        except LinkCallFailed as failed:
            raise _failure(failed, 0) from None

    def cancel(self) -> None:
        self._call.cancel()


class _Outcomes:
    def __init__(self, call: FrameLinkCall[Any], hop: int) -> None:
        self._call, self._hop = call, hop

    async def next(self) -> pb.ChainOutputReply | None:
        try:
            reply: pb.ChainOutputReply | None = await self._call.read()
        except LinkCallFailed as failed:
            raise _failure(failed, self._hop) from None
        return reply

    def cancel(self) -> None:
        self._call.cancel()


class FrameLinkChainChannel:
    """A stage's chained calls over its frame link (``target``)."""

    def __init__(self, target: FrameLinkTarget, endpoint: str) -> None:
        self._target = target
        self.endpoint = endpoint

    def frames(self, metadata: Metadata) -> _Frames:
        return _Frames(self._target.ChainStream(metadata=metadata))

    def outcomes(self, request: pb.ChainOutputRequest, metadata: Metadata, hop: int) -> _Outcomes:
        return _Outcomes(self._target.ChainOutput(request, metadata=metadata), hop)
