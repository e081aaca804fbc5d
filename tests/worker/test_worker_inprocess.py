"""The worker's parts in-process, on the real engine: the engine thread, the session table, and
deadlines (which need the engine thread held busy, something only an in-process test can do).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine import errors as E
from dgr_engine.client.relay import GrpcStageTransport
from dgr_engine.client.routes import EndpointRouteProvider
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.errors import ShardDeadlineExceeded
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_reference
from dgr_engine.wire.frames import ForwardFrame, encode_forward
from dgr_engine.wire.proto import shard_pb2_grpc
from dgr_engine.wire.status import STATUS_KEY
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_engine.worker.engine_access.engine_thread import EngineThread
from dgr_engine.worker.lifecycle.sessions import SessionTable
from dgr_engine.worker.reporting.identity import BuildIdentity
from dgr_session import EvidenceClass, FaultKind, SessionManager, SessionResult, SessionState
from tests.harness import run

T = TypeVar("T")
OPTIONS = EngineOptions(max_sessions=2, n_ctx_per_session=256, n_threads=1, n_batch=32)
KW: dict[str, Any] = OPTIONS.engine_kwargs()


# --- the engine thread -------------------------------------------------------------------------


def test_engine_thread_runs_in_order_and_propagates_errors() -> None:
    thread = EngineThread()
    seen: list[int] = []

    async def scenario() -> None:
        results = await asyncio.gather(*(thread.run(seen.append, i) for i in range(50)))
        assert results == [None] * 50 and seen == list(range(50))
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 / 0)
        assert await thread.run(threading.current_thread) is not threading.current_thread()

    try:
        run(scenario())
    finally:
        thread.shutdown(5.0)
    with pytest.raises(RuntimeError, match="shut down"):
        run(thread.run(int))


def test_engine_thread_skips_jobs_cancelled_while_queued() -> None:
    thread = EngineThread()
    gate = threading.Event()
    ran: list[str] = []

    async def scenario() -> None:
        blocker = asyncio.ensure_future(thread.run(gate.wait, 10.0))
        queued = asyncio.ensure_future(thread.run(ran.append, "cancelled"))
        await asyncio.sleep(0)  # let both jobs be submitted
        queued.cancel()
        gate.set()
        assert await blocker is True
        await thread.run(ran.append, "after")

    try:
        run(scenario())
    finally:
        thread.shutdown(5.0)
    assert ran == ["after"]


def test_engine_thread_is_idle_only_with_nothing_queued_or_running() -> None:
    thread = EngineThread()
    gate = threading.Event()

    async def scenario() -> None:
        assert thread.idle
        running = asyncio.ensure_future(thread.run(gate.wait, 10.0))
        queued = asyncio.ensure_future(thread.run(int, "7"))
        await asyncio.sleep(0)  # both submitted
        assert not thread.idle
        cancelled = asyncio.ensure_future(thread.run(int, "8"))
        await asyncio.sleep(0)
        cancelled.cancel()  # its caller gave up: still counted until the thread skips it
        assert not thread.idle
        gate.set()
        assert await running is True and await queued == 7
        await thread.run(int, "9")  # FIFO: the skipped job is behind us
        assert thread.idle

    try:
        run(scenario())
    finally:
        thread.shutdown(5.0)


# --- the session table -------------------------------------------------------------------------


def frame(session: str, epoch: int, start: int, tokens: list[int]) -> ForwardFrame:
    return ForwardFrame(
        session_id=session,
        epoch=epoch,
        step=0,
        positions=np.arange(start, start + len(tokens), dtype=np.int32),
        tokens=np.asarray(tokens, dtype=np.int32),
        rows=None,
        want=None,
    )


def test_session_table_mirrors_the_engine(tiny_llama: Path) -> None:
    with ShardEngine(tiny_llama, layers=(0, 2), **KW) as engine:
        table = SessionTable(engine)
        assert table.open("a", 3) is False
        out, next_pos, _ = table.forward(frame("a", 3, 0, [1, 2, 3]))
        assert out.shape == (3, 64) and next_pos == 3
        assert table.snapshot().kv_tokens_used == 3
        with pytest.raises(E.StaleEpoch, match="'a' epoch 2 is older than the open epoch 3"):
            table.open("a", 2)
        with pytest.raises(E.UnknownSession, match="epoch 4 is not open"):
            table.forward(frame("a", 4, 3, [4]))
        assert table.open("a", 4) is True  # a newer epoch: the old state is discarded
        assert table.snapshot().kv_tokens_used == 0
        with pytest.raises(E.PositionMismatch):
            table.forward(frame("a", 4, 3, [4]))
        table.open("b", 0)
        with pytest.raises(E.CapacityExceeded):
            table.open("c", 0)
        table.close("b", 0)
        with pytest.raises(E.UnknownSession):
            table.close("b", 0)
        table.open("c", 0)
        assert table.snapshot().sessions_open == 2
        assert engine.stats().open_sessions == 2
        # a close naming a newer epoch (opened elsewhere) frees the older epoch held here
        assert table.close("c", 5) == 0
        assert not table.holds("c") and engine.stats().open_sessions == 1
        with pytest.raises(E.StaleEpoch):
            table.close("a", 3)  # the newer open epoch 4 is never closed by an older close
        with pytest.raises(E.StaleEpoch):  # the client is done with c's epochs up to 5 here
            table.open("c", 0)
        table.open("c", 6)
        assert table.close_all() == 2
        assert engine.stats().open_sessions == 0 and table.snapshot().sessions_open == 0


class FakeClock:
    """Seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_table_expires_sessions_unused_for_the_lease(tiny_llama: Path) -> None:
    clock = FakeClock()
    with ShardEngine(tiny_llama, layers=(0, 2), **KW) as engine:
        table = SessionTable(engine, clock)
        assert table.oldest_use() is None and table.expire_idle(10.0).closed == []
        table.open("idle", 0)
        clock.now += 6
        table.open("busy", 2)
        assert table.oldest_use() == 1000.0
        clock.now += 3
        table.forward(frame("busy", 2, 0, [1, 2]))  # used at 1009
        with pytest.raises(E.PositionMismatch):
            table.forward(frame("idle", 0, 5, [1]))  # refused, but the client is there: 1009
        clock.now += 9.5
        assert table.expire_idle(10.0).closed == []  # both used 9.5 s ago
        clock.now += 0.5
        table.forward(frame("busy", 2, 2, [3]))  # 1019: busy is fresh again
        sweep = table.expire_idle(10.0)  # idle: unused for exactly the lease
        assert sweep.closed == [("idle", 0)] and sweep.failed == []
        assert engine.stats().open_sessions == 1 and table.snapshot().sessions_open == 1
        with pytest.raises(E.UnknownSession):
            table.forward(frame("idle", 0, 0, [1]))
        assert table.oldest_use() == 1019.0
        # the slot is free again; the kept session's KV is untouched
        table.open("idle", 0)
        out, next_pos, _ = table.forward(frame("busy", 2, 3, [4]))
        assert next_pos == 4 and out.shape == (1, 64)


