"""``dgr generate``'s command line: a mistake is one line on stderr and exit 2, before any
worker starts (these run in the fast set: none may start one)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from dgr_engine import cli
from dgr_engine.fixtures.converted import ensure_converted
from dgr_engine.models import CATALOG

UNREACHABLE = "127.0.0.1:9"
"""An endpoint nothing serves (the discard port): the tests below are refused before dialing."""


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    try:
        code = cli.main(["generate", *args])
    except SystemExit as exit:  # the parser's own refusals
        code = exit.code  # type: ignore[assignment]
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dgr generate: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


@pytest.fixture(scope="module")
def vocab() -> str:
    """A GGUF with a real tokenizer and chat template (converter-made, a few MB)."""
    return str(ensure_converted("hf-llama-gqa").gguf)


def test_an_unknown_model_name_lists_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(capsys, "--model", "smollm9", "--spawn", "2", "--chat", "--prompt", "hi")
    assert "'smollm9'" in line and all(name in line for name in CATALOG), line


def test_a_missing_gguf_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "absent.gguf"
    line = refused(capsys, "--model", str(missing), "--spawn", "2")
    assert str(missing) in line and "no such GGUF file" in line, line


def test_an_unknown_fixture_lists_the_fixtures(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(capsys, "--fixture", "tiny-nope", "--spawn", "2")
    assert "tiny-nope" in line and "tiny-llama" in line, line


def test_an_unreadable_lock_is_refused_before_any_worker(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    line = refused(
        capsys, "--fixture", "tiny-llama", "--spawn", "2", "--lock", str(tmp_path / "no.json")
    )
    assert "--lock" in line and "no.json" in line, line


def test_chat_needs_a_text_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(capsys, "--fixture", "tiny-llama", "--spawn", "2", "--ids", "--chat")
    assert "--chat needs a text prompt" in line, line


def test_a_text_prompt_on_a_model_without_a_tokenizer_asks_for_ids(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = refused(capsys, "--fixture", "tiny-llama", "--spawn", "2", "--prompt", "hello")
    assert "has no tokenizer" in line and "--ids" in line, line


def test_a_token_limit_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(capsys, "--fixture", "tiny-llama", "--spawn", "2", "-n", "0")
    assert "max_tokens must be >= 1" in line, line


def test_spawn_needs_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(capsys, "--spawn", "2")
    assert "--spawn needs --model or --fixture" in line, line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--spawn", "0"], "argument --spawn: must be in [1, 4096], got 0"),
        (["--spawn", "5"], "has 4 layers, at most one worker per layer"),
        (["--spawn", "2", "--step-deadline", "-1"], "argument --step-deadline: must be in"),
        (["--spawn", "2", "--step-deadline", "nan"], "argument --step-deadline: must be in"),
        (["--spawn", "2", "--temperature", "-0.5"], "argument --temperature: must be in"),
        (["--spawn", "2", "--top-p", "1.5"], "argument --top-p: must be in"),
        (["--spawn", "2", "--temperature", "1", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["--spawn", "2", "--top-k", "-1"], "argument --top-k: must be in"),
        (["--spawn", "2", "--seed", "x"], "argument --seed: expected an integer"),
        (["--spawn", "2", "--ctx", "0"], "argument --ctx: must be in"),
        (["--spawn", "2", "--stop", ""], "a stop string cannot be empty"),
        (["--spawn", "2", "--stop", "x"], "--stop needs a text prompt"),
    ],
)
def test_bad_numbers_are_one_line_before_any_worker(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    line = refused(capsys, "--fixture", "tiny-llama", *args)
    assert says in line, line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--presence-penalty", "3"], "argument --presence-penalty: must be in"),
        (["--frequency-penalty", "-2.5"], "argument --frequency-penalty: must be in"),
        (["--min-p", "1.5"], "argument --min-p: must be in"),
        (["--repeat-penalty", "0"], "repetition_penalty must be finite and > 0"),
        (["--penalty-last-n", "-1"], "argument --penalty-last-n: must be in"),
    ],
)
def test_sampler_values_out_of_range_are_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    line = refused(capsys, "--fixture", "tiny-llama", "--spawn", "2", *args)
    assert says in line, line


def test_check_compares_greedy_tokens_only(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(
        capsys, "--fixture", "tiny-llama", "--spawn", "2", "--check", "--temperature", "0.7"
    )
    assert "--check compares greedy tokens" in line, line


@pytest.mark.parametrize("endpoints", ["127.0.0.1", "127.0.0.1:0", "host:port", ","])
def test_malformed_endpoints_are_refused(
    capsys: pytest.CaptureFixture[str], endpoints: str
) -> None:
    line = refused(capsys, "--endpoints", endpoints, "--ids", "--prompt", "1 2")
    assert "--endpoints" in line, line


def test_without_a_prompt_on_a_terminal_a_prompt_is_asked_for(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, vocab: str
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Terminal())
    line = refused(capsys, "--endpoints", UNREACHABLE, "--vocab", vocab, "--chat")
    assert "--prompt TEXT is needed (or the prompt on standard input)" in line, line


def test_an_empty_prompt_on_standard_input_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, vocab: str
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("\n\n"))
    line = refused(capsys, "--endpoints", UNREACHABLE, "--vocab", vocab)
    assert "the prompt on standard input is empty" in line, line


def test_an_endpoint_that_does_not_answer_is_named(
    capsys: pytest.CaptureFixture[str], vocab: str
) -> None:
    line = refused(
        capsys, "--endpoints", UNREACHABLE, "--vocab", vocab, "--prompt", "hi",
        "--step-deadline", "2", "--quiet",
    )  # fmt: skip
    assert line.startswith(f"dgr generate: {UNREACHABLE} did not answer"), line
