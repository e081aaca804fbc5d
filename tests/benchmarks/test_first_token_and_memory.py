"""The time-to-first-token and peak-RSS parts of benchmarks.peers and benchmarks.chain: which
figures each row compares, and the per-shard verdict."""

from __future__ import annotations

import pytest

from benchmarks import chain, peers, shard_memory
from benchmarks.first_token import peer_ttft_s
from dgr_engine.fixtures import ensure_fixture

MIB = 1024 * 1024


def _speed(prefill: float, decode: float, ttft: float) -> dict[str, float]:
    return {"prefill_tps": prefill, "decode_tps": decode, "ttft_s": ttft}


def _settings() -> peers.Settings:
    return peers.Settings(
        fixture="m",
        threads=1,
        prompt=128,
        decode=32,
        repeats=1,
        stages=(2, 4),
        sessions=(1,),
        accepted=(),
        kv_type="f16",
        flash_attn="auto",
        variants=(peers.Variant("plain", None, ()),),
        transports=("relay", "ring"),
    )


def test_first_token_rows_compare_each_route_with_rpc_at_its_split() -> None:
    sp = {
        "dgr whole": _speed(1000, 100, 0.128),
        "llama-bench whole": _speed(800, 110, 0.160),
        "dgr 2": _speed(500, 60, 0.30),
        "dgr 2 ring": _speed(450, 70, 0.25),
        "rpc 2": _speed(700, 80, 0.20),
        "dgr 4": _speed(400, 40, 0.40),
        "dgr 4 ring": _speed(380, 50, 0.35),
        "rpc 4": _speed(600, 50, 0.50),
    }
    agg = {"tps": {"batched-bench": {1: 100.0}, "plain": {1: 50.0}}}
    rows = {r["name"]: r for r in peers.table_rows(_settings(), {"speeds": sp}, agg, [])}
    whole = rows["time to first token, prompt 128 (s), whole model"]
    assert (whole["dgr"], whole["peer"]) == (0.128, 0.160)
    assert whole["ratio"] == pytest.approx(0.8)
    ring4 = rows["time to first token, prompt 128 (s), 4 stages [ring]"]
    assert (ring4["dgr"], ring4["peer"]) == (0.35, 0.50)
    assert rows["time to first token, prompt 128 (s), 2 stages"]["ratio"] == pytest.approx(1.5)
    assert not any(r["target"] for n, r in rows.items() if n.startswith("time to first"))


def test_the_peers_first_token_is_their_prompt_time() -> None:
    assert peer_ttft_s(128, 800.0) == pytest.approx(0.16)


def test_chain_first_token_is_start_to_first_stamp_and_decode_excludes_it() -> None:
    # started at 10.0, first token at 10.5, then one every 0.1 s
    stamps = [10.0, 10.5, 10.6, 10.7, 10.8]
    parts = [(1000, 500, 400)] * 3
    run = chain.summarize("relay", 2, 0.0, [(stamps, parts, True)])
    assert run.ttft_ms == pytest.approx(500.0)
    assert run.decode_tps == pytest.approx(10.0)


@pytest.mark.slow  # a python -m benchmarks child process: the fast set starts none
def test_a_shard_row_holds_its_budget_and_verdict() -> None:
    row = shard_memory.shard_row(ensure_fixture("tiny-llama"), 0, 2)
    assert row["layers"] == [0, 2]
    assert row["budget_bytes"] == row["weight_bytes"] + row["kv_bytes"] + 64 * MIB
    assert row["met"] == (row["peak_rss_bytes"] <= row["budget_bytes"])
    assert row["peak_rss_bytes"] > row["weight_bytes"] > 0


def test_the_memory_table_says_met_or_missed_per_shard(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        {
            "stages": 1,
            "layers": [0, 4],
            "weight_bytes": 10 * MIB,
            "kv_bytes": MIB,
            "budget_bytes": 75 * MIB,
            "peak_rss_bytes": 70 * MIB,
            "met": True,
        },
        {
            "stages": 2,
            "layers": [2, 4],
            "weight_bytes": 5 * MIB,
            "kv_bytes": MIB,
            "budget_bytes": 70 * MIB,
            "peak_rss_bytes": 77 * MIB,
            "met": False,
        },
    ]
    peers.print_memory_table(rows)
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| whole model | [0,4) | 10.0 | 1.0 | 75.0 | 70.0 | 0.933 | met |"
    assert out[3] == "| 2 stages | [2,4) | 5.0 | 1.0 | 70.0 | 77.0 | 1.100 | missed |"
