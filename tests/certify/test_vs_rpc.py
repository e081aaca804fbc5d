"""``speed.vs_rpc``: how certify judges the route's decode against llama.cpp RPC with the same
split (the measurement itself runs in ``tests/e2e/test_certify_vs_rpc.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgr_engine.certification.record import Verdict
from dgr_engine.certify.scenarios import RpcComparison, RpcSide, judge_vs_rpc
from dgr_engine.options import EngineOptions


def test_every_layout_at_the_minimum_passes_and_each_has_its_figures() -> None:
    outcome = judge_vs_rpc(
        [RpcComparison(2, 90.0, 100.0), RpcComparison(4, 45.0, 50.0)], 0.9, how="relay"
    )
    assert outcome.requirement.verdict is Verdict.PASS
    assert "2 stages 0.90 (90.0 / 100.0 tok/s), 4 stages 0.90" in outcome.requirement.detail
    assert outcome.requirement.detail.endswith("(relay)")
    figures = {(f.name, f.scenario): (f.value, f.unit) for f in outcome.figures}
    assert figures[("speed.vs_rpc_decode", "2 stages")] == (pytest.approx(0.9), "route/rpc")
    assert figures[("speed.decode_tps.rpc", "4 stages")] == (50.0, "tok/s")


def test_one_layout_below_the_minimum_fails_the_requirement() -> None:
    outcome = judge_vs_rpc([RpcComparison(2, 95.0, 100.0), RpcComparison(3, 80.0, 100.0)], 0.9)
    assert outcome.requirement.verdict is Verdict.FAIL
    assert "3 stages 0.80" in outcome.requirement.detail


def test_rpc_not_run_is_not_measured_with_the_reason() -> None:
    why = "llama.cpp's peers are not built: dgr certify --rpc build builds them"
    outcome = judge_vs_rpc([RpcComparison(2, 90.0, 100.0)], 0.9, not_measured=why)
    assert outcome.requirement.verdict is Verdict.NOT_MEASURED
    assert outcome.requirement.detail == why and outcome.figures == ()


def test_a_failed_rpc_run_leaves_the_requirement_not_measured() -> None:
    failed = RpcComparison(4, 40.0, None, "llama-bench failed")
    comparisons = [RpcComparison(2, 90.0, 100.0), failed]
    outcome = judge_vs_rpc(comparisons, 0.9)
    assert outcome.requirement.verdict is Verdict.NOT_MEASURED
    assert "4 stages: llama-bench failed" in outcome.requirement.detail
    assert [f.scenario for f in outcome.figures if f.name == "speed.vs_rpc_decode"] == ["2 stages"]


def test_no_speed_layout_is_not_measured() -> None:
    assert judge_vs_rpc([], 0.9).requirement.verdict is Verdict.NOT_MEASURED


def test_rpc_runs_with_the_routes_engine_options(tmp_path: Path) -> None:
    options = EngineOptions(n_threads=3, n_batch=32, kv_type="q8_0", flash_attn="on")
    side = RpcSide.of(tmp_path, tmp_path / "m.gguf", options, n_layer=30)
    assert side.server == tmp_path / "bin" / "ggml-rpc-server"
    assert side.config.bench == tmp_path / "bin" / "llama-bench"
    common = side.config.common()
    assert common[:2] == ["-t", "3"]
    assert common[common.index("-ctk") + 1] == "q8_0" and common[common.index("-fa") + 1] == "on"
    assert common[common.index("-b") + 1] == "32"
