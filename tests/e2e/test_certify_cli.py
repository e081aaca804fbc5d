"""``dgr certify`` and ``dgr gate`` as a user runs them, on the records this test run made.

``fixture_evidence`` (conftest) ran ``dgr certify`` on the dense and the V4 fixture; these
tests read what it printed and wrote, and evaluate the gates on those records.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from gguf import GGUFWriter

from dgr_engine.certification.gates import CORRECTNESS
from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.record import RecordKind, Verdict, load_evidence
from dgr_engine.certify.runner import layouts_for
from dgr_engine.cli import main
from dgr_engine.fixtures import llama, lookup
from dgr_engine.fixtures.catalog import FixtureSpec
from dgr_engine.tooling.processes import dgr_command
from dgr_session.identity import EvidenceClass

pytestmark = pytest.mark.slow


def gate(capsys: pytest.CaptureFixture[str], evidence: Path, *args: str) -> tuple[int, str]:
    code = main(["gate", *args, "--evidence", str(evidence)])
    return code, capsys.readouterr().out


def test_certify_shows_progress_and_writes_one_record_per_lane(fixture_evidence: Path) -> None:
    for name in ("tiny-llama", "tiny-v4"):
        log = (fixture_evidence.parent / f"certify-{name}.log").read_text()
        assert "in the lock's fixture-" in log, log
        assert "fixture evidence: fixture mark 'dgr-fixtures/" in log, log
        assert "layouts: 2 stages, 3 stages, 4 stages" in log, log
        for step in ("[1/3]", "[2/3]", "[3/3]"):
            assert step in log, log
        assert "stage lost mid-decode" in log and "isolation: pass" in log, log
    loaded = load_evidence(fixture_evidence, load_lock())
    assert not loaded.refused
    assert sorted(r.family for r in loaded.records) == ["dense", "v4"]
    for record, path in zip(loaded.records, loaded.paths, strict=True):
        assert record.kind is RecordKind.CERTIFICATION
        assert record.evidence_class is EvidenceClass.FIXTURE  # derived from the GGUF's mark
        assert path.relative_to(fixture_evidence).parts[:2] == ("fixture", record.lane_id)
        assert record.command[:2] == ("dgr", "certify") and "--ctx" in record.command
        for rid in CORRECTNESS:  # every correctness requirement measured and met
            req = record.requirement(rid)
            assert req is not None and req.verdict is Verdict.PASS, (rid, req)
        rpc = record.requirement("speed.vs_rpc")  # the suite certifies with --rpc off (the
        # measured path: tests/e2e/test_certify_vs_rpc.py)
        assert rpc is not None and rpc.verdict is Verdict.NOT_MEASURED, rpc
        assert "--rpc off" in rpc.detail and "--rpc" in record.command, rpc
        units = {f.name: f.unit for f in record.figures}
        assert units["speed.decode_ratio"] == "whole/route"
        assert units["failure.recovery_s"] == "s" and units["rss.peak.stage0"] == "MiB"
        # the peak is the high-water mark since start, its steady RSS beside it
        figures = {(f.name, f.scenario): f.value for f in record.figures}
        for (name, scenario), peak in figures.items():
            if name.startswith("rss.peak."):
                steady = figures[(name.replace("peak", "steady"), scenario)]
                assert 0 < steady <= peak, (name, scenario)
        shares = [
            record.figure(f"hop.{p}_share") for p in ("engine", "worker", "transit", "client")
        ]
        assert all(f is not None for f in shares)
        assert sum(f.value for f in shares if f is not None) == pytest.approx(1.0)
        assert record.lock_sha256 == load_lock().sha256 and record.started_at < record.ended_at


def test_gate_054_at_fixture_class_names_the_measured_bottleneck(
    capsys: pytest.CaptureFixture[str], fixture_evidence: Path
) -> None:
    code, out = gate(capsys, fixture_evidence, "DGR-054", "--class", "fixture")
    # correctness holds for dense and V4; the useful-speed gate cannot pass (the fixtures'
    # routes decode far below the whole model)
    assert code == 1
    assert out.startswith("DGR-054: optimize measured bottleneck at fixture class\n"), out
    assert "(fixture evidence: generated models, not real-model or real-hardware)" in out
    for family in ("dense", "v4"):
        for rid in CORRECTNESS:
            assert f"+ {family} {rid}: pass" in out, out
        assert f"- {family} speed.vs_rpc: not-measured (dgr certify --rpc off" in out, out
        assert f"- bottleneck ({family}): " in out, out
    assert "2 records admitted" in out and "0 refused" in out


def test_no_verdict_above_fixture_class_is_reachable_from_fixture_records(
    capsys: pytest.CaptureFixture[str], fixture_evidence: Path
) -> None:
    code, out = gate(capsys, fixture_evidence, "DGR-054")  # default: real-hardware
    assert code == 1 and out.startswith("DGR-054: stop at real-hardware class\n"), out
    assert "dense: no certification record at real-hardware class" in out
    code, out = gate(capsys, fixture_evidence, "DGR-054", "--class", "real-model")
    assert out.startswith("DGR-054: stop at real-model class\n"), out


def test_gate_070_is_not_beta_and_lists_what_is_missing(
    capsys: pytest.CaptureFixture[str], fixture_evidence: Path
) -> None:
    code, out = gate(capsys, fixture_evidence, "DGR-070", "--class", "fixture")
    assert code == 1 and out.startswith("DGR-070: stop/rollback at fixture class\n"), out
    for missing in ("mtp.contract", "mtp.implementation", "mtp.benchmark"):
        assert f"- {missing}: missing" in out, out
    assert "- certified hardware/recipe matrix: the lock declares none" in out


def test_gate_020_stops_without_baseline_records(
    capsys: pytest.CaptureFixture[str], fixture_evidence: Path
) -> None:
    code, out = gate(capsys, fixture_evidence, "DGR-020", "--class", "fixture")
    assert code == 1 and out.startswith("DGR-020: stop at fixture class\n"), out
    assert "no baseline record at fixture class or above" in out


def test_gate_reports_a_tampered_record_and_uses_the_rest(
    capsys: pytest.CaptureFixture[str], fixture_evidence: Path, tmp_path: Path
) -> None:
    evidence = tmp_path / "evidence"
    records = sorted(fixture_evidence.glob("*/*/*.json"))
    for source in records:
        target = evidence / source.relative_to(fixture_evidence)
        target.parent.mkdir(parents=True)
        target.write_text(source.read_text())
    victim = sorted(evidence.glob("*/*/*.json"))[0]
    data = json.loads(victim.read_text())
    data["requirements"][0]["verdict"] = "fail"
    victim.write_text(json.dumps(data))
    code, out = gate(capsys, evidence, "DGR-054", "--class", "fixture")
    assert out.startswith("DGR-054: stop at fixture class\n"), out  # one family lost its record
    assert f"refused: {victim}: record_id: is not the hash of the record's content" in out, out
    assert "1 records admitted" in out and "1 refused" in out


def _unmarked_gguf(path: Path) -> Path:
    """tiny-llama's tensors and metadata without the fixture writers' mark."""
    spec = lookup("tiny-llama")
    assert isinstance(spec, FixtureSpec)
    writer = GGUFWriter(path, spec.arch)
    plans = llama.tensor_plan(spec)
    llama.write_metadata(writer, spec)
    for plan in plans:
        writer.add_tensor_info(plan.name, plan.shape, plan.dtype, plan.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _plan, values in llama.iter_tensors(spec, plans):
        writer.write_tensor_data(values)
    writer.close()
    return path


def test_certify_refuses_a_model_whose_class_cannot_be_derived(tmp_path: Path) -> None:
    model = _unmarked_gguf(tmp_path / "unmarked.gguf")
    done = subprocess.run(
        [dgr_command(), "certify", "--model", str(model), "--evidence", str(tmp_path / "ev")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no evidence class can be derived" in done.stderr
    assert not (tmp_path / "ev").exists()  # nothing written


def test_certify_refuses_too_few_sessions_for_the_isolation_scenario(tmp_path: Path) -> None:
    done = subprocess.run(
        [dgr_command(), "certify", "--fixture", "tiny-llama", "--max-sessions", "2"]
        + ["--evidence", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "concurrent sessions" in done.stderr, done.stderr
    assert not any(tmp_path.iterdir())


def test_certify_refuses_a_lock_it_cannot_read(tmp_path: Path) -> None:
    lock = tmp_path / "lock.json"
    lock.write_text('{"schema": "dgr.lock/1", "locked_at": ')  # truncated
    done = subprocess.run(
        [dgr_command(), "certify", "--fixture", "tiny-llama", "--lock", str(lock)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and f"{lock}: not JSON" in done.stderr, done.stderr


def test_layouts_come_from_the_layer_count_and_the_lock() -> None:
    counts = load_lock().thresholds.layout_stage_counts
    assert [len(lay) for lay in layouts_for(4, counts)] == [2, 3, 4]  # no 10 without 10 layers
    assert [len(lay) for lay in layouts_for(12, counts)] == [2, 3, 4, 10]
    for layout in layouts_for(43, counts):  # DeepSeek V4's 43 main layers: an exact cover
        assert layout[0][0] == 0 and layout[-1][1] == 43
        assert all(a[1] == b[0] for a, b in zip(layout, layout[1:], strict=False))


def test_certify_runs_ten_stages_where_the_model_has_the_layers(tmp_path: Path) -> None:
    done = subprocess.run(
        [dgr_command(), "certify", "--fixture", "v4-12", "--evidence", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[4/4] 10 stages [0,1) [1,2)" in done.stdout
    (record,) = load_evidence(tmp_path, load_lock()).records
    parity = record.requirement("parity.layouts")
    assert parity is not None and parity.verdict is Verdict.PASS
    assert parity.detail.startswith("2, 3, 4, 10 stages: tokens and logits bit-exact")
