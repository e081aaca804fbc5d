"""``benchmarks.worker_start``: real workers of every certify layout, each one's start split
and its peak and steady memory, run small on a fixture; and how it reads a worker's log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.worker_start import SLACK_MIB, WorkerRow
from dgr_engine.worker.reporting.start_times import StartTimes, phases_in
from tests.harness import REPO


def test_a_workers_ready_line_gives_its_phases() -> None:
    log = (
        "15:38:53.97 INFO    loading\n"
        "15:38:53.978 INFO    stage=- session=- ready in 0.40 s: header 0.09 s, hash 0.00 s, "
        "engine 0.31 s, serve 0.00 s\n"
    )
    phases = phases_in(log)
    assert phases == (("header", 0.09), ("hash", 0.0), ("engine", 0.31), ("serve", 0.0))
    row = WorkerRow(2, (0, 2), 1.4, phases, steady_mib=200.0, peak_mib=200.0 + SLACK_MIB)
    assert row.startup_s == pytest.approx(1.0) and row.met
    assert not WorkerRow(2, (0, 2), 1.4, phases, 200.0, 200.1 + SLACK_MIB).met
    assert phases_in("no such line\n") == ()
    # the line a worker writes reads back as its phases
    stopwatch = StartTimes()
    stopwatch.lap("header")
    stopwatch.lap("engine")
    written = phases_in(f"12:00:00.000 INFO    {stopwatch.text()}\n")
    assert [phase for phase, _ in written] == ["header", "engine"]
    assert all(seconds >= 0 for _, seconds in written)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-v4"])  # V4: token ids on every stage
def test_the_benchmark_starts_each_layout_and_measures_every_worker(
    tmp_path: Path, fixture: str
) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.worker_start", "--fixture", fixture]
        + ["--stages", "1", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "target (peak <= steady + 64 MiB on every worker): met" in done.stdout
    result = json.loads(out.read_text())
    layouts = {layout["stages"]: layout for layout in result["layouts"]}
    assert set(layouts) == {1, 2}
    n_layer = layouts[1]["workers"][0]["layers"][1]
    assert [w["layers"] for w in layouts[2]["workers"]] == [
        [0, n_layer // 2],
        [n_layer // 2, n_layer],
    ]
    for layout in layouts.values():
        assert layout["route_start_s"] > 0
        for worker in layout["workers"]:
            assert set(worker["phases"]) == {"header", "hash", "engine", "serve"}
            assert 0 < worker["steady_mib"] <= worker["peak_mib"]
            assert worker["ready_s"] >= sum(worker["phases"].values())
