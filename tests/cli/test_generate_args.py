"""``dgr generate``'s command line: a mistake is one line on stderr and exit 2, before any
worker starts (these run in the fast set: none may start one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dgr_engine import cli
from dgr_engine.models import CATALOG


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert cli.main(["generate", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dgr generate: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


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
    assert "--max-new-tokens must be at least 1" in line, line


def test_spawn_needs_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(capsys, "--spawn", "2")
    assert "--spawn needs --model or --fixture" in line, line
