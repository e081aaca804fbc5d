"""``dgr generate`` end to end: over given endpoints, and over workers it spawns itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dgr_engine.cli.generate import DEFAULT_PROMPT
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_greedy
from dgr_engine.tooling.processes import WorkerProcess
from tests.harness import GEMMA3, SMOLLM2, RealLane

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("certified_fixtures")]

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)


def dgr(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run(
        [sys.executable, "-m", "dgr_engine.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        input=stdin,
        stdin=subprocess.DEVNULL if stdin is None else None,
    )


@pytest.fixture(scope="module")
def workers(tiny_llama: Path) -> Iterator[list[WorkerProcess]]:
    started = [WorkerProcess.spawn(tiny_llama, r, options=OPTIONS) for r in ((0, 3), (3, 4))]
    try:
        yield started
    finally:
        for w in started:
            w.stop()


def test_generate_over_given_endpoints(workers: list[WorkerProcess], tiny_llama: Path) -> None:
    endpoints = ",".join(w.address for w in workers)
    done = dgr("generate", "--endpoints", endpoints, "-n", "10", "--require", "fixture", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["tokens"] == whole_model_greedy(tiny_llama, [DEFAULT_PROMPT], 10, OPTIONS)[0]
    assert (report["state"], report["epoch"], report["route_changes"]) == ("done", 1, 0)
    assert [s["layers"] for s in report["stages"]] == [[0, 3], [3, 4]]

    # the lanes hold fixture evidence only: a route that requires more (the default,
    # real-hardware) is refused, typed, naming the stage and what it lacks
    refused = dgr("generate", "--endpoints", endpoints, "-n", "4", "--step-deadline", "5")
    assert refused.returncode == 1
    assert "failed:" in refused.stderr
    assert "certified with fixture evidence" in refused.stderr
    assert "requires real-hardware" in refused.stderr
    # the error says what it says; no blanket hint is added after it
    assert "the route was refused (see above)" not in refused.stderr


@pytest.mark.parametrize("transport", ["chain", "ring"])
def test_generate_over_a_chain_and_a_ring(
    workers: list[WorkerProcess], tiny_llama: Path, transport: str
) -> None:
    endpoints = ",".join(w.address for w in workers)
    done = dgr(
        "generate",
        "--endpoints",
        endpoints,
        "-n",
        "10",
        "--require",
        "fixture",
        "--transport",
        transport,
        "--json",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["tokens"] == whole_model_greedy(tiny_llama, [DEFAULT_PROMPT], 10, OPTIONS)[0]
    assert report["transport"] == transport
    # a chain's client sends the prefill and every decode step's frame; a ring's sends the
    # prefill and lets the last stage feed the first with each next token
    assert report["chain_frames_sent"] == (10 if transport == "chain" else 1)
    assert [s["forwards"] for s in report["stages"]] == [10, 10]


def test_generate_over_spawned_workers_checks_the_whole_model() -> None:
    done = dgr(
        "generate",
        "--spawn",
        "3",
        "--fixture",
        "tiny-llama",
        "-n",
        "12",
        "--check",
        "--require",
        "fixture",
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) == 12
    assert "whole-model equal: True" in done.stderr
    assert "dgr generate: starting 3 workers" in done.stderr
    assert done.stderr.count("forwards 12") == 3


def test_generate_over_dark_workers_is_refused(tmp_path: Path) -> None:
    # no record of this lane in an empty evidence directory: the spawned workers are dark and
    # no class of evidence makes them routable
    done = dgr(
        "generate",
        "--spawn",
        "2",
        "--fixture",
        "tiny-llama",
        "-n",
        "4",
        "--require",
        "fixture",
        "--evidence",
        str(tmp_path),
        "--step-deadline",
        "5",
    )
    assert done.returncode == 1
    assert "is dark: no certification record matches it" in done.stderr


def test_generate_over_mutual_tls_endpoints(tiny_llama: Path, tmp_path: Path) -> None:
    from dgr_engine.tooling.throwaway_ca import local_pki

    pki = local_pki(tmp_path)
    secure = [
        WorkerProcess.spawn(tiny_llama, r, options=OPTIONS, extra_args=pki.worker_args())
        for r in ((0, 2), (2, 4))
    ]
    try:
        endpoints = ",".join(w.address for w in secure)
        base = ["generate", "--endpoints", endpoints, "-n", "6", "--require", "fixture"]
        tls = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client.cert)]
        done = dgr(*base, *tls, "--tls-key", str(pki.client.key), "--json")
        assert done.returncode == 0, done.stderr
        want = whole_model_greedy(tiny_llama, [list(DEFAULT_PROMPT)], 6, OPTIONS)[0]
        assert json.loads(done.stdout)["tokens"] == want
        plain = dgr(*base, "--step-deadline", "3")  # no TLS: the workers are unreachable
        assert plain.returncode == 2 and "did not answer" in plain.stderr, plain.stderr
        assert len(plain.stderr.strip().splitlines()) == 1, plain.stderr
        half = dgr(*base, "--tls-cert", str(pki.client.cert))
        assert half.returncode == 2 and "--tls-cert and --tls-key need --tls-ca" in half.stderr
    finally:
        for worker in secure:
            worker.stop()


# -- a real model: SmolLM2-135M-Instruct --------------------------------------------------------

QUESTION = "What is the capital of France?"


def test_generate_a_chat_answer_from_smollm2_over_spawned_workers(
    smollm2_lane: RealLane,
) -> None:
    lock, evidence = smollm2_lane.lock, smollm2_lane.evidence
    done = dgr(
        "generate",
        "--model",
        SMOLLM2,
        "--spawn",
        "3",
        "--chat",
        "--prompt",
        QUESTION,
        "--lock",
        str(lock),
        "--evidence",
        str(evidence),
        "--check",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["text"] == "The capital of France is Paris.", report
    assert (report["state"], report["whole_model_equal"]) == ("done", True), report
    # it stopped at the model's end-of-turn token, long before the token limit
    assert report["tokens"][-1] == 2 and len(report["tokens"]) == 8, report
    assert [s["layers"] for s in report["stages"]] == [[0, 10], [10, 20], [20, 30]]


def test_generate_a_chat_answer_from_smollm2_over_given_workers(
    smollm2_lane: RealLane,
) -> None:
    model, lock, evidence = smollm2_lane.model, smollm2_lane.lock, smollm2_lane.evidence
    served = ["--lock", str(lock), "--evidence", str(evidence)]
    options = EngineOptions()
    started = [
        WorkerProcess.spawn(model, r, options=options, extra_args=served)
        for r in ((0, 15), (15, 30))
    ]
    try:
        endpoints = ",".join(w.address for w in started)
        done = dgr(
            "generate", "--endpoints", endpoints, "--model", SMOLLM2, "--chat", "--prompt",
            QUESTION, "--lock", str(lock), "--transport", "chain",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "The capital of France is Paris.", done.stdout
        assert "state done  epoch 1  route changes 0  8 tokens" in done.stderr, done.stderr
        # the client checks every stage's record against its own lock: under the repo's lock
        # (which does not trust this operator's key) the same workers are refused
        refused = dgr(
            "generate", "--endpoints", endpoints, "--model", SMOLLM2, "--chat", "--prompt",
            QUESTION, "--step-deadline", "5",
        )  # fmt: skip
        assert refused.returncode == 1 and "failed:" in refused.stderr, refused.stderr
    finally:
        for worker in started:
            worker.stop()


@pytest.fixture(scope="module")
def smollm2_workers(smollm2_lane: RealLane) -> Iterator[list[str]]:
    """Two SmolLM2 workers with the default engine options, and the client's arguments to
    reach them (``--endpoints``, ``--model``, ``--lock``)."""
    model, lock, evidence = smollm2_lane.model, smollm2_lane.lock, smollm2_lane.evidence
    served = ["--lock", str(lock), "--evidence", str(evidence)]
    started = [
        WorkerProcess.spawn(model, r, options=EngineOptions(), extra_args=served)
        for r in ((0, 15), (15, 30))
    ]
    try:
        endpoints = ",".join(w.address for w in started)
        yield ["--endpoints", endpoints, "--model", SMOLLM2, "--lock", str(lock)]
    finally:
        for worker in started:
            worker.stop()


def whole_model_text(model: Path, text: str, n_tokens: int) -> str:
    """The whole model's greedy chat answer to ``text`` (in-process), up to end-of-turn."""
    from dgr_engine.client.text import prompt_ids, until_stop
    from dgr_engine.tokenizer import Tokenizer

    with Tokenizer(model) as tokenizer:
        prompt = prompt_ids(tokenizer, text, chat=True)
        whole = whole_model_greedy(model, [prompt], n_tokens, EngineOptions())[0]
        tokens = until_stop(whole, tokenizer.eog_tokens)
        return tokenizer.decode([t for t in tokens if t not in tokenizer.eog_tokens])


