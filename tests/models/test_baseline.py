"""DGR-020's baseline runner on the converter-made fixtures: the two exactness levels, the negative
control, the record and the gate, and bad input refused in one line with nothing left behind."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest

from dgr_engine import ShardEngine
from dgr_engine.baseline import converter, runs
from dgr_engine.baseline.compare import compare
from dgr_engine.baseline.errors import (
    ArchitectureNotCovered,
    ConversionFailed,
    ExtrasMissing,
    HfModelInvalid,
    MetadataDisagrees,
)
from dgr_engine.baseline.runner import (
    BaselineResult,
    baseline_record,
    prompts_for,
    run_baseline,
    write_baseline_record,
)
from dgr_engine.certification.gates import evaluate
from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.record import RecordKind, Verdict, load_evidence
from dgr_engine.fixtures import converted
from dgr_engine.numerics import EXACT, Numerics
from dgr_engine.reference import InProcessRoute
from dgr_engine.tooling.processes import dgr_command
from dgr_session.identity import EvidenceClass

pytestmark = pytest.mark.slow  # transformers on the CPU: seconds a test, CI runs it

EXACT_BOUND = 1e-4
"""float32 noise: the bound the exact setting meets against transformers (measured ~1e-5)."""


DENSE = tuple(name for name in converted.names() if name not in converted.V4_SPECS)
"""Every dense family's converter-made fixtures: Llama, Qwen 2 and 3, Phi-3, Gemma 3."""


@pytest.fixture(scope="module", params=DENSE)
def fixture(request: pytest.FixtureRequest) -> converted.ConvertedFixture:
    return converted.ensure_converted(request.param)


@pytest.fixture(scope="module")
def exact(fixture: converted.ConvertedFixture) -> BaselineResult:
    return run_baseline(fixture.hf_dir, gguf=fixture.gguf, numerics=EXACT, n_decode=8)


def test_exact_numerics_match_transformers_to_float32_noise(exact: BaselineResult) -> None:
    c = exact.comparison
    assert c.max_abs <= EXACT_BOUND, c
    assert c.max_rel <= EXACT_BOUND
    assert c.top1_agreement == 1.0 and c.tokens_equal
    assert c.positions == 2 * 24


