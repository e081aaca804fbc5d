"""Worker metrics (issue 17, part 2): real workers serve Prometheus metrics; scraped after a
route session that lost a stage, the counters say what the route did: prefill, decode and
replay frames and rows, seam bytes, refusals, open sessions, the build and lane."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from route_runs import lose_last_stage_at, run_session

from dgr_engine.client import ShardClient
from dgr_engine.errors import ExpectationMismatch
from dgr_engine.options import EngineOptions
from dgr_engine.route_provider import LoopbackRouteProvider, PooledWorker
from dgr_engine.wire.frames import Expectations
from dgr_session import SessionState

pytestmark = pytest.mark.usefixtures("certified_fixtures")

OPTIONS = EngineOptions(n_threads=1, n_ctx_per_session=256, n_batch=64, max_sessions=4)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
N_NEW, LOSE_AT = 8, 4
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(worker: PooledWorker) -> Samples:
    """Every sample of the worker's metrics, by name and labels."""
    (line,) = [s for s in worker.process.stdout_lines if s.startswith("METRICS ")]
    url = f"http://{line.split(' ', 1)[1]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - 127.0.0.1
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def count(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_scraped_counters_match_what_the_route_did(tiny_llama: Path) -> None:
    provider = LoopbackRouteProvider(
        tiny_llama, [(0, 2), (2, 4)], spares=[(2, 4)], options=OPTIONS,
        worker_args=["--metrics-port", "0"],
    )  # fmt: skip
    samples: dict[str, Samples] = {}

    async def scrape_the_workers(provider: LoopbackRouteProvider) -> None:
        first = provider.workers[0]
        async with ShardClient(first.endpoint, timeout=10.0) as client:
            wrong = Expectations(b"\0" * 32, 0, 2, 0)  # another model's hash
            with pytest.raises(ExpectationMismatch):
                await client.open("wrong", 1, wrong)
        samples[first.role] = scrape(first)
        samples["spare"] = scrape(next(w for w in provider.workers if w.role == "spare"))

    result = run_session(
        provider,
        PROMPT,
        N_NEW,
        on_token=lose_last_stage_at(provider, LOSE_AT),
        after=scrape_the_workers,
    )
    assert result.state is SessionState.DONE and result.route_changes == 1
    first, spare = samples["primary"], samples["spare"]
    # the first stage ran the whole session: the prompt, the decode steps up to the loss (the
    # last one in flight when the next stage died), then the batched re-prefill of prompt and
    # accepted tokens (replay), then the remaining decode steps (none after the last token)
    assert count(first, "dgr_worker_forwards_total", kind="prefill") == 1
    assert count(first, "dgr_worker_rows_total", kind="prefill") == len(PROMPT)
    assert count(first, "dgr_worker_rows_total", kind="replay") == len(PROMPT) + LOSE_AT
    assert count(first, "dgr_worker_forwards_total", kind="replay") == 1
    assert count(first, "dgr_worker_rows_total", kind="decode") == N_NEW - 1
    # the spare joined at the re-prefill: replay rows, then decode; never a first prefill
    assert count(spare, "dgr_worker_rows_total", kind="prefill") == 0
    assert count(spare, "dgr_worker_rows_total", kind="replay") == len(PROMPT) + LOSE_AT
    assert count(spare, "dgr_worker_rows_total", kind="decode") == N_NEW - LOSE_AT - 1
    assert count(first, "dgr_worker_seam_bytes_total", direction="in") > 0
    assert count(first, "dgr_worker_seam_bytes_total", direction="out") > 0
    assert count(first, "dgr_worker_refusals_total", status="DGR_E_EXPECTATION_MODEL") == 1
    assert count(first, "dgr_worker_sessions_open") == 0
    assert count(first, "dgr_worker_session_slots") == OPTIONS.max_sessions
    frames = sum(
        count(first, "dgr_worker_forwards_total", kind=k) for k in ("prefill", "replay", "decode")
    )
    assert count(first, "dgr_worker_engine_seconds_count") == frames
    info = [key for key in first if key[0] == "dgr_worker_info"]
    assert len(info) == 1 and dict(info[0][1])["layers"] == "0:2"
