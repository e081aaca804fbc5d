"""Closes, published (``dgr_engine.worker.lifecycle.closes``): the session table tells its
listeners of every close, whatever its cause, outside its lock, and a listener that raises
breaks nothing; in a worker, a close by lease, by stall reclaim and by an abandoned call each
reach the chain hub, the grant gate and the per-client limits, on the event loop's thread, and
each forgets that session."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from loguru import logger

from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.engine import ShardEngine
from dgr_engine.errors import FrameRejected, GrantDenied, NonFiniteOutput, UnknownSession
from dgr_engine.wire.frames import ForwardFrame
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_engine.worker.lifecycle.closes import CloseCause, OnLoop, SessionClosed
from dgr_engine.worker.lifecycle.sessions import SessionTable
from dgr_engine.worker.reporting.identity import BuildIdentity
from dgr_engine.worker.route.chain_hub import OutputStream
from tests.harness import run

KW: dict[str, Any] = {"max_sessions": 4, "n_ctx_per_session": 64, "n_threads": 1, "n_batch": 16}
STRANGER = "cert:someone-else"
"""A client identity that holds nothing (the test's client is ``addr:127.0.0.1``)."""


class FakeClock:
    """Seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """A listener that keeps what it is told, and whether the table's lock was free then."""

    def __init__(self) -> None:
        self.table: SessionTable | None = None
        self.told: list[SessionClosed] = []
        self.lock_free: list[bool] = []
        self.threads: list[str] = []

    def session_closed(self, closed: SessionClosed) -> None:
        self.told.append(closed)
        if self.table is not None:
            self.lock_free.append(not self.table._lock.locked())
        self.threads.append(threading.current_thread().name)


class Raising:
    """A listener that always fails."""

    def session_closed(self, closed: SessionClosed) -> None:
        raise RuntimeError(f"listener broke on {closed.session_id}")


@pytest.fixture()
def logged() -> Iterator[list[str]]:
    """The worker's log lines at ERROR, while the test runs (the library logs nowhere)."""
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="ERROR")
    logger.enable("dgr_engine")
    try:
        yield lines
    finally:
        logger.disable("dgr_engine")
        logger.remove(sink)


# -- the table publishes -----------------------------------------------------------------------


def test_every_close_is_told_once_outside_the_lock_and_a_failing_listener_breaks_nothing(
    tiny_llama: Path, logged: list[str]
) -> None:
    clock = FakeClock()
    first, last = Recorder(), Recorder()
    with ShardEngine(tiny_llama, layers=(0, 2), **KW) as engine:
        table = SessionTable(engine, clock, listeners=(first, Raising(), last))
        first.table = last.table = table
        for sid in ("client", "reopened", "older", "leased"):
            table.open(sid, 1)  # at 1000
        assert first.told == []  # opens are not closes
        assert table.close("client", 1) == 1
        assert table.close("older", 3) == 1  # a newer epoch's close names the older one
        clock.now = 1060
        table.open("stalled", 1)
        clock.now = 1070
        assert table.open("reopened", 2) is True  # epoch 1 discarded: the session lives on
        assert table.expire_idle(30.0).closed == [("leased", 1)]  # unused since 1000
        assert table.expire_unused_since(1065.0).closed == [("stalled", 1)]  # since 1060
        table.open("left", 1)
        assert table.close_all() == 2  # "reopened" at epoch 2, and "left"
        with pytest.raises(UnknownSession):
            table.close("client", 1)  # found nothing: nothing to tell
    want = [
        SessionClosed("client", 1, CloseCause.CLIENT),
        SessionClosed("older", 1, CloseCause.CLIENT),
        SessionClosed("reopened", 1, CloseCause.SUPERSEDED),
        SessionClosed("leased", 1, CloseCause.LEASE),
        SessionClosed("stalled", 1, CloseCause.STALL),
    ]
    shutdown = {SessionClosed("reopened", 2, CloseCause.SHUTDOWN)}
    shutdown.add(SessionClosed("left", 1, CloseCause.SHUTDOWN))
    for recorder in (first, last):  # the one after the failing listener is told too
        assert recorder.told[:5] == want and set(recorder.told[5:]) == shutdown
        assert len(recorder.told) == 7 and all(recorder.lock_free)
    assert [c.still_held for c in want] == [False, False, True, False, False]
    failures = [line for line in logged if "telling Raising of a close" in line]
    assert len(failures) == 7 and "listener broke on client" in failures[0]


