"""``benchmarks.serve_latency`` run tiny: one round of dgr serve over one worker against
llama-server (built from the same llama.cpp workspace), SmolLM2, four tokens; its table and
its JSON hold both servers' figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO, RealLane


def test_the_benchmark_measures_dgr_serve_against_llama_server(
    tmp_path: Path, smollm2_lane: RealLane
) -> None:
    serve_args = smollm2_lane.serve_arg_flags()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.serve_latency", "--stages", "1", "--rounds", "1"]
        + ["--max-tokens", "4", "--sampled", "--out", str(tmp_path), *serve_args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=1800,  # a cold llama-server build is part of it
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| llama-server |" in done.stdout and "| dgr serve --spawn 1 |" in done.stdout
    result = json.loads((tmp_path / "serve_latency.json").read_text())
    rows = {row["name"]: row for row in result["rows"]}
    assert set(rows) == {"llama-server", "dgr serve --spawn 1"}
    for row in rows.values():
        assert 0 < row["first_token_s"] < 60 and len(row["runs"]) == 1
        assert row["tokens"] >= 2 and row["decode_tps"] > 0
    assert rows["llama-server"]["ratio_first_token"] == rows["llama-server"]["ratio_decode"] == 1.0
    assert result["sampling"]["temperature"] == 0.7  # asked as a chat client asks
    assert (tmp_path / "serve_latency.md").read_text().startswith("`dgr serve` against")
