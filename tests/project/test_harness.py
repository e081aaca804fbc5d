"""The suite's own rules: the fast set starts no worker process, tests under ``tests/e2e/`` are
slow by their path, and every test gets its environment per test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dgr_engine.certification.record import EVIDENCE_DIR_ENV
from tests.harness import REPO, WorkerInFastSet, starts_a_worker


@pytest.mark.parametrize(
    "args",
    [
        ["/x/.venv/bin/dgr", "worker", "--fixture", "tiny-llama", "--layers", "0:4"],
        ["dgr", "certify", "--fixture", "tiny-llama"],
        ["dgr", "demo"],
        ["dgr", "generate", "--spawn", "2"],
        [sys.executable, "-m", "dgr_engine.cli", "worker", "--layers", "0:4"],
        [sys.executable, "-m", "benchmarks.peers"],
        "dgr worker --fixture tiny-llama --layers 0:4",
    ],
)
def test_commands_that_run_a_worker_are_seen(args: list[str] | str) -> None:
    assert starts_a_worker(args)


@pytest.mark.parametrize(
    "args",
    [
        ["dgr", "fixtures", "--help"],
        [sys.executable, "-m", "dgr_engine.cli", "artifacts", "fetch"],
        [sys.executable, "-m", "dgr_engine.cli"],
        [sys.executable, "examples/in_process_route.py"],
        ["git", "status"],
        "echo worker",
    ],
)
def test_other_commands_are_not(args: list[str] | str) -> None:
    assert not starts_a_worker(args)


def test_a_fast_test_cannot_start_a_worker() -> None:
    with pytest.raises(WorkerInFastSet, match="outside the slow set"):
        subprocess.Popen(["dgr", "worker", "--fixture", "tiny-llama", "--layers", "0:4"])
    with pytest.raises(WorkerInFastSet):
        subprocess.run([sys.executable, "-m", "dgr_engine.cli", "certify"], check=False)
    done = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True)
    assert done.stdout == "ok\n"


@pytest.mark.slow
def test_a_slow_test_may_start_processes() -> None:
    assert subprocess.Popen.__name__ == "Popen"


def test_the_environment_is_set_per_test() -> None:
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    evidence = os.environ[EVIDENCE_DIR_ENV]
    assert os.path.isdir(evidence) and os.listdir(evidence) == []


def test_an_e2e_test_is_slow_by_its_path() -> None:
    def collect(marks: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
            + ["-m", marks, str(REPO / "tests" / "e2e")],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        return done.stdout

    assert "deselected" in collect("not slow") and "::" not in collect("not slow")
    slow = collect("slow")
    assert slow.count("tests/e2e/") >= 10, slow
