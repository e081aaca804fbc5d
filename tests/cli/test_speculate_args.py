"""``--speculate`` and ``--draft-max`` of ``dgr generate`` and ``dgr chat``: every mistake is one
line on stderr and exit 2, before any worker starts (these run in the fast set: none may start
one); the plan gives each session its own speculation over the command's drafter."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from dgr_engine import cli
from dgr_engine.cli._route import RouteHandle
from dgr_engine.cli._speculate import (
    SpeculateSource,
    SpeculationPlan,
    SpeculationRefused,
    speculation_line,
)
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.fixtures.converted import ensure_converted
from dgr_engine.models import CATALOG
from dgr_engine.speculative import ModelDrafter
from dgr_session.drafts import NgramDrafter

UNREACHABLE = "127.0.0.1:9"
"""An endpoint nothing serves (the discard port): the tests below are refused before dialing."""
TINY = ("--fixture", "tiny-llama", "--spawn", "2")


def refused(capsys: pytest.CaptureFixture[str], command: str, *args: str) -> str:
    try:
        code = cli.main([command, *args])
    except SystemExit as exit:  # the parser's own refusals
        code = exit.code  # type: ignore[assignment]
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dgr {command}: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


@pytest.fixture(scope="module")
def tiny_llama_gguf() -> str:
    return str(ensure_fixture("tiny-llama"))


@pytest.fixture(scope="module")
def vocab() -> str:
    """A GGUF with a real tokenizer of 320 tokens (converter-made, a few MB): tiny-llama has
    256."""
    return str(ensure_converted("hf-llama-gqa").gguf)


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--speculate", "lookahead"], "argument --speculate: unknown source 'lookahead'"),
        (
            ["--speculate", "ngram:3"],
            "unknown source 'ngram:3': expected ngram, draft:PATH, mtp, off",
        ),
        (["--speculate", "draft:"], "draft: needs a GGUF or a model name"),
        (["--speculate", "ngram", "--draft-max", "0"], "argument --draft-max: must be in [1, 16]"),
        (["--speculate", "ngram", "--draft-max", "17"], "argument --draft-max: must be in [1, 16]"),
        (["--speculate", "mtp"], "has no MTP block (only a DeepSeek V4 model with one has it)"),
        (
            ["--speculate", "draft:smollm9"],
            "--speculate draft:smollm9: ",
        ),
    ],
)
def test_a_bad_speculation_is_one_line_before_any_worker(
    capsys: pytest.CaptureFixture[str], command: str, args: list[str], says: str
) -> None:
    line = refused(capsys, command, *TINY, *args)
    assert says in line, line


def test_an_unknown_draft_model_name_lists_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(capsys, "generate", *TINY, "--speculate", "draft:smollm9")
    assert "'smollm9'" in line and all(name in line for name in CATALOG), line


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_missing_draft_file_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    missing = tmp_path / "draft.gguf"
    line = refused(capsys, command, *TINY, "--speculate", f"draft:{missing}")
    assert line.endswith(f"--speculate draft:{missing}: {missing}: no such GGUF file"), line


def test_a_draft_file_that_is_no_gguf_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    line = refused(capsys, "generate", *TINY, "--speculate", f"draft:{junk}")
    assert str(junk) in line, line


def test_a_draft_model_of_another_vocabulary_is_refused_before_any_worker(
    capsys: pytest.CaptureFixture[str], vocab: str
) -> None:
    line = refused(capsys, "generate", *TINY, "--speculate", f"draft:{vocab}")
    assert "has a vocabulary of 320 tokens, the target's has 256" in line, line
    assert "starting" not in line


def test_chat_refuses_a_draft_of_another_vocabulary_than_its_vocab(
    capsys: pytest.CaptureFixture[str], vocab: str, tiny_llama_gguf: str
) -> None:
    line = refused(
        capsys, "chat", "--endpoints", UNREACHABLE, "--vocab", vocab,
        "--speculate", f"draft:{tiny_llama_gguf}",
    )  # fmt: skip
    assert "has a vocabulary of 256 tokens, the target's has 320" in line, line


def route(n_vocab: int, context: int = 64) -> RouteHandle:
    """What :meth:`SpeculationPlan.open` reads of a running route."""
    return cast(RouteHandle, SimpleNamespace(n_vocab=n_vocab, context=context))


def test_a_draft_model_the_running_route_does_not_match_is_refused(
    tiny_llama_gguf: str,
) -> None:
    # over --endpoints without a local GGUF, the vocabulary is the last stage's output width
    plan = SpeculationPlan(SpeculateSource("draft", tiny_llama_gguf), 8, Path(tiny_llama_gguf))
    from dgr_engine.options import EngineOptions

    with pytest.raises(SpeculationRefused, match="vocabulary of 256 tokens, the target's has 320"):
        plan.open(route(320), EngineOptions())
    drafter = plan.open(route(256), EngineOptions())
    try:
        assert isinstance(drafter, ModelDrafter) and drafter.n_ctx == 64
    finally:
        drafter.close()


def test_each_session_gets_its_own_speculation_over_the_one_drafter() -> None:
    plan = SpeculationPlan(SpeculateSource.parse("ngram"), 3, None)
    from dgr_engine.options import EngineOptions

    drafter = plan.open(route(256), EngineOptions())
    assert isinstance(drafter, NgramDrafter)
    one, two = plan.session(drafter), plan.session(drafter)
    assert one is not two and one.length is not two.length
    assert one.drafter is drafter and two.drafter is drafter
    assert (one.max_drafts, one.length.k_max, one.length.k) == (3, 3, 2)  # two drafts first
    one.verified(2, 2)
    one.verified(1, 0)
    assert (one.passes, two.passes) == (2, 0) and one.length.k == 1
    line = speculation_line(one)
    assert line == (
        "speculation ngram: 2 passes  3 drafted  2 accepted  acceptance 0.67  2.00 tokens per pass"
    ), line


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("ngram", ("ngram", None)),
        ("mtp", ("mtp", None)),
        ("draft:smollm2-135m-instruct", ("draft", "smollm2-135m-instruct")),
        ("draft:/m/a:b.gguf", ("draft", "/m/a:b.gguf")),
    ],
)
def test_sources_parse_and_print_as_given(text: str, parsed: tuple[Any, ...]) -> None:
    source = SpeculateSource.parse(text)
    assert (source.kind, source.model) == parsed
    assert str(source) == text


def test_serve_speculates_by_prompt_lookup_unless_told_otherwise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert "(default ngram)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "(default off)" in " ".join(capsys.readouterr().out.split())
