"""Starting workers says what it is doing: ``LoopbackRouteProvider`` tells its ``notice`` when
its workers start and when they are ready, with the seconds it took; a worker that exits
before it listens is an error showing its last log lines."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from dgr_engine.tooling.loopback import LoopbackRouteProvider
from dgr_engine.tooling.processes import WorkerStartFailed


def test_the_provider_says_when_its_workers_start_and_are_ready(tiny_llama: Path) -> None:
    said: list[str] = []

    async def start() -> None:
        provider = LoopbackRouteProvider(
            tiny_llama, [(0, 2), (2, 4)], spares=[(2, 4)], notice=said.append
        )
        async with provider:
            assert said[0] == f"starting 3 workers (2 stages and 1 spare) of {tiny_llama.name} ..."
            assert re.fullmatch(r"3 workers ready in \d+\.\d s", said[1]), said
            await provider.spawn((0, 2))
        assert said[2:3] == ["starting a replacement worker for layers [0,2) ..."], said
        assert re.fullmatch(r"replacement worker \[0,2\) ready in \d+\.\d s", said[3]), said

    asyncio.run(start())
    assert len(said) == 4, said


def test_a_worker_that_exits_before_listening_shows_its_last_log_lines(tiny_smollm3: Path) -> None:
    # an architecture dgr refuses: each worker logs why and exits 2 before it listens
    said: list[str] = []
    provider = LoopbackRouteProvider(tiny_smollm3, [(0, 1), (1, 2)], notice=said.append)
    with pytest.raises(WorkerStartFailed) as caught:
        asyncio.run(provider.start())
    error = caught.value
    first, *log = str(error).splitlines()
    assert re.fullmatch(
        rf"dgr worker \(layers [01]:[12], {re.escape(tiny_smollm3.name)}\) exited with 2 before "
        r"listening; its last log lines:",
        first,
    ), first
    assert 1 <= len(log) <= 10 and all(line.startswith("  ") for line in log), log
    assert "DGR_E_UNSUPPORTED_ARCH: architecture 'smollm3'" in log[-1], log
    assert "Traceback" not in str(error)
    assert error.returncode == 2 and error.command[1] == "worker"
    assert said == [f"starting 2 workers (2 stages) of {tiny_smollm3.name} ..."]  # never "ready"
    assert provider.workers == []
