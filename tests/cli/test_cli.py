"""The ``dgr`` command line: every subcommand and option explains itself in plain text."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from dgr_engine import cli

MARKUP = re.compile(r"``|:(class|func|meth|mod|attr|data):`")


def parsers(
    parser: argparse.ArgumentParser, name: str = "dgr"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every subcommand's parser below it, by command line."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from parsers(child, f"{name} {sub}")


ALL = dict(parsers(cli.parser()))


def test_every_subcommand_is_reachable() -> None:
    assert set(ALL) == {
        "dgr",
        "dgr worker",
        "dgr generate",
        "dgr chat",
        "dgr serve",
        "dgr demo",
        "dgr fixtures",
        "dgr fixtures list",
        "dgr fixtures build",
        "dgr models",
        "dgr models list",
        "dgr models fetch",
        "dgr models path",
        "dgr certify",
        "dgr baseline",
        "dgr mtp",
        "dgr artifacts",
        "dgr artifacts manifest",
        "dgr artifacts fetch",
        "dgr artifacts verify",
        "dgr lock",
        "dgr lock new",
        "dgr lock declare-model",
        "dgr lock declare-hardware",
        "dgr lock keygen",
        "dgr lock declare-certifier",
        "dgr lock show",
        "dgr gate",
    }


@pytest.mark.parametrize("command", sorted(ALL))
def test_every_option_has_help_text(command: str) -> None:
    missing = [
        "/".join(action.option_strings) or action.dest
        for action in ALL[command]._actions
        if not action.help and not isinstance(action, argparse._SubParsersAction)
    ]
    assert not missing, f"{command}: options without help: {missing}"


@pytest.mark.parametrize("command", sorted(ALL))
def test_help_has_no_restructuredtext_markup(command: str) -> None:
    text = ALL[command].format_help()
    assert not MARKUP.search(text), text


def test_fixtures_help_shows_its_subcommands() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dgr_engine.cli", "fixtures", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert re.search(r"^\s+list\s+list the fixtures", done.stdout, re.M), done.stdout
    assert re.search(r"^\s+build\s+build", done.stdout, re.M), done.stdout


def test_worker_options_come_from_engine_options() -> None:
    from dgr_engine.options import EngineOptions

    args = cli.parser().parse_args(
        ["worker", "--fixture", "tiny-llama", "--layers", "0:2", "--threads", "3", "--ctx", "128"]
    )
    options = EngineOptions.from_args(args)
    assert options == EngineOptions(n_threads=3, n_ctx_per_session=128)
    again = cli.parser().parse_args(
        ["worker", "--model", "m.gguf", "--layers", "0:2", *options.worker_argv()]
    )
    assert EngineOptions.from_args(again) == options


def test_bad_arguments_exit_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["worker", "--fixture", "tiny-llama", "--layers", "two"])
    assert exc.value.code == 2
    assert "expected A:B" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--model", "m.gguf", "--layers", "0:10", "--ctx", "512", "--quiet"],
        ["generate", "--spawn", "3", "--model", "m.gguf", "--prompt", "hi", "-n", "4"],
        ["serve", "--spawn", "2", "--model", "m.gguf", "--port", "8080"],
        ["models", "fetch", "smollm2-135m-instruct", "--quiet"],
        ["certify", "--fixture", "tiny-llama", "--rpc", "off"],
    ],
)
def test_a_command_line_parses_the_same_with_its_subcommand_alone(argv: list[str]) -> None:
    """:func:`dgr_engine.cli.main` parses with the named subcommand's parser alone (one module
    imported): the same values as the whole command line's."""
    assert vars(cli.parser(argv[0]).parse_args(argv)) == vars(cli.parser().parse_args(argv))
