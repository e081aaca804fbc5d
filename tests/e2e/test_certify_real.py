"""dgr certify on the real model: an undeclared model is refused with how to declare it, and
every record says why it has its class."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.lock_edit import write_lock
from dgr_engine.certification.record import RecordKind, load_evidence
from dgr_engine.models import lookup, resolve_model
from dgr_engine.tooling.processes import dgr_command
from dgr_session.identity import EvidenceClass
from tests.harness import REPO

SMOLLM2 = "smollm2-135m-instruct"


def test_a_real_model_the_lock_does_not_declare_is_refused_with_how_to_declare_it(
    tmp_path: Path,
) -> None:
    resolve_model(SMOLLM2)  # fetched (cached) through dgr models, as a user would
    data = json.loads((REPO / "certification" / "lock.json").read_text())
    data["real_models"] = [m for m in data["real_models"] if m["name"] != SMOLLM2]
    data["lanes"] = [lane for lane in data["lanes"] if lane.get("real_model") != SMOLLM2]
    lock = write_lock(data, tmp_path / "lock.json")
    evidence = tmp_path / "evidence"
    done = subprocess.run(
        [dgr_command(), "certify", "--model", SMOLLM2, "--lock", str(lock)]
        + ["--evidence", str(evidence)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no evidence class can be derived" in lines[0], done.stderr
    assert f"dgr lock declare-model {SMOLLM2} --lock {lock}" in lines[0]
    assert not evidence.exists()  # nothing half-written


@pytest.mark.parametrize("name", [SMOLLM2, "gemma3-270m"])
def test_the_committed_real_records_say_why_they_are_real_hardware(name: str) -> None:
    lock = load_lock(REPO / "certification" / "lock.json")
    loaded = load_evidence(REPO / "evidence", lock)
    assert not loaded.refused, loaded.refused  # every committed record counts under this lock
    real = [r for r in loaded.records if r.facts.real_model == name]
    assert {r.kind for r in real} == {RecordKind.CERTIFICATION, RecordKind.BASELINE}
    assert all(r.evidence_class is EvidenceClass.REAL_HARDWARE for r in real)
    real = [r for r in real if r.kind is RecordKind.CERTIFICATION]
    sha = lookup(name).sha256
    for record in real:
        assert record.lane.model_sha256 == sha
        reason = record.machine.get("evidence_class", "")
        assert reason.startswith(f"{record.evidence_class.value}: the lock's real model "), reason
        if record.facts.hardware_lane is not None:
            assert f"hardware lane {record.facts.hardware_lane}" in reason
