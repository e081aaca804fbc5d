"""``dgr chat``'s command line: a mistake is one line on stderr and exit 2, before any worker
starts (these run in the fast set: none may start one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgr_engine import cli
from dgr_engine.fixtures.converted import ensure_converted

UNREACHABLE = "127.0.0.1:9"
"""An endpoint nothing serves (the discard port)."""


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    try:
        code = cli.main(["chat", *args])
    except SystemExit as exit:  # the parser's own refusals
        code = exit.code  # type: ignore[assignment]
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dgr chat: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


@pytest.fixture(scope="module")
def vocab() -> str:
    """A GGUF with a real tokenizer and chat template (converter-made, a few MB)."""
    return str(ensure_converted("hf-llama-gqa").gguf)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "one of the arguments --endpoints --spawn is required"),
        (["--fixture", "tiny-llama", "--spawn", "0"], "argument --spawn: must be in"),
        (["--fixture", "tiny-llama", "--spawn", "9"], "has 4 layers, at most one worker"),
        (["--fixture", "tiny-nope", "--spawn", "2"], "tiny-nope"),
        (["--model", "smollm9", "--spawn", "2"], "'smollm9'"),
        (["--fixture", "tiny-llama", "--spawn", "2", "--step-deadline", "0"], "--step-deadline"),
        (["--fixture", "tiny-llama", "--spawn", "2", "--temperature", "x"], "--temperature"),
        (["--fixture", "tiny-llama", "--spawn", "2", "-n", "0"], "max_tokens must be >= 1"),
        (["--spawn", "2"], "--spawn needs --model or --fixture"),
    ],
)
def test_bad_arguments_are_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    line = refused(capsys, *args)
    assert says in line, line


def test_a_model_without_a_tokenizer_cannot_chat(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(capsys, "--fixture", "tiny-llama", "--spawn", "2")
    assert line == "dgr chat: dgr chat needs a model with a tokenizer (--model, or --vocab GGUF)"


def test_a_missing_vocab_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = refused(capsys, "--endpoints", UNREACHABLE, "--vocab", str(tmp_path / "v.gguf"))
    assert "v.gguf: no such GGUF file" in line, line


def test_an_endpoint_that_does_not_answer_is_named(
    capsys: pytest.CaptureFixture[str], vocab: str
) -> None:
    line = refused(
        capsys, "--endpoints", UNREACHABLE, "--vocab", vocab, "--step-deadline", "2", "--quiet"
    )
    assert line.startswith(f"dgr chat: {UNREACHABLE} did not answer"), line


def test_the_help_tells_the_chat_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        cli.main(["chat", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert "/reset" in out and "/exit" in out and "--system" in out and "--top-p" in out
