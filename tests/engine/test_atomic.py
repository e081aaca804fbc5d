"""A file written through ``replacing`` appears whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgr_engine.atomic import replacing


def test_a_finished_write_replaces_the_file(tmp_path: Path) -> None:
    dst = tmp_path / "new" / "out.txt"
    with replacing(dst) as tmp:
        assert tmp.parent == dst.parent and not dst.exists()
        tmp.write_text("whole")
    assert dst.read_text() == "whole" and dst.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in dst.parent.iterdir()) == ["out.txt"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    dst = tmp_path / "out.txt"
    dst.write_text("old")
    with pytest.raises(RuntimeError), replacing(dst) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert dst.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]
