"""The package layout's two rules: production code never imports a testing module, and the
control plane (``dgr_session``) never imports the data plane, cffi or grpc."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTING = ("dgr_session.testing", "dgr_engine.testing")
DATA_PLANE = ("dgr_engine", "cffi", "_cffi_backend", "grpc", "grpc_health", "google.protobuf")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path, name: str | None = None) -> Iterator[tuple[int, str]]:
    """Every module ``path`` (module ``name``) imports, with its line: absolute names,
    relative imports resolved."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:  # `from pkg import testing` imports pkg.testing
                yield node.lineno, f"{base}.{alias.name}"


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def is_testing(path: Path) -> bool:
    return within(module_name(path), TESTING)


PRODUCTION = [p for pkg in ("dgr_session", "dgr_engine") for p in sources(pkg) if not is_testing(p)]


def test_the_rules_see_the_whole_tree() -> None:
    names = {module_name(p) for p in PRODUCTION}
    assert {"dgr_session.manager", "dgr_engine.worker.server", "dgr_engine.cli.demo"} <= names
    assert not names & {"dgr_session.testing", "dgr_engine.testing"}


@pytest.mark.parametrize("path", PRODUCTION, ids=lambda p: str(p.relative_to(ROOT)))
def test_production_code_never_imports_a_testing_module(path: Path) -> None:
    bad = [f"line {n}: {name}" for n, name in imported(path) if within(name, TESTING)]
    assert not bad, f"{path.relative_to(ROOT)} imports test doubles: {bad}"


@pytest.mark.parametrize("path", sources("dgr_session"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_control_plane_never_imports_the_data_plane(path: Path) -> None:
    bad = [f"line {n}: {name}" for n, name in imported(path) if within(name, DATA_PLANE)]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_importing_the_control_plane_loads_no_data_plane_module() -> None:
    code = (
        "import sys, dgr_session, dgr_session.testing\n"
        f"prefixes = {DATA_PLANE!r}\n"
        "print(sorted(m for m in sys.modules for p in prefixes\n"
        "             if m == p or m.startswith(p + '.')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_the_checker_catches_what_it_forbids(tmp_path: Path) -> None:
    """The AST reading itself: each import form that would break a rule is seen."""
    module = tmp_path / "probe.py"
    module.write_text(
        "import dgr_session.testing\n"
        "from dgr_engine import testing\n"
        "from .testing import EngineTransport\n"
        "from dgr_session.testing.fake_model import FakeModel\n"
        "from dgr_engine import engine\n"
    )
    lines = {n for n, name in imported(module, "dgr_engine.probe") if within(name, TESTING)}
    assert lines == {1, 2, 3, 4}
