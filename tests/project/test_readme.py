"""The README's first screen is true: its two commands exist and its example runs, and is
``examples/in_process_route.py``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_first_screen_gives_the_two_commands() -> None:
    first_screen = "\n".join(README.splitlines()[:20])
    assert "./dgr.sh demo" in first_screen and "./dgr.sh test" in first_screen
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "./dgr.sh test" in ci


def test_python_example_runs() -> None:
    (example,) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(example.splitlines()) <= 16
    namespace: dict[str, object] = {}
    exec(compile(example, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    for engine in [*namespace["stages"], *namespace["whole"].engines]:  # type: ignore[attr-defined]
        engine.close()


def test_the_example_is_examples_in_process_route() -> None:
    """The README shows ``examples/in_process_route.py``'s marked block, word for word."""
    (example,) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    source = (ROOT / "examples" / "in_process_route.py").read_text(encoding="utf-8")
    (block,) = re.findall(r"# --- readme:begin ---\n(.*?)# --- readme:end ---", source, flags=re.S)
    assert example == block
