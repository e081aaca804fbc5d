"""dgr_engine's public surface: every public name resolves to the object its module defines,
``__all__`` is sorted and complete, importing the package stays cheap, ``docs/api.md`` names
exactly the public names under the role the package files each under, and the tracker example
imports nothing else."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import dgr_engine
import dgr_session
from tests.project.test_docs_tables import Table, same_names, tables

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
ROLES = {"Tracker author": dgr_engine._FOR_TRACKERS, "Test author": dgr_engine._FOR_TESTS}
"""Each section of ``docs/api.md`` and the names the package files under that role."""
PUBLIC_MODULES = ("dgr_engine", "dgr_engine.testing", "dgr_session", "dgr_session.testing")
"""What the docs' examples and ``examples/tracker.py`` may import from dgr (besides the refusals
of ``dgr_engine.errors``, which the docs name as public too)."""


@pytest.mark.parametrize("name", dgr_engine.__all__)
def test_a_public_name_is_the_object_its_module_defines(name: str) -> None:
    module = importlib.import_module(dgr_engine._PUBLIC[name])
    assert getattr(dgr_engine, name) is getattr(module, name)
    assert name in dir(dgr_engine)


def test_all_is_sorted_and_is_every_name_of_the_roles() -> None:
    assert dgr_engine.__all__ == sorted(dgr_engine.__all__)
    assert not dgr_engine._FOR_TRACKERS.keys() & dgr_engine._FOR_TESTS.keys()
    assert set(dgr_engine.__all__) == dgr_engine._PUBLIC.keys()
    assert len(dgr_engine.__all__) == len(set(dgr_engine.__all__))


def test_the_type_checking_imports_are_the_public_table() -> None:
    """mypy reads the names from the ``TYPE_CHECKING`` block, the package resolves them from
    its tables: both say the same module for every name."""
    tree = ast.parse((ROOT / "dgr_engine" / "__init__.py").read_text(encoding="utf-8"))
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    imported = {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert imported == dgr_engine._PUBLIC


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'MOVED'"):
        _ = dgr_engine.MOVED
    with pytest.raises(AttributeError, match="no attribute 'chain_transport'"):
        _ = dgr_engine.chain_transport


def test_importing_dgr_engine_imports_nothing_else_of_dgr() -> None:
    """A worker process that imports the package pays for no client, web server, gRPC or
    binding; each public name is imported where it is used."""
    heavy = ("dgr_engine.", "dgr_session", "grpc", "fastapi", "uvicorn", "_cffi_backend", "numpy")
    code = (
        "import sys, dgr_engine\n"
        f"print(sorted(m for m in sys.modules if m.startswith({heavy!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_the_submodules_still_import_from_the_package() -> None:
    """``from dgr_engine import errors`` finds the module, not a public name."""
    from dgr_engine import errors
    from dgr_engine.client import ShardClient, session_metadata
    from dgr_engine.client.shard_client import ShardClient as Defined
    from dgr_engine.wire.metadata import session_metadata as shared

    assert errors.ShardError is dgr_engine.ShardError
    assert ShardClient is Defined and session_metadata is shared


# -- docs/api.md ------------------------------------------------------------------------------


def api_tables() -> list[Table]:
    return tables(API.read_text(encoding="utf-8"))


def names_from(module: str, role: str | None = None) -> list[str]:
    """The names ``docs/api.md`` lists in its tables headed ``from `module```."""
    return [
        name
        for table in api_tables()
        if table.header[0] == f"from `{module}`" and role in (None, table.heading)
        for name in table.column()
    ]


@pytest.mark.parametrize("role", sorted(ROLES))
def test_the_api_page_lists_each_role_s_names(role: str) -> None:
    same_names(names_from("dgr_engine", role), set(ROLES[role]), f"docs/api.md, {role}")


def test_the_api_page_names_exactly_the_public_names() -> None:
    assert sorted(names_from("dgr_engine")) == dgr_engine.__all__


def test_the_api_page_names_only_what_dgr_session_exports() -> None:
    listed = names_from("dgr_session")
    assert listed and not set(listed) - set(dgr_session.__all__), set(listed) - set(
        dgr_session.__all__
    )


@pytest.mark.parametrize("module", ["dgr_engine.testing", "dgr_session.testing"])
def test_the_api_page_s_test_doubles_resolve(module: str) -> None:
    listed = names_from(module)
    assert listed
    doubles = importlib.import_module(module)
    assert [n for n in listed if not hasattr(doubles, n)] == []


def test_the_api_page_lists_every_dgr_command() -> None:
    from dgr_engine import cli

    commands = [
        name.removeprefix("dgr ")
        for table in api_tables()
        if table.heading == "Operator" and table.header[0] == "command"
        for name in table.column()
    ]
    same_names(commands, set(cli._SUBCOMMANDS), "docs/api.md, Operator")


def dgr_imports(source: str) -> list[tuple[str, str]]:
    """Every ``(module, name)`` that ``source`` imports from dgr."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
    return [(m, n) for m, n in found if m.split(".")[0] in ("dgr_engine", "dgr_session")]


def not_public(imports: list[tuple[str, str]]) -> list[str]:
    """The imports of a name that is not public: from another module, or not exported."""
    bad = []
    for module, name in imports:
        if module in PUBLIC_MODULES:
            imported = importlib.import_module(module)
            exported = getattr(imported, "__all__", None)
            if name in exported if exported is not None else hasattr(imported, name):
                continue
        bad.append(f"from {module} import {name}")
    return bad


def test_the_api_page_s_examples_import_only_public_names() -> None:
    blocks = API.read_text(encoding="utf-8").split("```python\n")[1:]
    assert len(blocks) == 2  # one per role that imports
    for block in blocks:
        source = block.split("```", 1)[0]
        compile(source, str(API), "exec")
        assert not_public(dgr_imports(source)) == []


def test_the_tracker_example_imports_only_the_public_surface() -> None:
    source = (ROOT / "examples" / "tracker.py").read_text(encoding="utf-8")
    imports = dgr_imports(source)
    assert imports and not_public(imports) == []