COUNTING = "Count from 1 to 20, one number per line."


def test_sampling_with_a_seed_gives_the_same_text_again(smollm2_workers: list[str]) -> None:
    sample = [*smollm2_workers, "--chat", "--prompt", "Write a short poem about rivers."]
    sample += ["--temperature", "0.9", "--top-p", "0.95", "--top-k", "50", "-n", "40"]
    first = dgr("generate", *sample, "--seed", "11", "--json", "--quiet")
    again = dgr("generate", *sample, "--seed", "11", "--json", "--quiet")
    assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
    one, two = json.loads(first.stdout), json.loads(again.stdout)
    assert one["seed"] == 11 and one["text"] and one["text"] == two["text"], (one, two)
    assert one["tokens"] == two["tokens"]
    # a seed drawn at random is reported, and rerunning with it gives that text again
    drawn = json.loads(dgr("generate", *sample, "--json", "--quiet").stdout)
    replay = dgr("generate", *sample, "--seed", str(drawn["seed"]), "--json", "--quiet")
    assert json.loads(replay.stdout)["text"] == drawn["text"]


def test_a_stop_string_cuts_the_greedy_text_across_token_boundaries(
    smollm2_lane: RealLane, smollm2_workers: list[str]
) -> None:
    model = smollm2_lane.model
    whole = whole_model_text(model, COUNTING, 120)
    stop = "\n7"  # the newline ends one token, the digit begins the next
    assert stop in whole, whole
    done = dgr("generate", *smollm2_workers, "--chat", "--prompt", COUNTING, "--stop", stop)
    assert done.returncode == 0, done.stderr
    assert done.stdout == whole[: whole.find(stop)] + "\n", (done.stdout, whole)
    assert "state stopped at a stop string" in done.stderr, done.stderr


