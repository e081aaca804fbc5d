"""The package layout's two rules: production code never imports a testing module, and the
control plane (``dgr_session``) never imports the data plane, cffi or grpc."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


# -- the rooms of dgr_engine -------------------------------------------------------------------

ENGINE_MODULES = {module_name(p): p for p in sources("dgr_engine")}
ROOM_RULES = {
    # room: the rooms it never imports (directly or through another module)
    "dgr_engine.worker": ("dgr_engine.tooling", "dgr_engine.client", "dgr_engine.certify"),
    "dgr_engine.client": ("dgr_engine.tooling", "dgr_engine.worker", "dgr_engine.certify"),
    "dgr_engine.security": ("dgr_engine.tooling", "dgr_engine.worker", "dgr_engine.client"),
    "dgr_engine.wire": ("dgr_engine.tooling", "dgr_engine.worker", "dgr_engine.client"),
    # the server answers over a route the client side opened: never the worker's inside
    "dgr_engine.serve": ("dgr_engine.tooling", "dgr_engine.worker", "dgr_engine.certify"),
    "dgr_engine.certification": (
        "dgr_engine.certify",
        "dgr_engine.tooling",
        "dgr_engine.worker",
        "dgr_engine.client",
    ),
}
"""Who may not import whom: the worker and the client never reach the single-machine tooling,
the pure decision framework never reaches the runners that drive routes."""
TOP_LEVEL_LIMIT = 12


def engine_edges(name: str) -> set[str]:
    """The ``dgr_engine`` modules that module ``name`` imports (any import statement, at module
    level, in a function or under ``TYPE_CHECKING``): ``from pkg import mod`` is an edge to
    ``pkg.mod``, ``from pkg import name`` one to ``pkg``."""
    edges = set()
    seen_from: dict[int, list[str]] = {}
    for line, target in imported(ENGINE_MODULES[name], name):
        seen_from.setdefault(line, []).append(target)
    for targets in seen_from.values():
        base, *names = targets
        modules = [t for t in names if t in ENGINE_MODULES]
        if modules:
            edges.update(modules)
        elif base in ENGINE_MODULES:
            edges.add(base)
        else:  # plain `import a.b, c`
            edges.update(t for t in targets if t in ENGINE_MODULES)
    edges.discard(name)
    return edges


GRAPH = {name: engine_edges(name) for name in ENGINE_MODULES}


def reachable(start: str) -> dict[str, list[str]]:
    """Every module ``start`` reaches, each with one import path to it."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        here = todo.pop()
        for there in sorted(GRAPH[here]):
            if there not in paths:
                paths[there] = [*paths[here], there]
                todo.append(there)
    return paths


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_top_level_holds_at_most_twelve_modules() -> None:
    top = sorted(p.name for p in (ROOT / "dgr_engine").glob("*.py"))
    assert "errors.py" in top and "reference.py" in top  # the glob sees the package
    assert len(top) <= TOP_LEVEL_LIMIT, top


@pytest.mark.parametrize("room", sorted(ROOM_RULES))
def test_a_room_never_reaches_the_rooms_it_must_not_import(room: str) -> None:
    assert any(within(name, (room,)) for name in ENGINE_MODULES), f"no room {room}"
    bad = []
    for name in sorted(ENGINE_MODULES):
        if not within(name, (room,)):
            continue
        for there, path in reachable(name).items():
            if within(there, ROOM_RULES[room]):
                bad.append(" -> ".join(path))
    assert not bad, "\n".join(bad)


def modules_loaded_by(code: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules whose names start with one of ``prefixes`` that a new interpreter has loaded
    after running ``code``."""
    probe = (
        f"{code}\nimport sys\nprint(sorted(m for m in sys.modules if m.startswith({prefixes!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    loaded: list[str] = ast.literal_eval(done.stdout)  # a printed list of names
    return loaded


def test_importing_the_worker_and_the_client_loads_no_tooling() -> None:
    code = (
        "import dgr_engine.worker.server, dgr_engine.client.chained, dgr_engine.client.text\n"
        "import dgr_engine.client.routes"
    )
    assert modules_loaded_by(code, ("dgr_engine.tooling", "dgr_engine.certify")) == []


def test_a_worker_imports_no_other_subcommand() -> None:
    """``dgr worker`` starts without ``dgr serve``'s web framework or the other commands."""
    from dgr_engine import cli

    code = (
        "from dgr_engine import cli\n"
        "cli.parser('worker').parse_args(['worker', '--model', 'm.gguf', '--layers', '0:1'])\n"
        "cli.subcommand('worker')"
    )
    loaded = modules_loaded_by(code, ("dgr_engine.cli.", "fastapi", "uvicorn"))
    assert "dgr_engine.cli.worker" in loaded
    others = {f"dgr_engine.cli.{name}" for name in cli._SUBCOMMANDS} - {"dgr_engine.cli.worker"}
    assert not others & set(loaded) and "fastapi" not in loaded, loaded


def test_dgr_engine_has_no_import_cycle() -> None:
    assert "dgr_engine.worker.server" in GRAPH
    found = cycles(GRAPH)
    assert not found, f"import cycles: {found}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
