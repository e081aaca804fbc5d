"""GrpcStageTransport against real ``dgr worker`` processes on 127.0.0.1.

What a route session's manager sees: numpy rows and logits equal to the whole model's, the
failures it classifies (dead, deadline, stale epoch, engine error), closes that are no-ops
where nothing is held, per-endpoint counters. Every wait is bounded (call deadlines, process
timeouts, ``run``'s limit); every worker is stopped in teardown.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine import errors as E
from dgr_engine.client.relay import ForwardRecord, GrpcStageTransport
from dgr_engine.client.routes import describe
from dgr_engine.options import EngineOptions
from dgr_engine.tooling.processes import WorkerProcess
from dgr_engine.wire.advert import Advert
from dgr_session import (
    Boundary,
    FaultKind,
    InvalidIdentifier,
    Logits,
    StageDead,
    StageSpec,
    StaleEpoch,
    fault_kind,
)
from dgr_session.testing import forward_call
from tests.harness import run

pytestmark = pytest.mark.slow

T = TypeVar("T")
PROMPT = [int(t) for t in (np.arange(16) * 37 + 11) % 256]
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)


@pytest.fixture(scope="module")
def two(tiny_llama: Path) -> Iterator[list[tuple[WorkerProcess, Advert]]]:
    """Workers for [0, 2) and [2, 4) with their adverts."""
    workers = [WorkerProcess.spawn(tiny_llama, r, options=OPTIONS) for r in ((0, 2), (2, 4))]
    try:
        yield [(w, run(describe(w.address))) for w in workers]
    finally:
        for w in workers:
            w.stop()


def stages(workers: list[tuple[WorkerProcess, Advert]]) -> list[StageSpec]:
    return [advert.stage_spec(w.address) for w, advert in workers]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_rows_and_logits_are_numpy_and_equal_the_whole_model(
    two: list[tuple[WorkerProcess, Advert]], tiny_llama: Path
) -> None:
    with ShardEngine(tiny_llama, **OPTIONS.engine_kwargs()) as whole:
        whole.open_session(1, 0)
        want = whole.forward(1, 0, np.arange(len(PROMPT)), tokens=PROMPT)[-1]
    first, last = stages(two)
    records: list[ForwardRecord] = []

    async def scenario() -> tuple[object, object, dict[str, Any]]:
        async with GrpcStageTransport(timeout=10.0, observer=records.append) as t:
            for stage in (first, last):
                await t.open(stage, "rows", 3)
            positions = range(len(PROMPT))
            mid = await t.forward(forward_call(first, "rows", 3, 0, positions, PROMPT, None))
            assert isinstance(mid, Boundary)
            out = await t.forward(forward_call(last, "rows", 3, 0, positions, PROMPT, mid.rows))
            for stage in (first, last):
                await t.close(stage, "rows", 3)
            return mid, out, t.stats()

    mid, out, stats = run(scenario())
    assert isinstance(mid, Boundary) and isinstance(out, Logits)
    assert isinstance(mid.rows, np.ndarray) and mid.rows.dtype == np.float32
    assert mid.rows.shape == (len(PROMPT), 64)
    assert isinstance(out.values, np.ndarray) and out.values.dtype == np.float32
    assert out.values.shape == (256,)
    assert np.array_equal(out.values, want)
    n = len(PROMPT)
    s0, s1 = stats[first.endpoint], stats[last.endpoint]
    assert (s0.forwards, s0.rows, s0.failures) == (1, n, 0)
    assert s0.bytes_sent == n * (4 + 4)  # positions + token ids (the first stage)
    assert s0.bytes_received == n * 64 * 4
    # positions + boundary + token ids: llama needs none, the last stage's sampler may
    assert s1.bytes_sent == n * (4 + 64 * 4 + 4)
    assert s1.bytes_received == 256 * 4  # the last row's logits
    assert s0.compute_us > 0 and s0.rtt_us >= s0.compute_us
    # each worker says how much of its engine time was inside llama.cpp: part of it, not zero
    assert all(0 < r.native_us <= r.compute_us for r in records), records
    assert [(r.layers, r.epoch, r.positions) for r in records] == [
        ((0, 2), 3, range(n)),
        ((2, 4), 3, range(n)),
    ]


def test_failures_are_what_the_manager_classifies(two: list[tuple[WorkerProcess, Advert]]) -> None:
    first, _ = stages(two)
    nowhere = StageSpec(
        endpoint=f"127.0.0.1:{free_port()}",
        layer_begin=0,
        layer_end=2,
        identity=first.identity,
        recipe=first.recipe,
        lane=first.lane,
        boundary_out=64,
    )
    wrong_range = StageSpec(
        endpoint=first.endpoint,
        layer_begin=0,
        layer_end=1,
        identity=first.identity,
        recipe=first.recipe,
        lane=first.lane,
        boundary_out=64,
    )

    async def scenario() -> None:
        async with GrpcStageTransport(timeout=5.0) as t:
            # unreachable: StageDead (a ConnectionError), fault "dead"
            with pytest.raises(StageDead) as dead:
                await t.open(nowhere, "f", 0)
            assert isinstance(dead.value, ConnectionError)
            assert fault_kind(dead.value) is FaultKind.DEAD
            await t.close(nowhere, "f", 0)  # nothing held there: a no-op

            # a newer epoch is held: dgr_session's StaleEpoch naming both epochs (the held one
            # as the worker says it, not guessed: two ahead of the stale one)
            await t.open(first, "f", 2)
            with pytest.raises(StaleEpoch) as stale:
                await t.forward(forward_call(first, "f", 0, 0, range(3), [1, 2, 3], None))
            assert (stale.value.session_id, stale.value.epoch) == ("f", 0)
            assert stale.value.held_epoch == 2
            assert fault_kind(stale.value) is FaultKind.PROTOCOL
            with pytest.raises(StaleEpoch):
                await t.open(first, "f", 1)

            # an engine refusal: the engine's typed error, fault "engine_error"
            with pytest.raises(E.PositionMismatch) as position:
                await t.forward(forward_call(first, "f", 2, 0, range(5, 6), [1], None))
            assert fault_kind(position.value) is FaultKind.ENGINE_ERROR
            # the route names another range than the worker serves: refused, nothing changed
            with pytest.raises(E.EngineError) as mismatch:
                await t.forward(forward_call(wrong_range, "f", 2, 0, range(3), [1, 2, 3], None))
            assert mismatch.value.status == "DGR_E_EXPECTATION_RANGE"
            out = await t.forward(forward_call(first, "f", 2, 0, range(3), [1, 2, 3], None))
            assert isinstance(out, Boundary) and out.rows.shape == (3, 64)  # type: ignore[attr-defined]

            # closes are no-ops where nothing is held: older epoch, unknown session, twice
            await t.close(first, "f", 1)
            await t.close(first, "nobody", 0)
            await t.close(first, "f", 2)
            await t.close(first, "f", 2)
            assert t.stats()[first.endpoint].failures == 4

            # the client's own failures (issue 28): fault "client", never the stage's, not
            # counted against it; a session id that cannot be metadata is refused unsent
            with pytest.raises(InvalidIdentifier) as invalid:
                await t.open(first, "bad\nid", 3)
            assert fault_kind(invalid.value) is FaultKind.CLIENT
            await t.client(first.endpoint).aclose()  # gRPC now fails calls in this process
            with pytest.raises(E.ClientCallError) as local:
                await t.open(first, "g", 1)
            assert fault_kind(local.value) is FaultKind.CLIENT
            with pytest.raises(E.ClientCallError):
                await t.forward(forward_call(first, "g", 1, 0, range(3), [1, 2, 3], None))
            assert t.stats()[first.endpoint].failures == 4
            await t.close(first, "g", 1)  # its open was never sent: nothing to close, no call
            assert t.pending_closes == 0

    run(scenario())


def test_a_hung_stage_times_out_and_a_killed_one_is_dead(tiny_llama: Path) -> None:
    worker = WorkerProcess.spawn(tiny_llama, (0, 4), options=OPTIONS)
    try:
        stage = run(describe(worker.address)).stage_spec(worker.address)

        async def scenario() -> None:
            async with GrpcStageTransport(timeout=1.0, close_timeout=0.5) as t:
                await t.open(stage, "h", 0)
                out = await t.forward(forward_call(stage, "h", 0, 0, range(4), [1, 2, 3, 4], None))
                assert isinstance(out, Logits)
                worker.proc.send_signal(signal.SIGSTOP)
                began = time.monotonic()
                with pytest.raises(TimeoutError) as late:
                    await t.forward(forward_call(stage, "h", 0, 1, range(4, 5), [5], None))
                assert fault_kind(late.value) is FaultKind.DEADLINE
                with pytest.raises(TimeoutError):
                    await t.close(stage, "h", 0)
                assert time.monotonic() - began < 1.0 + 0.5 + 1.0
                worker.proc.send_signal(signal.SIGCONT)
                worker.kill()
                with pytest.raises(StageDead):
                    await t.forward(forward_call(stage, "h", 0, 2, range(5, 6), [6], None))
                with pytest.raises(StageDead):
                    await t.open(stage, "h", 1)

        run(scenario())
    finally:
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGCONT)
        worker.stop()


def test_a_close_racing_its_open_leaves_no_session_behind(
    two: list[tuple[WorkerProcess, Advert]],
) -> None:
    """A session that faults while a stage is still opening closes that stage: the close waits
    for the open to land instead of arriving first and leaking the worker's slot."""
    first, _ = stages(two)

    async def scenario() -> int:
        async with GrpcStageTransport() as transport:  # fresh: its first open must Describe
            opening = asyncio.ensure_future(transport.open(first, "race", 0))
            await asyncio.sleep(0)  # the open has started (awaiting the advert), not landed
            await transport.close(first, "race", 0)
            await opening
            return (await describe(two[0][0].address)).capacity.sessions_open

    assert run(scenario()) == 0
