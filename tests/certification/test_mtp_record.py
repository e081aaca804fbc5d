"""DGR-070's MTP record (``dgr mtp``, ``dgr_engine/speculative/mtp_record.py``): the three MTP
requirements judged from a measured run, the record the repository carries for the MTP fixture,
read by ``dgr gate DGR-070``, and one made end to end."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from dgr_engine.certification.record import Verdict
from dgr_engine.cli import main
from dgr_engine.speculative.mtp_record import RANDOM_WEIGHTS, mtp_figures, mtp_requirements

REPO = Path(__file__).resolve().parents[2]
WAYS = ("relay", "chain", "ring")


def run_of(**change: Any) -> dict[int, dict[str, Any]]:
    good = {
        "tokens_equal": True,
        "passes": 40,
        "drafted": 120,
        "accepted": 30,
        "draft_ms_per_token": 0.1,
        "contract_ok": True,
    }
    return {n: {**good, **change} for n in (2, 3, 6)}


def verdicts(run: dict[int, dict[str, Any]], fixture: bool = True) -> dict[str, Verdict]:
    return {r.id: r.verdict for r in mtp_requirements(run, fixture=fixture, transports=WAYS)}


def test_the_requirements_follow_the_run() -> None:
    assert set(verdicts(run_of()).values()) == {Verdict.PASS}
    assert verdicts(run_of(contract_ok=False))["mtp.contract"] is Verdict.FAIL
    assert verdicts(run_of(tokens_equal=False))["mtp.implementation"] is Verdict.FAIL
    assert verdicts(run_of(drafted=0))["mtp.benchmark"] is Verdict.FAIL
    assert verdicts({})["mtp.implementation"] is Verdict.FAIL  # nothing measured: nothing met
    fixture = mtp_requirements(run_of(), fixture=True, transports=WAYS)[2].detail
    assert RANDOM_WEIGHTS in fixture  # acceptance on random weights is named for what it is
    assert (
        RANDOM_WEIGHTS not in mtp_requirements(run_of(), fixture=False, transports=WAYS)[2].detail
    )
    names = {(f.name, f.scenario) for f in mtp_figures(run_of())}
    assert ("mtp.acceptance", "6 stages") in names and ("mtp.draft_ms", "2 stages") in names
    assert all(isinstance(f.value, float) for f in mtp_figures(run_of()))  # as the file keeps


def test_the_gate_reads_the_committed_mtp_record(capsys: pytest.CaptureFixture[str]) -> None:
    main(["gate", "DGR-070", "--class", "fixture", "--evidence", str(REPO / "evidence")])
    out = capsys.readouterr().out
    for rid in ("mtp.contract", "mtp.implementation", "mtp.benchmark"):
        assert f"+ {rid}: pass (record " in out, out
    assert ", 0 refused" in out
    main(["gate", "DGR-070", "--evidence", str(REPO / "evidence")])  # the story's class: release
    out = capsys.readouterr().out
    assert "mtp.contract: missing at release class; passes at fixture class only" in out, out


@pytest.mark.slow  # serves the MTP fixture over routes of 2 and 12 stages, three transports
def test_dgr_mtp_writes_a_record_the_gate_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evidence = tmp_path / "evidence"
    shutil.copytree(REPO / "evidence", evidence)
    before = set(evidence.rglob("*.json"))
    argv = ["mtp", "--stages", "2", "12", "--tokens", "12", "--evidence", str(evidence)]
    assert main(argv) == 0  # v4-12-mtp over 2 and 12 stages
    (made,) = set(evidence.rglob("*.json")) - before
    assert made.parent.parent.name == "fixture"
    out = capsys.readouterr().out
    assert "+ mtp.implementation: pass (record " in out, out
