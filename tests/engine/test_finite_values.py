"""Finite values only (issue 12, item 3): a worker refuses NaN/Inf boundary rows before its
engine sees them (the session unchanged), reports an engine output that is not finite as a
typed fault and closes that session, and samplers refuse non-finite logits.

A real ``dgr worker`` for layers [1, 4) of tiny-llama; its input rows come from layer 0 run
in-process, its logits are compared bit for bit with a session that never saw the bad frame.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine.client.shard_client import ShardClient, expectations_of
from dgr_engine.engine.sampling import SeededSampler
from dgr_engine.errors import FrameRejected, NonFiniteOutput, UnknownSession
from dgr_engine.tooling.processes import WorkerProcess
from dgr_engine.wire.frames import ForwardFrame
from dgr_engine.wire.status import STATUS_KEY, error_from_trailers, grpc_status_for
from dgr_engine.worker.lifecycle.sessions import SessionTable
from dgr_session import FaultKind, NonFiniteLogits, fault_kind, greedy
from tests.harness import run

T = TypeVar("T")
PROMPT = [3, 14, 15, 92, 65, 35]
KW: dict[str, Any] = {"max_sessions": 4, "n_ctx_per_session": 256, "n_threads": 1, "n_batch": 64}
ARGS = ["--max-sessions", "4", "--ctx", "256", "--threads", "1", "--batch", "64"]


@pytest.fixture(scope="module")
def tail_worker(tiny_llama: Path) -> Iterator[str]:
    with WorkerProcess.spawn(tiny_llama, (1, 4), extra_args=ARGS) as worker:
        yield worker.address


@pytest.fixture(scope="module")
def first_rows(tiny_llama: Path) -> np.ndarray:
    with ShardEngine(tiny_llama, layers=(0, 1), **KW) as head:
        head.open_session(1, 0)
        return head.forward(1, 0, np.arange(len(PROMPT)), tokens=np.array(PROMPT, np.int32))


@pytest.mark.slow
def test_a_nan_frame_is_refused_and_leaves_the_session_as_it_was(
    tail_worker: str, first_rows: np.ndarray
) -> None:
    async def main() -> tuple[np.ndarray, np.ndarray, FrameRejected]:
        async with ShardClient(tail_worker, timeout=20.0, streaming=False) as client:
            expect = expectations_of(await client.describe())
            positions = range(len(PROMPT))
            await client.open("clean", 1, expect)
            clean = await client.forward("clean", 1, 0, expect, positions, boundary=first_rows)
            await client.open("hit", 1, expect)
            poisoned = first_rows.copy()
            poisoned[2, 7] = np.nan
            with pytest.raises(FrameRejected) as caught:
                await client.forward("hit", 1, 0, expect, positions, boundary=poisoned)
            after = await client.forward("hit", 1, 0, expect, positions, boundary=first_rows)
            for session in ("clean", "hit"):
                await client.close(session, 1)
            return clean.output, after.output, caught.value

    clean, after, refusal = run(main())
    assert refusal.status == "DGR_E_FRAME"
    assert "non-finite values (1; first at row 2, column 7" in str(refusal)
    assert np.isfinite(after).all()
    assert np.array_equal(after, clean)  # bit for bit: the refused frame changed nothing


class PoisoningEngine:
    """A real engine whose next output is replaced by NaN once (finite inputs do not make
    llama.cpp's norms overflow, so the fault is staged at the boundary the worker checks)."""

    def __init__(self, engine: ShardEngine) -> None:
        self.engine = engine
        self.info = engine.info
        self.poison_next = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def forward(self, *args: Any, **kwargs: Any) -> np.ndarray:
        out = self.engine.forward(*args, **kwargs)
        if self.poison_next:
            self.poison_next = False
            out = np.full_like(out, np.nan)
        return out


def test_non_finite_engine_output_is_a_typed_fault_and_closes_the_session(
    tiny_llama: Path, first_rows: np.ndarray
) -> None:
    with ShardEngine(tiny_llama, layers=(1, 4), **KW) as engine:
        poisoning = PoisoningEngine(engine)
        table = SessionTable(poisoning)
        table.open("s", 1)
        positions = np.arange(len(PROMPT), dtype=np.int32)
        frame = ForwardFrame("s", 1, 0, positions, None, first_rows, None)
        poisoning.poison_next = True
        with pytest.raises(NonFiniteOutput, match="session was closed") as caught:
            table.forward(frame)
        assert not table.holds("s") and engine.stats().open_sessions == 0
        with pytest.raises(UnknownSession):  # nobody may continue a poisoned KV
            table.forward(frame)
    assert caught.value.status == "DGR_E_NON_FINITE"
    assert fault_kind(caught.value) is FaultKind.ENGINE_ERROR  # re-prefill elsewhere


def test_non_finite_output_crosses_the_wire_typed() -> None:
    error = NonFiniteOutput("DGR_E_NON_FINITE: x")
    code, status = grpc_status_for(error)
    assert (code, status) == (grpc.StatusCode.INTERNAL, "DGR_E_NON_FINITE")
    back = error_from_trailers(code, ((STATUS_KEY, status),), "x")
    assert isinstance(back, NonFiniteOutput)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", ["array", "list"])
def test_samplers_refuse_non_finite_logits(bad: float, kind: str) -> None:
    values = np.array([0.5, 2.0, 1.0, -3.0], dtype=np.float32)
    values[2] = bad
    logits: Any = values if kind == "array" else values.tolist()
    with pytest.raises(NonFiniteLogits):
        greedy(logits)
    with pytest.raises(NonFiniteLogits):
        SeededSampler.of(seed=1)(logits, 0)
    assert fault_kind(NonFiniteLogits("x")) is FaultKind.ENGINE_ERROR


def test_all_nan_logits_no_longer_give_token_zero() -> None:
    with pytest.raises(NonFiniteLogits):
        greedy(np.full(8, np.nan, dtype=np.float32))
    assert greedy(np.array([0.0, 1.0, 1.0])) == 1  # finite logits: unchanged
