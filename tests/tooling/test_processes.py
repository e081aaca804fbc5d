"""A process that ends (or hangs) before it listens is a typed error that shows its last log
lines: one line saying which worker and what happened, then the tail of its stderr. Run with
small Python programs in the worker's place (no worker process: the fast set)."""

from __future__ import annotations

import sys

import pytest

from dgr_engine.tooling.processes import (
    LOG_TAIL_LINES,
    WorkerProcess,
    WorkerStartFailed,
    WorkerStartTimedOut,
    describe_command,
)
from dgr_session.errors import DgrError

NOISY_EXIT = (
    "import sys\n"
    "for i in range(1, 16):\n"
    "    print(f'log line {i}', file=sys.stderr)\n"
    "print('cannot start the worker: DGR_E_UNSUPPORTED_ARCH', file=sys.stderr)\n"
    "sys.exit(2)\n"
)


def test_an_early_exit_is_one_line_and_the_last_log_lines() -> None:
    with pytest.raises(WorkerStartFailed) as caught:
        WorkerProcess.launch([sys.executable, "-c", NOISY_EXIT, "--layers", "0:2"], 30.0)
    error = caught.value
    assert isinstance(error, DgrError) and isinstance(error, RuntimeError)
    lines = str(error).splitlines()
    python = describe_command([sys.executable])
    assert lines[0] == (
        f"{python} (layers 0:2) exited with 2 before listening; its last log lines:"
    ), lines
    assert lines[1:] == [f"  log line {i}" for i in range(7, 16)] + [
        "  cannot start the worker: DGR_E_UNSUPPORTED_ARCH"
    ]
    assert len(error.log_tail) == LOG_TAIL_LINES and error.returncode == 2


def test_a_worker_that_never_listens_is_stopped_and_says_so() -> None:
    hang = "import sys, threading\nprint('loading', file=sys.stderr, flush=True)\n"
    hang += "threading.Event().wait()\n"  # never listens, never exits
    with pytest.raises(WorkerStartTimedOut) as caught:
        WorkerProcess.launch([sys.executable, "-c", hang], 1.0)
    error = caught.value
    assert isinstance(error, TimeoutError) and error.returncode is None
    assert str(error).splitlines()[0].endswith("not listening after 1 s; its last log lines:")
    assert error.log_tail == ("loading",)


def test_a_silent_exit_says_its_log_is_empty() -> None:
    with pytest.raises(WorkerStartFailed) as caught:
        WorkerProcess.launch([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"], 30.0)
    assert str(caught.value).endswith("was killed by signal 9 before listening; its log is empty")


def test_a_worker_command_is_described_by_its_layers_and_model() -> None:
    args = ["/venv/bin/dgr", "worker", "--model", "/m/tiny-qwen2-d3bf.gguf", "--layers", "0:1"]
    assert describe_command(args) == "dgr worker (layers 0:1, tiny-qwen2-d3bf.gguf)"
    assert describe_command(["/usr/bin/rpc-server", "--port"]) == "rpc-server"
