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

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("certified_fixtures")]

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)


def dgr(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run(
        [sys.executable, "-m", "dgr_engine.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
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
    assert "dgr certify" in refused.stderr


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
        assert plain.returncode == 1 and "failed:" in plain.stderr
        half = dgr(*base, "--tls-cert", str(pki.client.cert))
        assert half.returncode == 2 and "--tls-cert and --tls-key need --tls-ca" in half.stderr
    finally:
        for worker in secure:
            worker.stop()
