"""The committed state diagram is generated from the table and cannot drift."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from dgr_session.machine import TRANSITIONS, mermaid, state_diagram_markdown

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "state-diagram.md"
SCRIPT = ROOT / "scripts" / "gen_state_diagram.py"


def test_committed_diagram_equals_generated_output() -> None:
    assert DOC.read_text(encoding="utf-8") == state_diagram_markdown(), (
        "docs/state-diagram.md is stale: run python scripts/gen_state_diagram.py"
    )


def test_every_table_entry_is_an_edge() -> None:
    text = mermaid()
    for trigger, sources, dest in TRANSITIONS:
        for source in sources:
            assert f"    {source.value} --> {dest.value}: {trigger}\n" in text
    assert text.startswith("stateDiagram-v2\n    [*] --> new\n")


def test_script_prints_and_checks() -> None:
    printed = subprocess.run(
        [sys.executable, str(SCRIPT), "--print"], capture_output=True, text=True, check=True
    )
    assert printed.stdout == state_diagram_markdown()
    checked = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True)
    assert checked.returncode == 0


def test_script_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_state_diagram", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = tmp_path / "state-diagram.md"
    setattr(module, "TARGET", target)  # noqa: B010 - patching a module loaded from a path
    setattr(module, "ROOT", tmp_path)  # noqa: B010
    setattr(module, "README", tmp_path / "README.md")  # noqa: B010
    target.write_text("stale\n", encoding="utf-8")
    assert module.main(["--check"]) == 1
    assert module.main([]) == 0
    assert target.read_text(encoding="utf-8") == state_diagram_markdown()
    assert module.main(["--check"]) == 0


def test_readme_diagram_equals_generated_output() -> None:
    spec = importlib.util.spec_from_file_location("gen_state_diagram", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert module.BEGIN in readme
    assert module.readme_with_diagram(readme) == readme, (
        "README.md's state diagram is stale: run python scripts/gen_state_diagram.py"
    )
