"""``benchmarks.serve_turns`` run tiny: a three-turn conversation over ``dgr serve`` with prompt
prefixes kept and without, and over llama-server, on SmolLM2 at a context of its own (its lane
certified by the benchmark's ``--certify`` under a fresh operator home): the table and the JSON
hold every server's first token per turn, and dgr's two conversations are the same text (prefix
reuse is exact)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dgr_engine.cli._own_model import OPERATOR_HOME_ENV
from tests.harness import REPO, RealLane


def test_the_conversation_benchmark_times_every_turn_of_every_server(
    tmp_path: Path, smollm2_lane: RealLane
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DGR_EVIDENCE_DIR", "DGR_LOCK")}
    env[OPERATOR_HOME_ENV] = str(tmp_path / "operator")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.serve_turns", "--stages", "1", "--turns", "3"]
        + ["--max-tokens", "8", "--ctx", "512", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=1800,  # a cold llama-server build is part of it
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "serve_turns.json").read_text())
    assert result["servers"][2] == "llama-server"
    assert [len(f) for f in result["first_token_s"]] == [3, 3, 3]
    assert all(0 < t < 60 for f in result["first_token_s"] for t in f)
    assert result["same_conversation"] is True
    table = (tmp_path / "serve_turns.md").read_text()
    assert table.startswith("A conversation over `dgr serve`") and "| 3 |" in table
