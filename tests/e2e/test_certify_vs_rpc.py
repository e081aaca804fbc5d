"""``dgr certify`` measures ``speed.vs_rpc``: llama.cpp RPC with the route's split beside each
speed layout (``--rpc build`` builds the peers if this machine has not yet: about 12 minutes on
2 cores, cached after), and ``--rpc off`` leaves it not measured, saying so."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.record import EvidenceRecord, Figure, Verdict, load_evidence
from dgr_engine.certify.runner import layouts_for
from dgr_engine.fixtures import lookup
from tests.harness import certify


def only_record(root: Path) -> EvidenceRecord:
    loaded = load_evidence(root, load_lock())
    assert not loaded.refused and len(loaded.records) == 1
    return loaded.records[0]


def figure(record: EvidenceRecord, name: str, scenario: str) -> Figure:
    found = [f for f in record.figures if (f.name, f.scenario) == (name, scenario)]
    assert len(found) == 1, (name, scenario, record.figures)
    return found[0]


def test_certify_judges_the_route_against_rpc_on_every_speed_layout(tmp_path: Path) -> None:
    root = tmp_path / "evidence"
    certify(root, "tiny-llama", "--rpc", "build")
    record = only_record(root)
    assert ("--rpc", "build") == record.command[4:6]
    req = record.requirement("speed.vs_rpc")
    assert req is not None and req.verdict in (Verdict.PASS, Verdict.FAIL), req
    limits = load_lock().thresholds.speed
    counts = [len(lay) for lay in layouts_for(lookup("tiny-llama").n_layer, limits.stage_counts)]
    ratios = {f.scenario: f for f in record.figures if f.name == "speed.vs_rpc_decode"}
    assert sorted(ratios) == [f"{n} stages" for n in counts]
    for n in counts:
        rpc = figure(record, "speed.decode_tps.rpc", f"{n} stages")
        route = figure(record, "speed.decode_tps.route", f"{n} stages")
        assert math.isfinite(rpc.value) and rpc.value > 0 and rpc.unit == "tok/s"
        assert ratios[f"{n} stages"].value == pytest.approx(route.value / rpc.value)
        assert f"{n} stages {route.value / rpc.value:.2f}" in req.detail
    passed = all(f.value >= limits.vs_rpc_decode_ratio_min for f in ratios.values())
    assert (req.verdict is Verdict.PASS) == passed
    log = (tmp_path / "certify-tiny-llama-build.log").read_text()
    assert "llama.cpp RPC beside each speed layout" in log
    assert log.count("vs llama.cpp RPC (same split): route ") == len(counts)


def test_rpc_off_leaves_vs_rpc_not_measured_and_says_why(tmp_path: Path) -> None:
    root = tmp_path / "evidence"
    certify(root, "tiny-llama", "--rpc", "off")
    req = only_record(root).requirement("speed.vs_rpc")
    assert req is not None and req.verdict is Verdict.NOT_MEASURED
    assert "--rpc off" in req.detail
