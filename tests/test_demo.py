"""README command 1: the demo loses a stage and recovers with whole-model parity."""

from __future__ import annotations

import pytest

from dgr_engine.demo import main as demo_main


def test_demo_loses_a_stage_and_recovers_with_parity(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo_main(["--stages", "4", "--sessions", "2", "--steps", "10", "--lose-at", "3"]) == 0
    out = capsys.readouterr().out
    assert "lost" in out and "epoch 1" in out
    assert out.count("whole-model equal: True") == 2
    assert out.rstrip().endswith("PARITY OK")