class Poisoning:
    """An engine whose next forward comes out NaN."""

    def __init__(self, engine: ShardEngine) -> None:
        self.engine = engine
        self.info = engine.info
        self.numerics = engine.numerics

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def forward(self, *args: Any, **kwargs: Any) -> np.ndarray:
        return np.full_like(self.engine.forward(*args, **kwargs), np.nan)


def test_a_close_for_non_finite_output_is_told(tiny_llama: Path) -> None:
    recorder = Recorder()
    with ShardEngine(tiny_llama, layers=(0, 2), **KW) as engine:
        table = SessionTable(Poisoning(engine), listeners=(recorder,))
        table.open("s", 1)
        tokens = np.asarray([1, 2], dtype=np.int32)
        frame = ForwardFrame("s", 1, 0, np.arange(2, dtype=np.int32), tokens, None, None)
        with pytest.raises(NonFiniteOutput, match="the session was closed"):
            table.forward(frame)
    assert recorder.told == [SessionClosed("s", 1, CloseCause.NON_FINITE)]


def test_on_loop_tells_a_close_on_the_loops_thread_ahead_of_the_result() -> None:
    recorder = Recorder()
    on_loop = OnLoop(recorder)
    closed = SessionClosed("s", 1, CloseCause.LEASE)
    on_loop.session_closed(closed)  # not bound yet: told at once, here
    assert recorder.threads == [threading.current_thread().name]

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        on_loop.bind(loop)
        done: asyncio.Future[None] = loop.create_future()

        def elsewhere() -> None:  # as the engine thread closes, then answers its caller
            on_loop.session_closed(closed)
            loop.call_soon_threadsafe(done.set_result, None)

        thread = threading.Thread(target=elsewhere, name="closer")
        thread.start()
        await asyncio.wait_for(done, 20.0)
        thread.join(20.0)
        assert len(recorder.told) == 2  # before the caller saw the answer
        on_loop.session_closed(closed)  # on the loop itself: at once
        assert len(recorder.told) == 3

    run(scenario())
    loop_thread = threading.current_thread().name
    assert recorder.threads[1:] == [loop_thread, loop_thread]


# -- in a worker: lease, stall, abandoned call ---------------------------------------------------


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


class Listeners:
    """What each of the worker's three close listeners knows of a session, and on which thread
    each was told of its closes."""

    def __init__(self, worker: ShardWorker) -> None:
        self.worker = worker
        self.outputs: dict[str, OutputStream] = {}
        self.threads: dict[str, set[str]] = {"chain": set(), "grants": set(), "limits": set()}
        for name, listener in (
            ("chain", worker.chain),
            ("grants", worker.grants),
            ("limits", worker.limits),
        ):
            told = listener.session_closed

            def spy(closed: SessionClosed, told: Any = told, name: str = name) -> None:
                self.threads[name].add(threading.current_thread().name)
                told(closed)

            listener.session_closed = spy  # type: ignore[method-assign]

    def link(self, session_id: str, epoch: int) -> None:
        """Gives the chain hub a link and an output stream of the session's epoch."""
        hop = pb.ChainHop(endpoint="127.0.0.1:9", session_secret=b"next")
        self.worker.chain.link(session_id, epoch, hop)
        self.outputs[session_id] = self.worker.chain.open_output(session_id, epoch)

    def output_ended(self, session_id: str) -> bool:
        """Whether the session's output stream was ended (its client's close does that)."""
        queue = self.outputs[session_id].queue
        return not queue.empty() and queue.get_nowait() is None

    def chain_knows(self, session_id: str, epoch: int) -> bool:
        try:
            self.worker.chain.next_hop(session_id, epoch)
            self.worker.chain.check_output(session_id, epoch)
        except FrameRejected:
            return False
        return True

    def grants_know(self, session_id: str) -> bool:
        return self.worker.grants.held_epoch(session_id) is not None

    def limits_know(self, session_id: str) -> bool:
        try:
            self.worker.limits.check_owner(STRANGER, session_id)
        except GrantDenied:  # held by its client: another identity may not open it
            return True
        return False

    def all_know(self, session_id: str, epoch: int) -> bool:
        held = self.chain_knows(session_id, epoch), self.grants_know(session_id)
        return all((*held, self.limits_know(session_id)))

    def none_know(self, session_id: str, epoch: int) -> bool:
        held = self.chain_knows(session_id, epoch), self.grants_know(session_id)
        return not any((*held, self.limits_know(session_id)))