def test_every_split_matches_transformers_too(
    exact: BaselineResult, fixture: converted.ConvertedFixture
) -> None:
    prompt = list(exact.work.prompts[0])
    reference = exact.reference.logits[0]
    n = exact.n_layer
    for cut in {(0, 1, n), (0, n - 1, n), (0, n // 2, n), tuple(range(n + 1))}:
        engines = [
            ShardEngine(
                fixture.gguf, layers=r, numerics=EXACT, max_sessions=1, n_ctx_per_session=64
            )
            for r in zip(cut[:-1], cut[1:], strict=True)
        ]
        try:
            chain = InProcessRoute(engines)
            chain.open(1, 0)
            logits = chain.forward(1, 0, prompt, 0, all_logits=True)
        finally:
            for engine in engines:
                engine.close()
        assert np.array_equal(logits, exact.llama.logits[0]), cut  # bit-identical to the whole
        assert float(np.abs(logits - reference).max()) <= EXACT_BOUND


def test_the_negative_control_fails_parity(exact: BaselineResult) -> None:
    limits = load_lock(None).thresholds
    assert exact.parity_ok(limits) and exact.negative_ok(limits)
    assert exact.negative.max_abs > 100 * limits.baseline_max_abs_logit


def test_the_default_numerics_are_measured_not_assumed(
    exact: BaselineResult, fixture: converted.ConvertedFixture
) -> None:
    work = exact.work
    default = runs.in_child(runs.run_llama, str(fixture.gguf), Numerics(), work)
    c = compare(exact.reference.logits, default.logits, exact.reference.tokens, default.tokens)
    # f16 KV and flash attention: errors of ~1e-2, far above float32 noise and the locked 1e-3
    assert 1e-3 < c.max_abs < 0.1
    assert c.max_abs > 50 * exact.comparison.max_abs


def test_a_record_is_written_and_dgr_020_decides_from_it(
    exact: BaselineResult, tmp_path: Path
) -> None:
    lock = load_lock(None)
    started = dt.datetime.now(dt.UTC)
    record, path = write_baseline_record(
        exact, lock=lock, evidence_dir=tmp_path, started=started, command=["test"]
    )
    assert record.kind is RecordKind.BASELINE
    assert record.evidence_class is EvidenceClass.FIXTURE
    assert (record.lane.kv_type, record.lane.flash_attn) == ("f32", "off")
    assert record.figure("baseline.max_abs_logit").value == exact.comparison.max_abs
    assert record.requirement("baseline.parity").verdict is Verdict.PASS
    assert record.requirement("baseline.negative_control").verdict is Verdict.PASS
    loaded = load_evidence(tmp_path, lock)
    assert [r.record_id for r in loaded.records] == [record.record_id] and path.is_file()
    verdict = evaluate("DGR-020", loaded.records, lock, EvidenceClass.FIXTURE)
    speed_ok = record.requirement("baseline.speed").verdict is Verdict.PASS
    assert verdict.verdict == ("go" if speed_ok else "optimize baseline")


def test_at_the_defaults_the_error_is_recorded_in_the_lane_and_dgr_020_stops(
    tmp_path: Path,
) -> None:
    fixture = converted.ensure_converted("hf-llama-gqa")
    default = run_baseline(fixture.hf_dir, gguf=fixture.gguf, n_decode=4)
    lock = load_lock(None)
    record, _ = write_baseline_record(
        default, lock=lock, evidence_dir=tmp_path, started=dt.datetime.now(dt.UTC), command=["t"]
    )
    assert (record.lane.kv_type, record.lane.flash_attn) == ("f16", "auto")
    assert 1e-3 < record.figure("baseline.max_abs_logit").value < 0.1
    assert record.requirement("baseline.parity").verdict is Verdict.FAIL
    assert record.requirement("baseline.negative_control").verdict is Verdict.PASS
    verdict = evaluate(
        "DGR-020", load_evidence(tmp_path, lock).records, lock, EvidenceClass.FIXTURE
    )
    assert verdict.verdict == "stop"
    assert "locked <= 0.001" in verdict.text()


def test_a_parity_failure_stops_dgr_020(exact: BaselineResult) -> None:
    lock = load_lock(None)
    worse = attrs.evolve(exact, comparison=attrs.evolve(exact.comparison, max_abs=0.02))
    record = baseline_record(
        worse,
        lock=lock,
        started=dt.datetime.now(dt.UTC),
        command=["test"],
    )
    assert record.requirement("baseline.parity").verdict is Verdict.FAIL
    assert evaluate("DGR-020", [record], lock, EvidenceClass.FIXTURE).verdict == "stop"
    blind = attrs.evolve(exact, negative=exact.comparison)  # a check that cannot tell models apart
    record = baseline_record(blind, lock=lock, started=record.started_at, command=["test"])
    assert record.requirement("baseline.parity").verdict is Verdict.FAIL
    assert "negative control" in record.requirement("baseline.parity").detail


def test_dgr_baseline_prints_the_verdict_and_its_figures(tmp_path: Path) -> None:
    done = subprocess.run(
        [dgr_command(), "baseline", "--fixture", "hf-llama-gqa", "--kv-type", "f32"]
        + ["--flash-attn", "off", "--evidence", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode in (0, 1), done.stderr
    out = done.stdout
    assert "logits: max |d| " in out and "greedy tokens equal" in out
    assert "speed (tok/s, llama.cpp / transformers): decode " in out
    assert "pass         baseline.parity" in out
    assert "pass         baseline.negative_control" in out
    assert "DGR-020: " in out and " at fixture class" in out
    assert len(list(tmp_path.rglob("*.json"))) == 1


# --- bad input ---------------------------------------------------------------------------------


@pytest.fixture()
def hf_copy(tmp_path: Path) -> Iterator[Path]:
    src = converted.ensure_converted("hf-llama-gqa").hf_dir
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    yield dst


def refused(argv: list[str]) -> str:
    done = subprocess.run(
        [dgr_command(), "baseline", *argv, "--no-record"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dgr baseline: "), done.stderr
    return lines[0]


def test_a_directory_without_config_or_weights_is_refused(hf_copy: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no config.json" in refused([str(empty)])
    (hf_copy / "model.safetensors").unlink()
    assert "no weights" in refused([str(hf_copy)])
    with pytest.raises(HfModelInvalid, match="not a directory"):
        converter.read_config(tmp_path / "absent")


def test_an_uncovered_architecture_is_refused_before_converting(hf_copy: Path) -> None:
    config = json.loads((hf_copy / "config.json").read_text())
    config["architectures"] = ["SmolLM3ForCausalLM"]
    (hf_copy / "config.json").write_text(json.dumps(config))
    line = refused([str(hf_copy)])
    assert "architecture SmolLM3ForCausalLM is not covered: dgr runs LlamaForCausalLM" in line
    assert "(GGUF deepseek4, gemma3, llama, phi3, qwen2, qwen3)" in line
    with pytest.raises(ArchitectureNotCovered):
        converter.convert(hf_copy, hf_copy.parent / "x.gguf")
    assert not (hf_copy.parent / "x.gguf").exists()


def test_a_failed_conversion_leaves_nothing_behind(hf_copy: Path, tmp_path: Path) -> None:
    weights = hf_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    out_dir = tmp_path / "out"
    with pytest.raises(ConversionFailed, match="llama.cpp's converter failed"):
        converter.convert(hf_copy, out_dir / "model.gguf")
    assert list(out_dir.iterdir()) == []


def test_a_gguf_that_disagrees_with_the_config_is_refused() -> None:
    other = converted.ensure_converted("hf-llama-headdim")
    gqa = converted.ensure_converted("hf-llama-gqa")
    line = refused([str(other.hf_dir), "--gguf", str(gqa.gguf)])
    assert "key_length is 16, the config implies 32" in line
    with pytest.raises(MetadataDisagrees):
        run_baseline(other.hf_dir, gguf=gqa.gguf)


def test_missing_extras_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from dgr_engine.baseline import tiny_hf

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ExtrasMissing, match=r"dgr\[baseline\]"):
        tiny_hf.build_model(tiny_hf.SPECS["hf-llama-gqa"])


def test_prompts_are_seeded_and_avoid_special_ids() -> None:
    assert prompts_for(320) == prompts_for(320)
    assert all(3 <= t < 320 for p in prompts_for(320) for t in p)