# --- deadlines ---------------------------------------------------------------------------------


def test_a_frame_past_its_deadline_is_refused_without_running(tiny_llama: Path) -> None:
    worker = ShardWorker.load(tiny_llama, (0, 4), **KW, config=WorkerConfig(port=0))

    async def scenario() -> None:
        address = await worker.start()
        try:
            async with ShardClient(address, timeout=20.0) as client:
                expect = expectations_of(await client.describe())
                await client.open("d", 0, expect)
                gate = threading.Event()
                busy = asyncio.ensure_future(worker.run_on_engine(gate.wait, 20.0))
                secret = client.session_secret("d", 0)  # every session's frames carry it
                request = encode_forward(
                    "d", 0, 0, expect, [0, 1], tokens=[1, 2], timeout=0.001, session_secret=secret
                )
                async with grpc.aio.insecure_channel(address) as channel:
                    call = shard_pb2_grpc.ShardStub(channel).Forward(request, timeout=20.0)
                    # wait (bounded) until the frame is queued behind the busy engine thread
                    limit = time.monotonic() + 20.0
                    while worker.meter.snapshot().queued < 1:
                        assert time.monotonic() < limit, "the frame never arrived"
                        await asyncio.sleep(0.001)
                    queued_at = time.monotonic()
                    while time.monotonic() < queued_at + 0.002:  # its 1 ms deadline passes
                        await asyncio.sleep(0.001)
                    gate.set()
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call
                assert await busy is True
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert dict(info.value.trailing_metadata() or ())[STATUS_KEY] == "DGR_E_DEADLINE"
                # a deadline is the caller's choice and a busy queue is load, not a fault (issue
                # 28: no client can lower a worker's health by what it sends, timeout_ms=1 too)
                assert worker.meter.snapshot().total_errors == 0
                # it never ran: the session is still at position 0
                result = await client.forward("d", 0, 1, expect, [0, 1], tokens=[1, 2])
                assert result.next_pos == 2
                # the client's own deadline: ShardDeadlineExceeded, a TimeoutError
                gate.clear()
                busy = asyncio.ensure_future(worker.run_on_engine(gate.wait, 20.0))
                with pytest.raises(ShardDeadlineExceeded):
                    await client.forward("d", 0, 2, expect, [2], tokens=[3], timeout=0.05)
                # the worker sees the cancelled call too (bounded wait): a dgr client never
                # reuses an epoch after a failed call, so the session is closed at that epoch
                limit = time.monotonic() + 20.0
                while worker.calls_abandoned < 1:
                    assert time.monotonic() < limit, "the worker never saw the cancel"
                    await asyncio.sleep(0.001)
                gate.set()
                await busy
        finally:
            assert await worker.stop() == 0  # the abandoned session was closed before
        assert worker.calls_abandoned == 1

    run(scenario())