def test_the_prompt_comes_from_standard_input_and_the_answer_ends_at_end_of_turn(
    smollm2_lane: RealLane, smollm2_workers: list[str]
) -> None:
    done = dgr("generate", *smollm2_workers, "--chat", "--json", stdin=QUESTION + "\n")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["text"] == whole_model_text(smollm2_lane.model, QUESTION, 64), report
    assert report["text"] == "The capital of France is Paris."
    assert report["max_tokens"] == 256 - report["prompt_tokens"]  # the context's cut of 256
    assert report["state"] == "done" and report["tokens"][-1] == 2


def test_a_prompt_the_context_cannot_hold_is_one_line(smollm2_workers: list[str]) -> None:
    long = " ".join(["word"] * 300)
    done = dgr("generate", *smollm2_workers, "--prompt", long, "--quiet")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "dgr generate: the prompt holds 300 tokens and the route's context 256 positions: a "
        "shorter prompt, or workers with a bigger --ctx"
    ], done.stderr


# -- the second real model: Gemma 3 270M (gemma3, a base model: completion, no chat) ------------

COMPLETION = "Paris is the capital of"


def test_generate_a_completion_from_gemma3_over_spawned_workers(
    gemma3_lane: RealLane,
) -> None:
    from dgr_engine.tokenizer import Tokenizer

    model, lock, evidence = gemma3_lane.model, gemma3_lane.lock, gemma3_lane.evidence
    with Tokenizer(model) as tokenizer:  # the whole model's text, in-process
        prompt = tokenizer.encode(COMPLETION, add_special=True)
        whole = whole_model_greedy(model, [prompt], 16, EngineOptions())[0]
        text = tokenizer.decode(whole)
    assert text.startswith(" France"), text
    done = dgr(
        "generate", "--model", GEMMA3, "--spawn", "3", "--prompt", COMPLETION, "-n", "16",
        "--lock", str(lock), "--evidence", str(evidence), "--check",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == text + "\n", (done.stdout, text)
    assert "whole-model equal: True" in done.stderr, done.stderr
    assert "16 tokens" in done.stderr, done.stderr
    spans = [line.split()[1] for line in done.stderr.splitlines() if line.startswith("  ")]
    assert spans == ["[0,6)", "[6,12)", "[12,18)"], done.stderr  # 18 layers over 3 stages


# -- speculative decoding: the same text in fewer passes ----------------------------------------


def test_speculative_generate_prints_exactly_the_plain_text(tiny_llama: Path) -> None:
    base = ["generate", "--spawn", "2", "--fixture", "tiny-llama", "-n", "24"]
    base += ["--require", "fixture", "--quiet"]
    plain = dgr(*base)
    assert plain.returncode == 0, plain.stderr
    assert len(plain.stdout.split()) == 24, plain.stdout
    assert "speculation" not in plain.stderr
    for source, name in (("ngram", "ngram"), (f"draft:{tiny_llama}", "draft-model")):
        fast = dgr(*base, "--speculate", source, "--draft-max", "6")
        assert fast.returncode == 0, fast.stderr
        assert fast.stdout == plain.stdout, (source, fast.stdout, plain.stdout)
        line = next(s for s in fast.stderr.splitlines() if s.startswith("speculation "))
        words = line.split()
        drafted = int(words[words.index("drafted") - 1])
        accepted = int(words[words.index("accepted") - 1])
        assert words[1] == f"{name}:" and drafted > 0 and 0 <= accepted <= drafted, line
    # the model is its own draft: every draft is accepted, several tokens per pass
    assert accepted == drafted, line
    passes = int(words[words.index("passes") - 1])
    assert passes < 23, line
    # and --json carries the same figures
    report = json.loads(dgr(*base, "--speculate", f"draft:{tiny_llama}", "--json").stdout)
    assert report["tokens"] == [int(t) for t in plain.stdout.split()]
    assert report["speculation"]["source"] == "draft-model"
    assert report["speculation"]["acceptance"] == 1.0