def _scenario(
    tiny_llama: Path,
    config: WorkerConfig,
    clock: FakeClock,
    body: Callable[..., Any],
    *,
    kept_lives: bool = True,
) -> None:
    """Opens "gone" and "kept" (each linked in the chain hub, its secret held, owned by its
    client), runs ``body``, which closes "gone" (and, unless ``kept_lives``, "kept"), then
    checks that the three listeners forgot exactly what was closed, told on the loop."""
    worker = ShardWorker(
        ShardEngine(tiny_llama, layers=(0, 4), **KW),
        BuildIdentity.of_model(tiny_llama),
        config,
        clock=clock,
    )
    listeners = Listeners(worker)

    async def scenario() -> None:
        address = await worker.start()
        try:
            async with ShardClient(address, timeout=20.0) as client:
                expect = expectations_of(await client.describe())
                for sid in ("gone", "kept"):
                    await client.open(sid, 1, expect)
                    listeners.link(sid, 1)
                    assert listeners.all_know(sid, 1)
                await body(worker, listeners, client, expect)
                assert listeners.none_know("gone", 1)
                assert not worker.table.holds("gone")
                # forgotten, not ended: an end the client did not ask for would read as the
                # last stage lost (the client ends it when it closes the epoch)
                assert not listeners.output_ended("gone")
                if kept_lives:
                    assert listeners.all_know("kept", 1)  # another session: untouched
                    await client.close("kept", 1)  # the client's own close, for once
                    assert listeners.output_ended("kept")
                assert listeners.none_know("kept", 1)
        finally:
            await worker.stop()

    run(scenario())
    loop = threading.current_thread().name
    assert listeners.threads == {"chain": {loop}, "grants": {loop}, "limits": {loop}}


def test_a_close_by_lease_reaches_the_hub_the_gate_and_the_limits(tiny_llama: Path) -> None:
    clock = FakeClock()

    async def body(worker: ShardWorker, listeners: Listeners, client: Any, expect: Any) -> None:
        clock.now += 20
        await client.forward("kept", 1, 0, expect, [0, 1], tokens=[1, 2])  # used: fresh
        clock.now += 20  # "gone" unused for 40 s, "kept" for 20
        assert await worker.expire_idle_sessions() == [("gone", 1)]
        # told before the expiry's caller resumed: no wait
        assert listeners.none_know("gone", 1) and worker.sessions_expired == 1

    config = WorkerConfig(port=0, session_lease_seconds=30.0, stall_seconds=0)
    _scenario(tiny_llama, config, clock, body)


def test_a_close_by_stall_reclaim_reaches_the_hub_the_gate_and_the_limits(
    tiny_llama: Path,
) -> None:
    clock = FakeClock()

    async def body(worker: ShardWorker, listeners: Listeners, client: Any, expect: Any) -> None:
        clock.now += 1000  # the worker's own timekeeping jumps: a stall; nobody used since
        await _until(lambda: worker.table.snapshot().sessions_open == 0, "the stall reclaim")
        assert worker.sessions_reclaimed == 2

    # no lease (the jump would expire them); the watchdog ticks every 0.05 s, no grace
    config = WorkerConfig(
        port=0, session_lease_seconds=None, stall_seconds=0.2, resume_grace_seconds=0
    )
    _scenario(tiny_llama, config, clock, body, kept_lives=False)


def test_a_close_by_an_abandoned_call_reaches_the_hub_the_gate_and_the_limits(
    tiny_llama: Path,
) -> None:
    async def body(worker: ShardWorker, listeners: Listeners, client: Any, expect: Any) -> None:
        worker.abandon("gone", 1, "forward cancelled")  # as a cancelled call does
        await _until(lambda: not worker.table.holds("gone"), "the abandoned call's close")
        assert worker.calls_abandoned == 1 and worker.sessions_reclaimed == 1

    config = WorkerConfig(port=0, stall_seconds=0)
    _scenario(tiny_llama, config, FakeClock(), body)