# --- one-row frames on the loop ----------------------------------------------------------------


def test_one_row_frames_run_on_the_loop_when_the_engine_is_idle_and_steps_are_short(
    tiny_llama: Path,
) -> None:
    # a threshold no hiccup of this shared machine reaches (a one-row tiny-llama step takes
    # well under a millisecond); "slow" steps are made by hand below
    config = WorkerConfig(port=0, inline_max_ms=10_000.0)
    worker = ShardWorker.load(tiny_llama, (0, 4), **KW, config=config)
    ran_on: list[str] = []
    table_forward = worker.table.forward

    def spy(frame: ForwardFrame) -> Any:
        ran_on.append(threading.current_thread().name)
        return table_forward(frame)

    worker.table.forward = spy  # type: ignore[method-assign]

    async def scenario() -> None:
        address = await worker.start()
        loop_thread = threading.current_thread().name
        try:
            async with ShardClient(address, timeout=20.0) as client:
                expect = expectations_of(await client.describe())
                await client.open("i", 0, expect)
                await client.forward("i", 0, 0, expect, [0, 1, 2], tokens=[1, 2, 3])
                # the first one-row frame measures on the engine thread, the next runs inline
                await client.forward("i", 0, 1, expect, [3], tokens=[4])
                await client.forward("i", 0, 2, expect, [4], tokens=[5])
                assert ran_on == ["dgr-engine", "dgr-engine", loop_thread]
                # the engine thread busy: a one-row frame waits for it, and the loop goes on
                gate = threading.Event()
                busy = asyncio.ensure_future(worker.run_on_engine(gate.wait, 20.0))
                waiting = asyncio.ensure_future(client.forward("i", 0, 3, expect, [5], tokens=[6]))
                limit = time.monotonic() + 20.0
                while worker.meter.snapshot().queued < 1:
                    assert time.monotonic() < limit, "the frame never arrived"
                    await asyncio.sleep(0.001)
                assert (await client.describe()).capacity.sessions_open == 1  # loop answers
                gate.set()
                assert await busy is True and (await waiting).next_pos == 6
                assert ran_on[-1] == "dgr-engine"
                await client.forward("i", 0, 4, expect, [6], tokens=[7])
                assert ran_on[-1] == loop_thread
                # a step slower than inline_max_ms (10 s): the next one runs on the engine
                # thread; it measured fast, so the one after is back on the loop
                worker.small_frame_ns = 11e9
                await client.forward("i", 0, 5, expect, [7], tokens=[8])
                await client.forward("i", 0, 6, expect, [8], tokens=[9])
                assert ran_on[-2:] == ["dgr-engine", loop_thread]
                # inline_max_rows=0: always the engine thread
                worker.dispatch.inline_max_rows = 0
                await client.forward("i", 0, 7, expect, [9], tokens=[10])
                assert ran_on[-1] == "dgr-engine"
                # closed before the client goes: a client leaving cancels its streams, and the
                # worker may close what they carried before or after stop() counts sessions
                await client.close("i", 0)
        finally:
            assert await worker.stop() == 0

    run(scenario())


# --- session leases ----------------------------------------------------------------------------


def test_a_lease_must_be_positive() -> None:
    with pytest.raises(ValueError, match="session_lease_seconds"):
        WorkerConfig(session_lease_seconds=0)
    assert WorkerConfig(session_lease_seconds=None).session_lease_seconds is None


