"""The fault campaign's leaked slots (issue 28), forced deterministically.

What the campaign's session log showed (schedule ``LEAKING`` in
``tests/e2e/test_fault_campaign.py``, a stage-0 worker stalled for 3 s while every slot was
taken): a session's open of epoch 2 and, after that epoch failed elsewhere, its open of epoch 3
both queued at the stalled worker; the client's close of epoch 2 timed out there and was not
retried (epoch 3's open was sent, which would discard it). When the worker resumed, the open of
epoch 2 took a slot and the open of epoch 3 waited in line for one. The client's close of epoch
3 then found epoch 2, closed it, and freed its slot, and the open of epoch 3 took it: "session
closed (epoch 2)", then "session opened" at epoch 3, held after the client had closed it. A
close that finds an older epoch now leaves a tombstone as a close that finds nothing does, and
the late open is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from dgr_engine import errors as E
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.engine import ShardEngine
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_engine.worker.lifecycle.sessions import SessionTable

KW = {"max_sessions": 1, "n_ctx_per_session": 64, "n_threads": 1, "n_batch": 16}


async def _until(condition: Callable[[], bool], what: str, limit: float = 20.0) -> None:
    """Yields to the loop until ``condition()`` holds (at most ``limit`` s, 2,000 looks)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    for _ in range(2000):
        if condition():
            return
        if loop.time() >= end:
            break
        await asyncio.sleep(0.01)
    raise AssertionError(f"never came to pass: {what}")


def test_a_close_that_finds_an_older_epoch_refuses_its_own_epochs_late_open(
    tiny_llama: Path,
) -> None:
    with ShardEngine(tiny_llama, layers=(0, 2), **KW) as engine:
        table = SessionTable(engine)
        table.open("s", 2)
        assert table.close("s", 3) == 2  # closes what it found: the older epoch
        with pytest.raises(E.StaleEpoch, match="closed by its client before this open"):
            table.open("s", 3)
        with pytest.raises(E.StaleEpoch):
            table.open("s", 2)
        assert not table.holds("s") and engine.stats().open_sessions == 0
        table.open("s", 4)  # the session's next epoch opens as ever
        assert table.close("s", 4) == 4
        assert engine.stats().open_sessions == 0


def test_the_campaign_interleaving_leaves_no_slot_held(tiny_llama: Path) -> None:
    """The worker's side of the leak, over gRPC: one slot, opens of epochs 2 and 3 in line for
    it, epoch 2 admitted, then the close of epoch 3."""
    config = WorkerConfig(port=0, admission_wait_seconds=30.0)
    worker = ShardWorker.load(tiny_llama, (0, 2), config=config, **KW)

    async def scenario() -> None:
        address = await worker.start()
        try:
            async with ShardClient(address, timeout=30.0) as client:
                expect = expectations_of(await client.describe())
                await client.open("holder", 1, expect)  # every slot taken
                open_2 = asyncio.ensure_future(client.open("s", 2, expect))
                await _until(lambda: worker.admission.waiting == 1, "epoch 2 in line")
                open_3 = asyncio.ensure_future(client.open("s", 3, expect))
                await _until(lambda: worker.admission.waiting == 2, "epoch 3 in line")
                await client.close("holder", 1)
                await open_2  # admitted to the freed slot; epoch 3 still waits for one
                assert worker.admission.waiting == 1 and worker.table.holds("s")
                await client.close("s", 3)  # the client is done with the session here
                with pytest.raises(E.StaleEpoch, match="closed by its client before this open"):
                    await open_3
                assert worker.table.snapshot().sessions_open == 0
                assert worker.admission.waiting == 0
                assert worker.meter.snapshot().total_errors == 0  # the client's doing
                await client.open("s", 4, expect)  # its next epoch opens as ever
                assert worker.table.snapshot().sessions_open == 1
                await client.close("s", 4)
                assert worker.table.snapshot().sessions_open == 0
        finally:
            await worker.stop()

    asyncio.run(asyncio.wait_for(scenario(), 90))


def test_a_close_of_a_newer_epoch_frees_a_slot_whose_open_reply_was_lost(
    tiny_llama: Path,
) -> None:
    """The same order when the reply of epoch 2's open never reached the client (it timed out
    while the worker was stalled): the client holds no secret of epoch 2, yet its close of
    epoch 3 must land, as an open of epoch 3 from it would, or epoch 3's late open keeps the
    slot. (That a close from another client identity is refused is in
    ``tests/worker/test_hostile_rpcs.py``, under mutual TLS.)"""
    config = WorkerConfig(port=0, admission_wait_seconds=30.0)
    worker = ShardWorker.load(tiny_llama, (0, 2), config=config, **KW)

    async def scenario() -> None:
        address = await worker.start()
        try:
            async with (
                ShardClient(address, timeout=30.0) as client,
                ShardClient(address, timeout=30.0) as lost,
            ):
                expect = expectations_of(await client.describe())
                await client.open("holder", 1, expect)  # every slot taken
                open_2 = asyncio.ensure_future(lost.open("s", 2, expect))
                await _until(lambda: worker.admission.waiting == 1, "epoch 2 in line")
                open_3 = asyncio.ensure_future(lost.open("s", 3, expect))
                await _until(lambda: worker.admission.waiting == 2, "epoch 3 in line")
                await client.close("holder", 1)
                await open_2  # admitted; its secret reached `lost` only, never `client`
                assert worker.admission.waiting == 1 and worker.table.holds("s")
                await client.close("s", 3)  # no secret of epoch 2: the open's authority
                with pytest.raises(E.StaleEpoch, match="closed by its client before this open"):
                    await open_3
                assert worker.table.snapshot().sessions_open == 0
                assert worker.admission.waiting == 0
                assert worker.meter.snapshot().total_errors == 0
        finally:
            await worker.stop()

    asyncio.run(asyncio.wait_for(scenario(), 90))


def test_a_close_of_the_epoch_whose_open_reply_was_lost_frees_its_slot(tiny_llama: Path) -> None:
    """Issue 32's leak over native rings: the client held the secret of epoch 2; its open of
    epoch 3 landed at the worker but the reply never reached it (here: another channel of the
    same client got it). Its close of epoch 3, carrying epoch 2's secret, must still land (the
    owner's authority, as an open of epoch 3 has), or epoch 3 holds its slot until its lease."""
    worker = ShardWorker.load(tiny_llama, (0, 2), config=WorkerConfig(port=0), **KW)

    async def scenario() -> None:
        address = await worker.start()
        try:
            async with (
                ShardClient(address, timeout=30.0) as client,
                ShardClient(address, timeout=30.0) as lost,
            ):
                expect = expectations_of(await client.describe())
                await client.open("s", 2, expect)
                await lost.open("s", 3, expect)  # its secret reached `lost` only
                assert worker.table.holds("s")
                await client.close("s", 3)  # epoch 2's secret: the open's authority
                assert worker.table.snapshot().sessions_open == 0
                assert worker.meter.snapshot().total_errors == 0
        finally:
            await worker.stop()

    asyncio.run(asyncio.wait_for(scenario(), 90))
