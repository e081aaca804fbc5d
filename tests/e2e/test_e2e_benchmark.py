"""Smoke runs of the benchmarks that stand behind issue figures (``pipeline``, ``grpc_floor``,
``engine_idle``) on tiny inputs: they run, and print and save what they claim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(name: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m benchmarks.<name>`` with ``args`` (bounded); asserts it exited 0."""
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_pipeline_benchmark_smoke(tmp_path: Path) -> None:
    args = ["--fixture", "tiny-llama", "--prompt", "8", "--decode", "8", "--repeats", "1"]
    args += ["--stages", "2", "--frames", "20", "--out", str(tmp_path)]
    done = run_benchmark("pipeline", args)
    assert "whole " in done.stdout and "dgr 2 " in done.stdout
    assert "echo 4x4096" in done.stdout
    result = json.loads((tmp_path / "pipeline.json").read_text())
    assert [s["name"] for s in result["speeds"]] == ["whole", "dgr 2"]
    assert all(s["decode_tps"] > 0 and s["prefill_tps"] > 0 for s in result["speeds"])
    assert set(result["seam_overhead_us"]) == {"route dense 64", "echo 64", "echo 4x4096"}
    for name, parts in result["seam_parts_us"].items():  # the echo hops, split
        assert set(parts) == {"client", "transit", "worker"} and parts["transit"] > 0, name
    # where the route's time goes, beside the bare-gRPC floor measured in the same run
    (part,) = result["breakdown_ms_per_token"]
    assert part["stages"] == 2 and part["floor_us"] > 0 and 0 < part["best_ratio"] < 1
    assert part["engine_ms"] > 0 and part["seam_ms"] > 0 and part["transit_ms"] > 0
    assert part["worker_ms"] >= 0 and 0 < part["dgr_free_ratio"]
    # one round: the four parts are that run's time per token, nothing left out
    (route,) = [s for s in result["speeds"] if s["name"] == "dgr 2"]
    total = sum(part[k] for k in ("engine_ms", "worker_ms", "transit_ms", "client_ms"))
    assert total == pytest.approx(route["decode_ms"], rel=1e-6)
    assert "floor µs/hop" in done.stdout and "dgr-free" in done.stdout
    assert (tmp_path / "pipeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_is_written_without_matplotlib(tmp_path: Path) -> None:
    import struct
    import zlib

    from benchmarks import pipeline

    speeds = [
        pipeline.Speed("whole", 0, 200.0, 60.0, 16.7),
        pipeline.Speed("dgr 2", 2, 190, 50, 20),
    ]
    out = tmp_path / "plain.png"
    pipeline._plain_png(out, speeds, {"echo 4x4096": 400.0})
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    (length,) = struct.unpack(">I", data[33:37])
    assert data[37:41] == b"IDAT"
    raw = zlib.decompress(data[41 : 41 + length])
    assert len(raw) == height * (1 + 3 * width)


def test_grpc_floor_benchmark_smoke() -> None:
    args = ["--bytes", "64", "--busy-ms", "0", "1", "--frames", "20"]
    args += ["--idle-ms", "1", "--busy-kind", "memory", "spin"]
    done = run_benchmark("grpc_floor", args)
    rows = [line.split() for line in done.stdout.splitlines()[2:]]
    assert [(r[0], r[2]) for r in rows] == [
        ("memory", "0.0"),
        ("memory", "1.0"),
        ("spin", "0.0"),
        ("spin", "1.0"),
    ]
    assert all(float(r[3]) > 0 for r in rows)


def test_engine_idle_benchmark_smoke(tmp_path: Path) -> None:
    args = ["--fixture", "tiny-llama", "--gaps", "1", "--forwards", "4", "--repeats", "1"]
    done = run_benchmark("engine_idle", [*args, "--out", str(tmp_path)])
    table = json.loads((tmp_path / "engine_idle.json").read_text())["ms_per_forward_by_gap"]
    # back to back (gap 0) is always measured, for the whole model and its first half
    assert set(table) == {"whole", "first half"}
    assert all(set(by_gap) == {"0", "1"} for by_gap in table.values())
    assert all(ms > 0 for by_gap in table.values() for ms in by_gap.values())
    assert "vs 0" in done.stdout


def test_wan_benchmark_smoke(tmp_path: Path) -> None:
    args = ["--rtts", "0,30", "--tokens", "8", "--kill-at", "4", "--out", str(tmp_path)]
    done = run_benchmark("wan", args)
    assert "RTT/hop ms" in done.stdout and "cores shared" in done.stdout
    result = json.loads((tmp_path / "wan.json").read_text())
    runs = result["runs"]
    assert [r["rtt_ms"] for r in runs] == [0.0, 30.0]
    assert all(r["exact"] and r["decode_tps"] > 0 and r["recovery_s"] > 0 for r in runs)
    # 30 ms per hop: two hops per token, so at most 1 / 0.06 tokens per second
    assert runs[1]["decode_tps"] < 1 / 0.06
    assert runs[1]["recovery_s"] > 0.06  # the re-prefill crosses the slow hops too


def test_numerics_benchmark_smoke(tmp_path: Path) -> None:
    args = ["--models", "hf-llama-headdim", "--speed-fixture", "tiny-llama", "--rounds", "1"]
    done = run_benchmark("numerics", [*args, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "numerics.json").read_text())
    exact = [r for r in result["error"] if (r["kv"], r["fa"]) == ("f32", "off")]
    assert len(exact) == 1 and exact[0]["max_abs"] < 1e-4 and exact[0]["tokens_equal"]
    assert len(result["error"]) == len(result["speed"]) == 5
    # tiny-llama's 16-wide heads: llama.cpp refuses a q8_0 cache, and the table says so
    (q8,) = [r for r in result["speed"] if r["kv"] == "q8_0"]
    assert "does not divide n_embd_head_k=16" in q8["refused"]
    assert all(r["decode_vs_default"] > 0 for r in result["speed"] if "refused" not in r)
    assert "refused: K cache type q8_0" in done.stdout


def test_artifacts_benchmark_smoke(tmp_path: Path) -> None:
    done = run_benchmark("artifacts", ["--split", "tiny-llama-split", "--out", str(tmp_path)])
    assert "sha256sum (peer)" in done.stdout
    result = json.loads((tmp_path / "artifacts.json").read_text())
    rows = {r["what"]: r for r in result["rows"]}
    chunks = result["chunks"]
    assert rows["fetch (all files)"]["hashed_chunks"] == chunks
    assert rows["verify (every chunk)"]["hashed_chunks"] == chunks
    for resumed in ("verify resumed from half-way", "fetch resumed from half-way"):
        row = rows[resumed]
        assert row["trusted_chunks"] > 0 and row["hashed_chunks"] + row["trusted_chunks"] == chunks


def test_artifact_verify_benchmark_smoke(tmp_path: Path) -> None:
    args = ["--gib", "0.02", "--files", "2", "--chunk-mib", "1", "--repeats", "1"]
    done = run_benchmark("artifact_verify", [*args, "--out", str(tmp_path)])
    assert "load check, page cache warm" in done.stdout
    result = json.loads((tmp_path / "artifact_verify.json").read_text())
    assert result["bytes"] == 2 * (int(0.02 * 2**30) // 2)
    rows = {r["what"]: r for r in result["rows"]}
    for what in ("load check, page cache warm", "load check, page cache dropped"):
        assert rows[what]["s_per_gib"] > 0 and len(rows[what]["seconds"]) == 1


def test_recovery_benchmark_smoke(tmp_path: Path) -> None:
    args = ["--fixture", "tiny-llama", "--accepted", "8,48", "--seeds", "6", "--out", str(tmp_path)]
    done = run_benchmark("recovery", args)
    assert "target: batched recovery <= 1.3 x prefill" in done.stdout
    result = json.loads((tmp_path / "recovery.json").read_text())
    runs = {(r["accepted"], r["mode"]): r for r in result["runs"]}
    modes = ("batched", "exact", "exact-serial")
    assert set(runs) == {(k, mode) for k in (8, 48) for mode in modes}
    assert "exact replay at k 48: pipelined" in done.stdout
    for run in runs.values():  # the same tokens as the whole model, in every mode
        assert run["exact"] and run["recovery_s"] > 0 and run["prefill_s"] > 0
    for figures in result["exactness"]:
        assert figures["seeds"] == 6 and 0 <= figures["differing"] <= 6
        assert 0 <= figures["median_logit_diff"] <= figures["max_logit_diff"] < 0.1


def test_security_benchmark_smoke(tmp_path: Path) -> None:
    args = ["--rounds", "1", "--tokens", "8", "--out", str(tmp_path)]
    done = run_benchmark("security", args)
    assert "secure / plaintext decode:" in done.stdout and "same tokens: True" in done.stdout
    result = json.loads((tmp_path / "security.json").read_text())
    assert result["grant_verify_us"] > 0 and result["secret_check_us"] > 0
    assert len(result["speeds"]["plaintext"]) == len(result["speeds"]["mutual TLS + grants"]) == 1


def test_observability_benchmark_smoke() -> None:
    done = run_benchmark("observability", ["--frames", "500"])
    assert "metrics (counters + 2 histograms)" in done.stdout
    assert "observability adds" in done.stdout