def test_an_expired_session_is_closed_and_refused_while_others_go_on(tiny_llama: Path) -> None:
    clock = FakeClock()
    engine = ShardEngine(tiny_llama, layers=(0, 4), **KW)
    build = BuildIdentity.of_model(tiny_llama)
    config = WorkerConfig(port=0, session_lease_seconds=30.0)
    worker = ShardWorker(engine, build, config, clock=clock)

    async def scenario() -> None:
        address = await worker.start()
        try:
            async with ShardClient(address, timeout=20.0) as client:
                advert = await client.describe()
                assert advert.capacity.session_lease_seconds == 30.0  # the tracker can see it
                expect = expectations_of(advert)
                await client.open("gone", 0, expect)
                await client.open("here", 0, expect)
                await client.forward("gone", 0, 0, expect, [0, 1], tokens=[1, 2])
                clock.now += 20
                await client.forward("here", 0, 0, expect, [0, 1], tokens=[1, 2])
                clock.now += 10  # "gone" unused for 30 s, "here" for 10
                assert await worker.expire_idle_sessions() == [("gone", 0)]
                assert worker.sessions_expired == 1
                assert (await client.describe()).capacity.sessions_open == 1
                with pytest.raises(E.UnknownSession):  # NOT_FOUND: a route re-prefills
                    await client.forward("gone", 0, 1, expect, [2], tokens=[3])
                result = await client.forward("here", 0, 1, expect, [2], tokens=[3])
                assert result.next_pos == 3
                # the freed slot serves a new session
                await client.open("new", 0, expect)
                assert (await client.describe()).capacity.sessions_open == 2
        finally:
            assert await worker.stop() == 2

    run(scenario())


def test_the_worker_expires_an_abandoned_session_by_itself(tiny_llama: Path) -> None:
    lease = 0.2
    config = WorkerConfig(port=0, session_lease_seconds=lease)
    worker = ShardWorker.load(tiny_llama, (0, 4), **KW, config=config)

    async def scenario() -> None:
        address = await worker.start()
        try:
            async with ShardClient(address, timeout=20.0) as client:
                expect = expectations_of(await client.describe())
                await client.open("abandoned", 0, expect)
                opened = time.monotonic()
                # the client goes away without closing; wait (bounded) for the worker to notice
                limit = opened + 20.0
                while worker.table.snapshot().sessions_open:
                    assert time.monotonic() < limit, "the lease never ran out"
                    await asyncio.sleep(0.01)
                assert time.monotonic() - opened >= lease
                assert worker.sessions_expired == 1
                assert (await client.describe()).capacity.sessions_open == 0
        finally:
            assert await worker.stop() == 0

    run(scenario())


def test_a_worker_advertises_its_architectures_family_patch(tiny_llama: Path) -> None:
    """A gemma3 shard states the gemma3 family patch's hash beside the base stack's, in its
    lane id and on the wire; a llama shard states none, and its lane id is the one it had
    before family patches existed (``family_patch_sha256`` left out of the canonical form)."""
    from dgr_engine._binding import PATCH_STACK_SHA256, family_patch_sha256
    from dgr_engine.fixtures.converted import ensure_converted

    gemma = ensure_converted("hf-gemma3-swa").gguf
    seen = {}
    for path, layers in ((gemma, (5, 7)), (tiny_llama, (0, 2))):
        worker = ShardWorker.load(path, layers, **KW, config=WorkerConfig(port=0))

        async def scenario(worker: ShardWorker = worker) -> None:
            address = await worker.start()
            try:
                async with ShardClient(address, timeout=20.0) as client:
                    advert = await client.describe()
                    seen[advert.identity.arch] = (advert.lane, worker.lane_key)
            finally:
                await worker.stop()

        run(scenario())
    (gemma_lane, gemma_key), (llama_lane, llama_key) = seen["gemma3"], seen["llama"]
    assert gemma_lane.family_patch_hash == family_patch_sha256("gemma3") != b""
    assert gemma_key.family_patch_sha256 == gemma_lane.family_patch_hash.hex()
    assert gemma_lane.lane_id == gemma_key.lane_id
    assert gemma_lane.patch_stack_hash == llama_lane.patch_stack_hash == PATCH_STACK_SHA256
    assert llama_lane.family_patch_hash == b"" and llama_key.family_patch_sha256 == ""
    assert "family_patch_sha256" not in llama_key.canonical()


