"""Kept prefixes at the session table over a real engine (tiny-llama, its first stage): a
session started from a kept prefix computes the rest bit for bit as the session that kept it
did; a shorter start cuts the kept state; an empty start empties an epoch that held positions;
a penalised sampler's last stage starts empty; a session holding fewer positions keeps
nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dgr_engine.engine import ShardEngine
from dgr_engine.wire.frames import ForwardFrame
from dgr_engine.worker.lifecycle.sessions import SessionTable
from dgr_session.sampling import Sampling

KW: dict[str, Any] = {"max_sessions": 4, "n_ctx_per_session": 64, "n_threads": 1, "n_batch": 16}
TOKENS = np.array([5, 9, 2, 7, 11, 3, 8, 4], dtype=np.int32)


def frame(sid: str, start: int, stop: int) -> ForwardFrame:
    positions = np.arange(start, stop, dtype=np.int32)
    return ForwardFrame(sid, 1, 0, positions, TOKENS[start:stop], None, None)


def test_a_session_started_from_a_kept_prefix_computes_the_rest_bit_for_bit(
    tiny_llama: Path,
) -> None:
    with ShardEngine(tiny_llama, layers=(0, 2), **KW) as engine:
        table = SessionTable(engine)
        table.open("first", 1)
        table.forward(frame("first", 0, 4))
        want = table.forward(frame("first", 4, 8)).rows.copy()
        assert table.save_prefix("first", 1, 16) is None  # it holds only 8 positions
        state = table.save_prefix("first", 1, 4)
        assert state is not None
        table.close("first", 1)

        table.open("second", 1)
        assert table.start_from("second", 1, state, 4) == 4
        got = table.forward(frame("second", 4, 8))
        assert got.next_pos == 8
        assert np.array_equal(got.rows, want)  # the same bits: the same chunks

        table.open("third", 1)
        assert table.start_from("third", 1, state, 2) == 2  # cut to 2 positions
        assert table.forward(frame("third", 2, 3)).next_pos == 3
        assert table.start_from("third", 1, None, 0) == 0  # the same epoch, emptied
        assert table.forward(frame("third", 0, 4)).next_pos == 4


def test_a_penalised_samplers_last_stage_starts_empty(tiny_llama: Path) -> None:
    with ShardEngine(tiny_llama, layers=(0, 4), **KW) as engine:  # the whole model: last
        table = SessionTable(engine)
        table.open("first", 1)
        table.forward(frame("first", 0, 4))
        state = table.save_prefix("first", 1, 4)
        assert state is not None
        penalised = Sampling(seed=1, temperature=0.7, repetition_penalty=1.3)
        table.open("second", 1, penalised)
        assert table.start_from("second", 1, state, 4) == 0
