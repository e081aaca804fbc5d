"""``dgr generate`` end to end: over given endpoints, and over workers it spawns itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dgr_engine._worker_spawn import WorkerProcess
from dgr_engine.generate import DEFAULT_PROMPT, engine_options, whole_model_greedy, worker_args

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ARGS = worker_args(threads=1, ctx=256, batch=64, sessions=4)


def dgr(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run(
        [sys.executable, "-m", "dgr_engine.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


@pytest.fixture(scope="module")
def workers(tiny_llama: Path) -> Iterator[list[WorkerProcess]]:
    started = [WorkerProcess.spawn(tiny_llama, r, extra_args=ARGS) for r in ((0, 3), (3, 4))]
    try:
        yield started
    finally:
        for w in started:
            w.stop()


def test_generate_over_given_endpoints(workers: list[WorkerProcess], tiny_llama: Path) -> None:
    endpoints = ",".join(w.address for w in workers)
    done = dgr("generate", "--endpoints", endpoints, "-n", "10", "--allow-dark-lanes", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    options = engine_options(threads=1, ctx=256, batch=64, sessions=4)
    assert report["tokens"] == whole_model_greedy(tiny_llama, [DEFAULT_PROMPT], 10, options)[0]
    assert (report["state"], report["epoch"], report["route_changes"]) == ("done", 1, 0)
    assert [s["layers"] for s in report["stages"]] == [[0, 3], [3, 4]]

    # fixture lanes are dark: without the explicit opt-in the route is refused, typed
    refused = dgr("generate", "--endpoints", endpoints, "-n", "4", "--step-deadline", "5")
    assert refused.returncode == 1
    assert "failed:" in refused.stderr and "dark" in refused.stderr


def test_generate_over_spawned_workers_checks_the_whole_model() -> None:
    done = dgr("generate", "--spawn", "3", "--fixture", "tiny-llama", "-n", "12", "--check")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) == 12
    assert "whole-model equal: True" in done.stderr
    assert done.stderr.count("forwards 12") == 3
