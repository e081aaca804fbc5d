"""benchmarks/model_arg.py: what --fixture / --model resolve to, the one line and exit 2 of a
model that cannot be had, and the certify command and trust a benchmark passes on."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import chain, peers, shard_memory
from benchmarks.model_arg import BenchModelError, add_model_arguments, resolve
from dgr_engine.fixtures import ensure_fixture
from dgr_engine.models import CATALOG
from dgr_engine.options import EngineOptions


def _args(*argv: str, trust: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, default_fixture="tiny-llama", trust=trust)
    return parser.parse_args(list(argv))


def test_no_flag_is_the_default_fixture() -> None:
    model = resolve(_args())
    assert (model.label, model.kind, model.n_layer, model.n_embd) == (
        "tiny-llama",
        "fixture",
        4,
        64,
    )
    assert model.certify_model == ("--fixture", "tiny-llama")
    assert model.path == ensure_fixture("tiny-llama")


def test_a_gguf_path_is_classed_by_its_own_mark() -> None:
    path = ensure_fixture("tiny-llama")
    model = resolve(_args("--model", str(path)))
    assert model.kind == "fixture"  # the file's dgr.fixture mark, not the flag it came by
    assert model.label == path.name
    assert model.certify_model == ("--model", str(path))
    assert (model.n_layer, model.n_vocab) == (4, 256)


def test_an_unknown_name_lists_the_catalog() -> None:
    with pytest.raises(BenchModelError, match="no real model named .no-such-model.") as caught:
        resolve(_args("--model", "no-such-model"))
    assert all(name in str(caught.value) for name in CATALOG)


def test_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(BenchModelError, match="no such GGUF file"):
        resolve(_args("--model", str(tmp_path / "gone.gguf")))


def test_a_file_that_is_no_gguf_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(BenchModelError, match="not a readable GGUF"):
        resolve(_args("--model", str(bad)))


def test_an_unknown_fixture_is_refused() -> None:
    with pytest.raises(BenchModelError, match="unknown fixture"):
        resolve(_args("--fixture", "no-such-fixture"))


def test_fixture_and_model_exclude_each_other() -> None:
    with pytest.raises(SystemExit) as caught:
        _args("--fixture", "tiny-llama", "--model", "x")
    assert caught.value.code == 2


def test_a_missing_lock_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(BenchModelError, match="--lock .*: no such file"):
        resolve(_args("--lock", str(tmp_path / "lock.json")))


def test_trust_goes_to_certify_and_to_the_environment(tmp_path: Path) -> None:
    lock, key = tmp_path / "lock.json", tmp_path / "key.pem"
    lock.write_text("{}")
    key.write_text("")
    evidence = tmp_path / "evidence"
    argv = ("--lock", str(lock), "--evidence", str(evidence), "--sign-key", str(key))
    model = resolve(_args(*argv))
    options = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=2)
    command = model.certify_argv(options)
    assert command[1:4] == ["certify", "--fixture", "tiny-llama"]
    assert "--reuse" in command
    assert command[-6:] == list(argv)
    assert options.worker_argv()[0] in command
    env: dict[str, str] = {}
    model.export_trust(env)
    assert env == {"DGR_LOCK": str(lock.resolve()), "DGR_EVIDENCE_DIR": str(evidence.resolve())}


def test_without_trust_flags_the_environment_is_left_alone() -> None:
    model = resolve(_args("--fixture", "tiny-llama", trust=False))
    assert model.trust == ()
    env = {"DGR_LOCK": "kept"}
    model.export_trust(env)
    assert env == {"DGR_LOCK": "kept"}


def test_the_evidence_note_says_what_the_figures_are(tmp_path: Path) -> None:
    fixture = resolve(_args())
    assert fixture.evidence_note(2).startswith("fixture evidence on this shared 2-core machine")
    real = resolve(_args("--model", str(ensure_fixture("tiny-llama"))))
    assert "concurrently" in real.evidence_note(2)


@pytest.mark.parametrize("main", [chain.main, peers.main, shard_memory.main])
def test_each_benchmark_refuses_an_unknown_model_in_one_line(
    main: object, capsys: pytest.CaptureFixture[str]
) -> None:
    assert callable(main)
    assert main(["--model", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("benchmarks.") and "no-such-model" in err[0]
