"""The docs' module tables cannot drift from the code: each table that lists the modules of a
room is read here and compared with the files of that room, both ways (a module the table names
exists; a module of the room is in the table). The lists come from the file system, so a module
moved into a sub-package is found under its new path."""

from __future__ import annotations

import re
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@attrs.frozen
class Table:
    """A markdown table: the heading it sits under, its header cells, its rows' cells."""

    heading: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def column(self, index: int = 0) -> list[str]:
        """Every backticked name in one column, in order (a cell may hold several)."""
        return [name for row in self.rows for name in re.findall(r"`([^`]+)`", row[index])]


def _cells(line: str) -> tuple[str, ...]:
    line = line.strip().replace(r"\|", "\0")
    return tuple(c.strip().replace("\0", "|") for c in line.strip("|").split("|"))


def tables(text: str) -> list[Table]:
    """Every table of a markdown text, outside code blocks, with the heading above it."""
    found: list[Table] = []
    heading = ""
    block: list[str] = []
    fenced = False
    for line in [*text.splitlines(), ""]:
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("|"):
            block.append(line)
            continue
        if len(block) >= 2 and set(block[1].replace("|", "").strip()) <= {"-", ":", " "}:
            rows = tuple(_cells(row) for row in block[2:])
            found.append(Table(heading, _cells(block[0]), rows))
        block = []
        if not fenced and line.startswith("#"):
            heading = line.lstrip("#").strip()
    return found


def the_table(path: Path, heading: str, first_header: str) -> Table:
    """The one table of ``path`` under ``heading`` whose first header cell is
    ``first_header``."""
    matches = [
        t
        for t in tables(path.read_text(encoding="utf-8"))
        if t.heading == heading and t.header[0] == first_header
    ]
    assert len(matches) == 1, f"{path.name}: {len(matches)} tables '{first_header}' in {heading!r}"
    return matches[0]


def same_names(listed: list[str], actual: set[str], where: str) -> None:
    """``listed`` names each of ``actual`` once and nothing else."""
    twice = sorted({n for n in listed if listed.count(n) > 1})
    missing = sorted(actual - set(listed))
    stale = sorted(set(listed) - actual)
    assert not (twice or missing or stale), (
        f"{where}: not listed {missing}, no such module {stale}, listed twice {twice}"
    )


def packages(root: Path) -> set[str]:
    """The packages one level below ``root`` (a folder with an ``__init__.py``)."""
    return {p.parent.name for p in root.glob("*/__init__.py")}


# -- docs/worker.md -----------------------------------------------------------------------------


def test_the_worker_table_lists_every_module_of_the_worker() -> None:
    worker = ROOT / "dgr_engine" / "worker"
    actual = {p.relative_to(worker).as_posix() for p in worker.rglob("*.py")}
    actual = {name for name in actual if not name.endswith("__init__.py")}
    table = the_table(DOCS / "worker.md", "Modules, and how they meet", "module")
    same_names(table.column(), actual, "docs/worker.md's module table")


# -- docs/rooms.md ------------------------------------------------------------------------------


def room_tree(text: str) -> set[str]:
    """The rooms the tree of ``docs/rooms.md`` (its first code block) names: ``dgr_engine/``
    at the margin, ``client/`` indented below it, read as ``dgr_engine/client``."""
    block = text.split("```", 2)[1]
    rooms: set[str] = set()
    parent = ""
    for line in block.splitlines():
        entry = re.match(r"^( *)([\w.]+)/(\s|$)", line)
        if entry is None:
            continue
        indent, name = len(entry.group(1)), entry.group(2)
        if indent == 0:
            parent = name
            rooms.add(name)
        else:
            rooms.add(f"{parent}/{name}")
    return rooms


def test_the_room_tree_names_every_room() -> None:
    tree = room_tree((DOCS / "rooms.md").read_text(encoding="utf-8"))
    for package in ("dgr_session", "dgr_engine"):
        actual = {f"{package}/{room}" for room in packages(ROOT / package)}
        listed = sorted(r for r in tree if r.startswith(f"{package}/"))
        same_names(listed, actual, f"docs/rooms.md's tree of {package}")
    assert {"dgr_session", "dgr_engine", "tests"} <= tree


def test_the_top_level_table_lists_every_module_of_dgr_engine() -> None:
    actual = {p.name for p in (ROOT / "dgr_engine").glob("*.py")}
    table = the_table(DOCS / "rooms.md", "The top level of `dgr_engine`", "module")
    same_names(table.column(), actual, "docs/rooms.md's top-level table")


# -- the reader itself --------------------------------------------------------------------------


def test_the_reader_finds_tables_under_their_headings_and_skips_code() -> None:
    text = (
        "# Page\n## Rooms\n\n| module | job |\n|---|---|\n| `a.py`, `b.py` | x \\| y |\n"
        "| `c/d.py` | z |\n\n```\n| `not.py` | a table in code |\n|---|---|\n```\n"
        "## Other\n| name | what |\n|---|---|\n| `e` | f |\n"
    )
    found = tables(text)
    assert [(t.heading, t.header[0]) for t in found] == [("Rooms", "module"), ("Other", "name")]
    assert found[0].column() == ["a.py", "b.py", "c/d.py"]
    assert found[0].rows[0][1] == "x | y"


def test_the_tree_reader_nests_rooms_under_their_package() -> None:
    text = "intro\n```\npkg/     the package\n  room/  a room\n           more text\nother/\n```\n"
    assert room_tree(text) == {"pkg", "pkg/room", "other"}


def test_a_missing_or_stale_name_is_reported() -> None:
    try:
        same_names(["a", "b", "b"], {"a", "c"}, "probe")
    except AssertionError as error:
        assert "not listed ['c']" in str(error) and "no such module ['b']" in str(error)
        assert "listed twice ['b']" in str(error)
    else:
        raise AssertionError("same_names accepted a drifted list")