@pytest.mark.slow  # starts worker processes
def test_a_route_session_survives_a_lease_expiry_by_re_prefilling(
    tiny_llama: Path, fixture_evidence: Path
) -> None:
    prompt = [5, 17, 3, 99, 42, 7, 1, 250]
    n_tokens = 10
    ((want, _),) = whole_model_reference(tiny_llama, [prompt], n_tokens, OPTIONS)
    build = BuildIdentity.of_model(tiny_llama)
    clocks = [FakeClock(), FakeClock()]
    workers = [
        ShardWorker(
            ShardEngine(tiny_llama, layers=layers, **KW),
            build,
            WorkerConfig(port=0, session_lease_seconds=30.0, evidence_dir=fixture_evidence),
            clock=clock,
        )
        for layers, clock in zip(((0, 2), (2, 4)), clocks, strict=True)
    ]
    expiries: list[asyncio.Future[list[tuple[str, int]]]] = []

    async def scenario() -> SessionResult:
        addresses = [await worker.start() for worker in workers]
        try:
            async with GrpcStageTransport(timeout=20.0) as transport:
                manager = SessionManager(
                    transport,
                    EndpointRouteProvider(addresses),
                    required_evidence=EvidenceClass.FIXTURE,
                )

                def on_token(token: int) -> None:
                    if len(handle.tokens) == 4 and not expiries:
                        # the second stage has not heard of the session for 31 s: its lease
                        # runs out before the next step's frame arrives
                        clocks[1].now += 31
                        expiries.append(asyncio.ensure_future(workers[1].expire_idle_sessions()))

                handle = manager.start(prompt, max_new_tokens=n_tokens, on_token=on_token)
                result = await handle.wait()
                await manager.aclose()
                return result
        finally:
            for worker in workers:
                assert await worker.stop() == 0  # every epoch closed by the session

    result = run(scenario())
    assert expiries and expiries[0].result() == [(result.session_id, 1)]  # the first epoch
    assert workers[1].sessions_expired == 1
    # refused as unknown (NOT_FOUND) at the next step: a new epoch, re-prefilled, same tokens
    assert result.state is SessionState.DONE and list(result.tokens) == want
    assert (result.epoch, result.route_changes) == (2, 1)
    (report,) = result.reports
    assert report.fault is FaultKind.STATE_LOST and report.stage_index == 1  # nobody to blame
    assert "UnknownSession" in report.detail and report.step == 4


# --- frames that want no logits ----------------------------------------------------------------


def test_a_frame_wanting_no_logits_skips_them_and_changes_nothing_after(tiny_llama: Path) -> None:
    prompt = [5, 17, 3, 99, 42, 7, 1, 250]
    with ShardEngine(tiny_llama, **KW) as engine:  # the same frames, logits asked every time
        engine.open_session(1, 0)
        engine.forward(1, 0, np.arange(4), tokens=prompt[:4])
        want = engine.forward(1, 0, np.arange(4, 8), tokens=prompt[4:])
    worker = ShardWorker.load(tiny_llama, (0, 4), **KW, config=WorkerConfig(port=0))
    middle = ShardWorker.load(tiny_llama, (0, 2), **KW, config=WorkerConfig(port=0))

    async def scenario() -> None:
        address, middle_address = await worker.start(), await middle.start()
        try:
            async with ShardClient(address) as client, ShardClient(middle_address) as first:
                expect = expectations_of(await client.describe())
                await client.open("n", 0, expect)
                skipped = await client.forward(
                    "n", 0, 0, expect, range(4), tokens=prompt[:4], logits=False
                )
                assert skipped.is_logits and skipped.output.shape == (0, 256)
                got = await client.forward("n", 0, 0, expect, range(4, 8), tokens=prompt[4:])
                assert np.array_equal(got.output, want)  # the KV is what logits would leave
                # asking for none and for some at once is malformed; nothing changes
                bad = encode_forward("n", 0, 1, expect, [8], tokens=[3], logit_rows=[0])
                bad.no_logits = True
                async with grpc.aio.insecure_channel(address) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await shard_pb2_grpc.ShardStub(channel).Forward(bad, timeout=5.0)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert dict(refused.value.trailing_metadata() or ())[STATUS_KEY] == "DGR_E_FRAME"
                assert (await client.forward("n", 0, 1, expect, [8], tokens=[3])).next_pos == 9
                # a middle stage has no logits to skip: its boundary rows come back as ever
                m_expect = expectations_of(await first.describe())
                await first.open("n", 0, m_expect)
                rows = await first.forward(
                    "n", 0, 0, m_expect, range(2), tokens=[1, 2], logits=False
                )
                assert not rows.is_logits and rows.output.shape == (2, 64)
        finally:
            assert await worker.stop() == 1
            assert await middle.stop() == 1

    run(scenario())
