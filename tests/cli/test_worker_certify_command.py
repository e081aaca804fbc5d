"""The command a dark worker advertises: what ``dgr certify`` needs to certify its lane."""

from __future__ import annotations

import os

from dgr_engine import cli
from dgr_engine.cli.worker import WorkerSettings, certify_command
from dgr_engine.options import EngineOptions


def command(*argv: str) -> str:
    args = cli.parser().parse_args(["worker", "--layers", "0:2", *argv])
    said = WorkerSettings.from_args(args).certify_command()
    assert certify_command(args) == said  # the same for a caller holding the command line
    return said


def test_only_the_lane_options_that_differ_from_the_defaults_are_given() -> None:
    assert command("--fixture", "tiny-llama") == "dgr certify --fixture tiny-llama"
    assert command("--fixture", "tiny-llama", "--threads", "4", "--max-sessions", "2") == (
        "dgr certify --fixture tiny-llama"  # threads and slots are not part of the lane
    )
    assert command("--fixture", "tiny-llama", "--ctx", "512", "--kv-type", "f32") == (
        "dgr certify --fixture tiny-llama --ctx 512 --kv-type f32"
    )
    assert EngineOptions(batching="co-batch", n_batch=8).lane_argv() == ["--batching", "co-batch"]


def test_a_file_is_named_by_its_absolute_path_and_a_catalog_name_as_given() -> None:
    here = os.getcwd()
    assert command("--model", "m dir/x.gguf") == f"dgr certify --model '{here}/m dir/x.gguf'"
    assert command("--model", "smollm2-135m-instruct") == (
        "dgr certify --model smollm2-135m-instruct"
    )


def test_the_evidence_and_lock_a_worker_reads_are_where_the_record_must_go() -> None:
    assert command("--fixture", "tiny-llama", "--evidence", "ev", "--lock", "/l.json") == (
        f"dgr certify --fixture tiny-llama --evidence {os.getcwd()}/ev --lock /l.json"
    )


def test_a_split_model_has_no_command() -> None:
    assert command("--manifest", "m.json") == ""
