"""``dgr demo``'s command line and its choice of model: a mistake is one line on stderr and
exit 2 before anything runs; a real model that cannot be had falls back to the fixture, saying
so (these run in the fast set: no worker starts)."""

from __future__ import annotations

import argparse

import pytest

from dgr_engine import cli
from dgr_engine.cli import demo
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.models import CATALOG, ModelFetchFailed, ModelNotFetched


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert cli.main(["demo", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dgr demo: "), captured.err
    assert "Traceback" not in captured.err + captured.out and captured.out == ""
    return lines[0]


def test_an_unknown_model_name_lists_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(capsys, "--model", "smollm9")
    assert "'smollm9'" in line and all(name in line for name in CATALOG), line


def test_an_unknown_fixture_lists_the_fixtures(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(capsys, "--fixture", "tiny-nope")
    assert "tiny-nope" in line and "tiny-llama" in line, line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--fixture", "tiny-llama", "--prompt", "hi"], "--prompt goes with a real model"),
        (["--sessions", "3"], "--sessions goes with --fixture"),
        (["--lose-at", "0"], "--lose-at must be in (0, --steps)"),
        (["--steps", "4", "--lose-at", "4"], "--lose-at must be in (0, --steps)"),
        (["--fixture", "tiny-llama", "--sessions", "0"], "--sessions must be at least 1"),
        (["--prompt", "  "], "--prompt needs some text"),
    ],
)
def test_bad_values_are_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert says in refused(capsys, *args)


def demo_args(*argv: str) -> argparse.Namespace:
    return cli.parser().parse_args(["demo", *argv])


def test_the_real_model_is_the_default() -> None:
    args = demo_args()
    assert (args.model, args.fixture) == ("smollm2-135m-instruct", None)


def test_a_model_that_cannot_be_had_falls_back_to_the_fixture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dgr_engine.models as models

    def not_here(model: object, root: object) -> None:
        raise ModelNotFetched("not fetched")

    def no_network(*args: object, **kwargs: object) -> None:
        raise ModelFetchFailed("smollm2-135m-instruct: could not download (no network)")

    monkeypatch.setattr(models, "model_path", not_here)
    monkeypatch.setattr(models, "fetch_model", no_network)
    said: list[str] = []
    chosen = demo.choose_model(demo.DemoSettings.from_args(demo_args()), said.append)
    assert chosen.real is None and chosen.path == ensure_fixture(demo.DEFAULT_FIXTURE)
    assert chosen.path.is_file() and chosen.n_layer == 4
    (fallback,) = [line for line in said if "cannot be had" in line]
    assert "no network" in fallback and "falling back to the generated fixture" in fallback


def test_a_fetched_model_is_taken_as_it_is(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import dgr_engine.models as models

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")

    def fetched(model: object, root: object) -> object:
        return gguf

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("fetched again")

    monkeypatch.setattr(models, "model_path", fetched)
    monkeypatch.setattr(models, "fetch_model", never)
    said: list[str] = []
    chosen = demo.choose_model(demo.DemoSettings.from_args(demo_args()), said.append)
    assert chosen.path == gguf and chosen.real is not None and chosen.n_layer == 30
    assert said == []


def test_console_resumes_streamed_text_after_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    console = demo.Console()
    console.stream("answer", "The capital")
    console.stream("answer", " of")
    console.say("step   3  SIGKILL ...")
    console.stream("answer", " France")
    console.end_stream()
    assert capsys.readouterr().out.splitlines() == [
        "answer    The capital of",
        "step   3  SIGKILL ...",
        "answer    ... France",
    ]
