"""A close that overtakes its open (the worker handled them out of order after a stall) leaves no
slot behind: the worker remembers the close and refuses the late open."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from dgr_engine import errors as E
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.wire.frames import expectations_to_proto
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.wire.status import STATUS_KEY
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_engine.worker.lifecycle.tombstones import Tombstones

KW = {"max_sessions": 2, "n_ctx_per_session": 64, "n_threads": 1, "n_batch": 16}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_tombstone_blocks_that_epoch_and_older_for_its_time_only() -> None:
    clock = Clock()
    stones = Tombstones(clock, ttl=10.0, limit=2)
    stones.record("a", 3)
    assert stones.blocks("a", 3) and stones.blocks("a", 1)
    assert not stones.blocks("a", 4)  # a newer epoch is a new open
    assert not stones.blocks("b", 3)
    stones.record("a", 2)  # an older close never lowers what is kept
    assert stones.blocks("a", 3)
    clock.now += 10.0
    assert not stones.blocks("a", 3) and len(stones) == 0
    for name in ("x", "y", "z"):
        stones.record(name, 1)
    assert len(stones) == 2 and not stones.blocks("x", 1)  # bounded: the oldest went first


def test_an_open_after_its_close_is_refused_and_takes_no_slot(tiny_llama: Path) -> None:
    worker = ShardWorker.load(tiny_llama, (0, 2), config=WorkerConfig(port=0), **KW)

    async def scenario() -> None:
        address = await worker.start()
        try:
            async with ShardClient(address, timeout=20.0) as client:
                expect = expectations_of(await client.describe())
                with pytest.raises(E.UnknownSession):
                    await client.close("late", 4)  # the close arrives first: nothing open
                with pytest.raises(E.StaleEpoch, match="closed by its client before this open"):
                    await client.open("late", 4, expect)
                with pytest.raises(E.StaleEpoch):
                    await client.open("late", 3, expect)
                assert worker.table.snapshot().sessions_open == 0
                assert worker.meter.snapshot().total_errors == 0  # the client's doing
                await client.open("late", 5, expect)  # its next epoch opens as ever
                assert worker.table.snapshot().sessions_open == 1
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = shard_pb2_grpc.ShardStub(channel)
                    with pytest.raises(grpc.aio.AioRpcError):
                        await stub.CloseSession(pb.CloseSessionRequest(session_id="raw", epoch=1))
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.OpenSession(
                            pb.OpenSessionRequest(
                                session_id="raw", epoch=1, expect=expectations_to_proto(expect)
                            )
                        )
                    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    trailers = dict(info.value.trailing_metadata() or ())
                    assert trailers[STATUS_KEY] == "DGR_E_STALE_EPOCH"
        finally:
            await worker.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
