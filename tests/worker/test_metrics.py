"""Worker metrics (issue 17, part 2): real workers serve Prometheus metrics; scraped after a
route session that lost a stage, the counters say what the route did: prefill, decode and
replay frames and rows, seam bytes, refusals, open sessions, the build and lane. The metrics
bind loopback unless told otherwise, and over the worker's TLS need its CA (and, under mutual
TLS, a client certificate of it) (issue 28)."""

from __future__ import annotations

import asyncio
import http.client
import socket
import ssl
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dgr_engine.client.shard_client import ShardClient
from dgr_engine.errors import ExpectationMismatch
from dgr_engine.options import EngineOptions
from dgr_engine.security.tls import ClientTls, ServerTls
from dgr_engine.tooling.loopback import LoopbackRouteProvider, PooledWorker
from dgr_engine.tooling.processes import WorkerProcess
from dgr_engine.tooling.throwaway_ca import Issued, authority
from dgr_engine.wire.frames import Expectations
from dgr_engine.worker import ShardWorker, WorkerConfig
from dgr_session import SessionState
from tests.harness import lose_last_stage_at, run_session

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


@pytest.mark.usefixtures("certified_fixtures")  # a route session needs certified lanes
@pytest.mark.slow  # starts worker processes
def test_scraped_counters_match_what_the_route_did(tiny_llama: Path) -> None:
    provider = LoopbackRouteProvider(
        tiny_llama,
        [(0, 2), (2, 4)],
        spares=[(2, 4)],
        options=OPTIONS,
        worker_args=["--metrics-port", "0"],
    )
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


# --- where and how the metrics are served (issue 28, item 4) ----------------------------------


def _get(url: str, context: ssl.SSLContext | None = None, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout, context=context) as response:  # noqa: S310
        return str(response.read().decode())


def _not_served(host: str, port: str) -> bool:
    """Whether the metrics are not served at ``host:port``: nothing listens there, or what
    does (another program of this machine may hold the same port number on that address) is
    no metrics endpoint of a dgr worker."""
    try:
        return "dgr_worker_info" not in _get(f"http://{host}:{port}/metrics", timeout=5.0)
    except (OSError, http.client.HTTPException):
        return True


@pytest.mark.slow  # starts worker processes
def test_metrics_bind_loopback_unless_told_otherwise_whatever_the_workers_host(
    tiny_llama: Path,
) -> None:
    # the worker serves on another loopback address (127.0.0.2): the metrics stay on 127.0.0.1
    args = ["--metrics-port", "0"]
    with WorkerProcess.spawn(
        tiny_llama, (0, 4), host="127.0.0.2", options=OPTIONS, extra_args=args
    ) as worker:
        assert worker.address.startswith("127.0.0.2:")
        (line,) = [s for s in worker.stdout_lines if s.startswith("METRICS ")]
        host, port = line.split(" ", 1)[1].rsplit(":", 1)
        assert host == "127.0.0.1"
        assert "dgr_worker_info" in _get(f"http://127.0.0.1:{port}/metrics")
        assert _not_served("127.0.0.2", port)  # not on the worker's own address
    # told otherwise: there
    with WorkerProcess.spawn(
        tiny_llama,
        (0, 4),
        host="127.0.0.1",
        options=OPTIONS,
        extra_args=[*args, "--metrics-host", "127.0.0.2"],
    ) as worker:
        (line,) = [s for s in worker.stdout_lines if s.startswith("METRICS ")]
        host, port = line.split(" ", 1)[1].rsplit(":", 1)
        assert host == "127.0.0.2"
        assert "dgr_worker_info" in _get(f"http://127.0.0.2:{port}/metrics")
        assert _not_served("127.0.0.1", port)


def test_metrics_over_tls_need_the_workers_ca_and_under_mutual_tls_a_client_certificate(
    tiny_llama: Path, tmp_path: Path
) -> None:
    ours, rogue = authority(tmp_path, "dgr"), authority(tmp_path, "rogue")
    served, client = ours.issue("worker"), ours.issue("client", client=True)
    stranger = rogue.issue("stranger", client=True)
    tls = ServerTls.from_files(served.cert, served.key, ours.cert)
    config = WorkerConfig(tls=tls, metrics_port=0, metrics_tls=True)
    worker = ShardWorker.load(tiny_llama, (0, 4), **OPTIONS.engine_kwargs(), config=config)

    def context(issued: Issued | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=ours.cert)
        if issued is not None:
            ctx.load_cert_chain(issued.cert, issued.key)
        return ctx

    async def scenario() -> None:
        await worker.start()
        try:
            url = f"https://{worker.metrics_address}/metrics"
            assert worker.metrics_address.startswith("127.0.0.1:")
            host, port = worker.metrics_address.rsplit(":", 1)
            # a client that connects and says nothing holds up no scrape (its handshake waits
            # in a thread of its own): the scrape is answered well within the handshake bound
            with socket.create_connection((host, int(port)), timeout=5):
                text = await asyncio.to_thread(_get, url, context(client), 5.0)
            families = {f.name for f in text_string_to_metric_families(text)}
            assert {"dgr_worker_info", "dgr_worker_sessions_open"} <= families
            for refused in (
                lambda: _get(url, context(None)),  # no client certificate
                lambda: _get(url, context(stranger)),  # one of a CA the worker does not trust
                lambda: _get(url.replace("https:", "http:")),  # plaintext
            ):
                with pytest.raises((OSError, http.client.HTTPException)):
                    await asyncio.to_thread(refused)
            # the worker itself serves on: an honest TLS client is answered
            async with ShardClient(
                worker.address,
                timeout=10.0,
                tls=ClientTls.from_files(ours.cert, client.cert, client.key),
            ) as shard:
                advert = await shard.describe()
            assert advert.security.tls and advert.security.client_certificates
            assert advert.health.total_errors == 0
        finally:
            await worker.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_tls_metrics_need_the_workers_tls() -> None:
    with pytest.raises(ValueError, match="metrics_tls needs the worker's TLS"):
        WorkerConfig(metrics_port=0, metrics_tls=True)
