"""``benchmarks.serve_load`` run tiny: two concurrent chat clients against ``dgr serve`` over
one worker and ``llama-server -np 2`` on SmolLM2, greedy and sampled: the table and the JSON
hold both servers' aggregate tok/s and median first token for each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO, RealLane


def test_the_load_benchmark_measures_both_servers_under_concurrent_clients(
    tmp_path: Path, smollm2_lane: RealLane
) -> None:
    serve_args = smollm2_lane.serve_arg_flags()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.serve_load", "--stages", "1", "--clients", "2"]
        + ["--requests", "1", "--max-tokens", "4", "--out", str(tmp_path), *serve_args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=1800,  # a cold llama-server build is part of it
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "serve_load.json").read_text())
    assert [(r["clients"], r["sampling"]) for r in result["rows"]] == [
        (2, "greedy"),
        (2, "sampled"),
    ]
    for row in result["rows"]:
        for side in (row["dgr"], row["llama_server"]):
            assert side["requests"] == 2 and side["tokens"] >= 2
            assert side["tok_s"] > 0 and 0 < side["first_token_p50_s"] < 60
    assert (tmp_path / "serve_load.md").read_text().startswith("Concurrent chat clients")
