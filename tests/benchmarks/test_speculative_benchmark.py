"""benchmarks/speculative.py at the smallest scale: tiny-llama, 2 stages, loopback and 10 ms
per link, a few tokens, one round; every cell is measured, saved and exact, and a bad
argument is one line and exit 2."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import speculative

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.speculative", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"),
        timeout=300,
        check=False,
    )


def test_every_cell_is_measured_and_exact(tmp_path: Path) -> None:
    args = ["--fixture", "tiny-llama", "--stages", "2", "--rtts", "0,10", "--tokens", "10"]
    done = run([*args, "--rounds", "1", "--prompt", "12", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stderr
    assert "shares its cores" in done.stdout
    assert "tokens exact vs the whole model's, sampler for sampler, in every cell: True" in (
        done.stdout
    )
    result = json.loads((tmp_path / "speculative.json").read_text())
    cells = {
        (c["stages"], c["rtt_ms"], c["transport"], c["workload"], c["sampling"], c["drafter"]): c
        for c in result["cells"]
    }
    want = itertools.product(
        [2],
        [0.0, 10.0],
        speculative.TRANSPORTS,
        speculative.WORKLOADS,
        speculative.SAMPLINGS,
        speculative.DRAFTERS,
    )
    assert set(cells) == set(want)
    assert result["exact"] is True and all(c["exact"] for c in cells.values())
    for key, c in cells.items():
        assert c["tps"] > 0 and c["ms_per_pass"] > 0, key
        assert 0 < c["engine_ms_per_pass"] < c["ms_per_pass"], key  # the engines' share
        if c["drafter"] == "plain":
            assert c["drafted"] == 0 and c["speedup"] == 1.0 and c["route_passes"] == 9
        if c["drafter"] == "self" and c["sampling"] == "greedy":  # its own draft: all kept
            assert c["acceptance"] == 1.0 and c["tokens_per_pass"] > 1.0, key
            assert c["route_passes"] < 9, key
    # the loopback targets are judged for every n-gram cell (no 4-stage 30 ms cell here)
    names = {t["name"] for t in result["targets"]}
    assert len(names) == 8 and all(n.startswith("loopback, 2 stages") for n in names)
    assert (tmp_path / "speculative.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_argument_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = run(["--fixture", "tiny-llama", "--k-max", "17", "--out", str(tmp_path)])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("benchmarks.speculative: need")
    assert not (tmp_path / "speculative.json").exists()
