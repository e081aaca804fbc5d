"""The three gates on records the tests write: each verdict, each reason, and the class rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dgr_engine.certification.gates import evaluate
from dgr_engine.cli import main
from dgr_session.identity import EvidenceClass
from tests.harness import EvidenceKit

F = EvidenceClass.FIXTURE


def both(kit: EvidenceKit, **kw: Any) -> list[Any]:
    return [kit.record(family="dense", **kw), kit.record(family="v4", **kw)]


@pytest.mark.parametrize(
    ("failing", "verdict"),
    [((), "go"), (("baseline.speed",), "optimize baseline"), (("baseline.parity",), "stop")],
)
def test_dgr_020(kit: EvidenceKit, failing: tuple[str, ...], verdict: str) -> None:
    record = kit.record(kind="baseline", failing=failing)
    result = evaluate("DGR-020", [record], kit.lock, F)
    assert result.verdict == verdict and result.line == f"DGR-020: {verdict} at fixture class"
    assert result.records == (record.record_id,)


def test_dgr_020_without_a_baseline_stops(kit: EvidenceKit) -> None:
    result = evaluate("DGR-020", both(kit), kit.lock, F)  # certification records are not baselines
    assert result.verdict == "stop"
    assert [r.text for r in result.reasons] == ["no baseline record at fixture class or above"]


def test_dgr_054_alpha_when_everything_passes(kit: EvidenceKit) -> None:
    result = evaluate("DGR-054", both(kit), kit.lock, F)
    assert result.line == "DGR-054: alpha at fixture class"
    assert all(r.ok for r in result.reasons)
    assert "fixture evidence: generated models, not real-model or real-hardware" in result.text()


@pytest.mark.parametrize("worst", ["transit", "engine"])
def test_dgr_054_names_the_measured_bottleneck(kit: EvidenceKit, worst: str) -> None:
    shares = {"engine": 0.2, "worker": 0.1, "transit": 0.2, "client": 0.1}
    shares[worst] = 0.6
    records = both(kit, failing=("speed.decode",), shares=shares)
    result = evaluate("DGR-054", records, kit.lock, F)
    assert result.verdict == "optimize measured bottleneck"
    lines = [r.text for r in result.reasons if r.text.startswith("bottleneck")]
    assert len(lines) == 2 and all(f": {worst} (" in line for line in lines), lines
    assert f"{worst} 60%" in lines[0]


def test_dgr_054_stops_on_a_failed_or_missing_requirement(kit: EvidenceKit) -> None:
    failed = evaluate("DGR-054", both(kit, failing=("failure.bounded",)), kit.lock, F)
    assert failed.verdict == "stop"
    assert any(not r.ok and "failure.bounded: fail" in r.text for r in failed.reasons)
    no_v4 = evaluate("DGR-054", [kit.record(family="dense")], kit.lock, F)
    assert no_v4.verdict == "stop"
    assert any(r.text == "v4: no certification record at fixture class" for r in no_v4.reasons)
    without_mtp_off = both(kit, requirement_ids=("parity.layouts",))
    missing = evaluate("DGR-054", without_mtp_off, kit.lock, F)
    assert missing.verdict == "stop"
    assert any("mtp.off: not-measured (missing from the record" in r.text for r in missing.reasons)


@pytest.mark.parametrize("at", [None, EvidenceClass.REAL_MODEL, EvidenceClass.REAL_HARDWARE])
def test_fixture_records_reach_no_verdict_above_their_class(
    kit: EvidenceKit, at: EvidenceClass | None
) -> None:
    result = evaluate("DGR-054", both(kit), kit.lock, at)  # alpha at fixture class
    cls = at or EvidenceClass.REAL_HARDWARE  # the story's class by default
    assert result.line == f"DGR-054: stop at {cls.value} class"
    assert result.records == ()
    assert f"dense: no certification record at {cls.value} class" in result.text()


def test_dgr_070_lists_what_beta_lacks(kit: EvidenceKit) -> None:
    alpha = evaluate("DGR-070", both(kit), kit.lock, F)
    assert alpha.verdict == "targeted optimization"
    missing = [r.text for r in alpha.reasons if not r.ok]
    assert missing == [
        "mtp.contract: missing (no passing MTP record)",
        "mtp.implementation: missing (no passing MTP record)",
        "mtp.benchmark: missing (no passing MTP record)",
        "certified hardware/recipe matrix: the lock declares none (beta_matrix)",
    ]
    with_mtp = evaluate("DGR-070", [*both(kit), kit.record(kind="mtp")], kit.lock, F)
    assert with_mtp.verdict == "targeted optimization"  # the matrix is still missing
    assert [r.ok for r in with_mtp.reasons if r.text.startswith("mtp.")] == [True] * 3
    # a fixture MTP record is named for what it is at a class above it: passing only below
    above = evaluate(
        "DGR-070", [*both(kit), kit.record(kind="mtp")], kit.lock, EvidenceClass.REAL_HARDWARE
    )
    assert any(
        r.text.startswith(
            "mtp.contract: missing at real-hardware class; passes at fixture class only (record "
        )
        for r in above.reasons
    ), above.text()
    not_alpha = evaluate("DGR-070", both(kit, failing=("parity.layouts",)), kit.lock, F)
    assert not_alpha.verdict == "stop/rollback"


def test_unknown_gate() -> None:
    with pytest.raises(ValueError, match="unknown gate"):
        evaluate("DGR-099", [], None, F)  # type: ignore[arg-type]


def test_the_gate_command(kit: EvidenceKit, capsys: pytest.CaptureFixture[str]) -> None:
    evidence = kit.root / "evidence"
    for record in both(kit):
        kit.write(record)
    bad = evidence / "fixture" / "x" / "junk.json"
    bad.parent.mkdir()
    bad.write_text("{}")
    args = ["gate", "DGR-054", "--class", "fixture", "--evidence", str(evidence)]
    assert main([*args, "--lock", str(kit.lock_path)]) == 0  # the first verdict: alpha
    out = capsys.readouterr().out
    assert out.startswith("DGR-054: alpha at fixture class\n"), out
    assert "2 records admitted" in out and "1 refused" in out
    assert f"refused: {bad}: schema: missing" in out
    assert main(["gate", "DGR-054", "--evidence", str(evidence), "--lock", str(kit.lock_path)]) == 1
    assert capsys.readouterr().out.startswith("DGR-054: stop at real-hardware class\n")
    broken = Path(kit.root / "broken.json")
    broken.write_text("{")
    assert main(["gate", "DGR-020", "--lock", str(broken)]) == 2
    assert "not JSON" in capsys.readouterr().err
