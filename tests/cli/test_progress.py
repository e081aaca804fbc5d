"""Progress on stderr and its ``--quiet`` switch: every subcommand takes ``--quiet``; lines,
byte counts and timed steps print unless it is given, and the switch never outlives the block
that set it."""

from __future__ import annotations

import argparse
import asyncio
import io
import re

import pytest

from dgr_engine import cli
from dgr_engine.cli._progress import (
    is_quiet,
    progress_printer,
    quiet_progress,
    say,
    sayer,
    timed,
)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def all_parsers(
    p: argparse.ArgumentParser, path: str = "dgr"
) -> list[tuple[str, argparse.ArgumentParser]]:
    found: list[tuple[str, argparse.ArgumentParser]] = [(path, p)]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, nested in action.choices.items():
                found += all_parsers(nested, f"{path} {name}")
    return found


def test_every_subcommand_and_its_own_subcommands_take_quiet() -> None:
    parsers = all_parsers(cli.parser())[1:]  # the top parser has subcommands, not options
    assert len(parsers) >= len(cli._SUBCOMMANDS) + 3  # models, fixtures, lock, ... have their own
    missing = [path for path, p in parsers if "--quiet" not in p._option_string_actions]
    assert missing == []


@pytest.mark.parametrize(
    ("argv", "quiet"),
    [
        (["demo"], False),
        (["demo", "--quiet"], True),
        (["models", "fetch", "smollm2-135m-instruct"], False),
        (["models", "fetch", "smollm2-135m-instruct", "--quiet"], True),
        (["models", "--quiet", "fetch", "smollm2-135m-instruct"], True),
        (["gate", "DGR-054", "--quiet"], True),
    ],
)
def test_quiet_is_false_unless_given_wherever_it_is_given(argv: list[str], quiet: bool) -> None:
    assert cli.parser().parse_args(argv).quiet is quiet


def test_a_line_goes_to_stderr_unless_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    say("starting 3 workers ...")
    with quiet_progress(True):
        say("not shown")
        assert is_quiet()
    assert not is_quiet()  # restored: nothing leaks out of the block
    say("3 workers ready in 2.1 s")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "starting 3 workers ...\n3 workers ready in 2.1 s\n"


def test_a_sayer_keeps_the_switch_it_was_made_under(capsys: pytest.CaptureFixture[str]) -> None:
    with quiet_progress(True):
        silent = sayer()
    loud = sayer("dgr: ")
    with quiet_progress(True):
        loud("made outside the quiet block")
    silent("made inside it")
    assert capsys.readouterr().err == "dgr: made outside the quiet block\n"


def test_the_switch_reaches_asyncio_tasks_and_threads(capsys: pytest.CaptureFixture[str]) -> None:
    async def probe() -> bool:
        return is_quiet()

    async def steps() -> list[bool]:
        in_thread = await asyncio.to_thread(is_quiet)
        in_task = await asyncio.create_task(probe())
        await asyncio.to_thread(say, "from a thread")
        return [in_thread, in_task]

    with quiet_progress(True):
        assert asyncio.run(steps()) == [True, True]
    assert capsys.readouterr().err == ""


def test_a_timed_step_says_when_it_starts_and_how_long_it_took() -> None:
    lines: list[str] = []
    with timed("starting 2 workers", lines.append):
        assert lines == ["starting 2 workers ..."]
    assert re.fullmatch(r"starting 2 workers: \d+\.\d s", lines[1]), lines
    with pytest.raises(KeyError), timed("certifying", lines.append):
        raise KeyError("boom")
    assert re.fullmatch(r"certifying: failed after \d+\.\d s", lines[-1]), lines


def test_a_byte_count_off_a_terminal_prints_a_line_every_percent() -> None:
    out = io.StringIO()
    report, finish = progress_printer("fetch", out)
    total = 1000 * 2**10
    for done in range(0, total + 1, total // 100):
        report("model.gguf", done, total)
    finish()
    lines = out.getvalue().splitlines()
    assert len(lines) == 101, lines  # 0 %, 1 %, ..., 100 %
    assert lines[0] == "fetch model.gguf 0% 0/1024000 bytes"
    assert lines[-1] == "fetch model.gguf 100% 1024000/1024000 bytes"


def test_a_byte_count_on_a_terminal_is_a_tqdm_bar() -> None:
    out = Terminal()
    report, finish = progress_printer("fetch", out)
    for done in (0, 512 * 2**10, 2**20):
        report("model.gguf", done, 2**20)
    finish()
    text = out.getvalue()
    assert "\r" in text and "fetch model.gguf" in text, text  # redrawn in place
    assert "100%" in text and "1.00M/1.00M" in text, text


def test_quiet_silences_byte_counts_and_timed_steps(capsys: pytest.CaptureFixture[str]) -> None:
    out = Terminal()
    with quiet_progress(True):
        report, finish = progress_printer("fetch", out)
        with timed("building the fixture tiny-llama"):
            report("model.gguf", 1, 2)
        finish()
    assert out.getvalue() == "" and capsys.readouterr().err == ""
