"""The glossary (``docs/glossary.md``) holds the code to one meaning per word (issue 47): its
route modes and data paths are the enums' and the command line's, and every name made with
*chain* or *link* is listed under one sense, so none takes a new meaning unseen."""

from __future__ import annotations

import re
from pathlib import Path

from dgr_engine.cli._route import add_route_arguments
from dgr_engine.client.route_modes import DataPath, RouteMode

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "docs/glossary.md"

SCANNED = ("dgr_engine", "dgr_session", "native", "proto", "benchmarks", "examples", "scripts")
"""The rooms whose names the glossary lists, with the build scripts at the top."""
SUFFIXES = {".py", ".pyi", ".cpp", ".h", ".proto", ".sh"}
NAME = re.compile(r"[A-Za-z0-9_]*(?:link|chain)[A-Za-z0-9_]*", re.IGNORECASE)


def _sources() -> list[Path]:
    found = [ROOT / name for name in ("cffi_build.py", "setup.py", "dgr.sh")]
    for room in SCANNED:
        found += [
            p
            for p in sorted((ROOT / room).rglob("*"))
            if p.suffix in SUFFIXES and "_pb2" not in p.name and "__pycache__" not in p.parts
        ]
    return found


def _names_in_code() -> set[str]:
    return {m for path in _sources() for m in NAME.findall(path.read_text(encoding="utf-8"))}


def _index() -> dict[str, list[str]]:
    """The glossary's last section: each sense's heading and the names listed under it."""
    text = GLOSSARY.read_text(encoding="utf-8").split("## Every name made with chain or link")[1]
    senses: dict[str, list[str]] = {}
    for block in text.split("\n\n")[1:]:
        heading = re.match(r"\*\*(.+?)\*\*", block.strip())
        if heading:
            senses[heading.group(1)] = re.findall(r"`([A-Za-z0-9_]+)`", block)
    return senses


def _table(heading: str) -> list[str]:
    section = GLOSSARY.read_text(encoding="utf-8").split(f"## {heading}")[1].split("\n## ")[0]
    return re.findall(r"^\| `([a-z]+)` \|", section, re.MULTILINE)


def _choices(option: str) -> list[str]:
    import argparse

    parser = argparse.ArgumentParser()
    add_route_arguments(parser)
    action = next(a for a in parser._actions if option in a.option_strings)
    return [str(c) for c in action.choices or ()]


def test_every_chain_and_link_name_in_the_code_is_listed_under_one_sense() -> None:
    senses = _index()
    assert set(senses) >= {"Chain", "Link", "Other projects' meanings"}
    listed = [name for names in senses.values() for name in names]
    twice = {name for name in listed if listed.count(name) > 1}
    assert not twice, f"listed under two senses: {sorted(twice)}"
    in_code = _names_in_code()
    assert in_code - set(listed) == set(), "names with no sense in docs/glossary.md"
    assert set(listed) - in_code == set(), "names docs/glossary.md lists that the code lacks"


def test_the_route_modes_and_data_paths_are_the_enums_and_the_command_lines() -> None:
    assert _table("Route modes") == [str(m) for m in RouteMode] == _choices("--transport")
    assert _table("Data paths") == [str(p) for p in DataPath] == _choices("--data-path")
    for path in DataPath:
        assert "link" not in str(path), f"a data path is not a link: {path}"


def test_the_scan_reads_every_kind_of_source_it_names() -> None:
    """The scan itself could pass by reading nothing: it reads Python, C++ and the proto."""
    sources = {p.suffix for p in _sources()}
    assert {".py", ".cpp", ".h", ".proto", ".sh"} <= sources
    assert {"ChainStageTransport", "dgr_link_start", "native_link_port"} <= _names_in_code()
