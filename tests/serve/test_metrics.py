"""``GET /metrics`` of ``dgr serve`` (``dgr_engine.serve.metrics``, issue 50): the server's own
metrics in Prometheus' format, read back with ``prometheus_client``'s own parser after known
traffic over a real route: requests by path and status (401s and 400s included), tokens in
and out, the token-time histograms, sessions open, and the keys guarding it like the API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dgr_engine.serve.keys import ApiKeys
from dgr_engine.serve.metrics import ServeMetrics
from tests.serve.conftest import Served, start_served

KEY = "sk-metrics-0001"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fresh(converted_model: Path) -> Iterator[Served]:
    """A server of its own: the counts below are all this module's traffic."""
    yield from start_served(converted_model, keys=ApiKeys.of([KEY]))


def samples(served: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(served.url + "/metrics", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_the_metrics_count_what_the_server_answered(fresh: Served) -> None:
    url = fresh.url
    tokens = 0
    for stream in (False, True):  # two sessions of 5 tokens at most
        body = {"prompt": "the cat", "max_tokens": 5, "temperature": 0, "stream": stream}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as answer:
            assert answer.status_code == 200
            text = answer.read().decode()
        if not stream:
            tokens += int(json.loads(text)["usage"]["completion_tokens"])
    assert httpx.post(url + "/v1/completions", json={"n": 2}, headers=AUTH).status_code == 400
    assert httpx.get(url + "/v1/models").status_code == 401  # no key
    assert httpx.get(url + "/metrics").status_code == 401  # the metrics are the API's too
    assert fresh.settled() == {"stage-a": 0, "stage-b": 0}

    got = samples(fresh)

    def count(path: str, status: str) -> float:
        return got.get(("dgr_serve_requests_total", (("path", path), ("status", status))), 0.0)

    assert count("/v1/completions", "200") == 2
    assert count("/v1/completions", "400") == 1
    assert count("/v1/models", "401") == 1 and count("/metrics", "401") == 1
    prompt = got[("dgr_serve_prompt_tokens_total", ())]
    completion = got[("dgr_serve_completion_tokens_total", ())]
    assert prompt >= 2 * 2 and 0 < tokens <= completion <= 10
    first = got[("dgr_serve_time_to_first_token_seconds_count", ())]
    gaps = got[("dgr_serve_inter_token_seconds_count", ())]
    assert first == 2 and first + gaps == completion  # one time per accepted token
    assert got[("dgr_serve_time_to_first_token_seconds_sum", ())] > 0
    assert got[("dgr_serve_sessions_open", ())] == 0
    assert got[("dgr_serve_route_changes_total", ())] == 0


def test_a_session_clock_counts_its_tokens_and_its_route_changes() -> None:
    metrics = ServeMetrics(sessions_open=lambda: 3.0)
    clock = metrics.session(prompt_tokens=7)
    for _ in range(4):
        clock.token()
    clock.ended(completion_tokens=4, route_changes=2)
    text = metrics.render().decode()
    got = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }
    assert got["dgr_serve_prompt_tokens_total"] == 7
    assert got["dgr_serve_completion_tokens_total"] == 4
    assert got["dgr_serve_time_to_first_token_seconds_count"] == 1
    assert got["dgr_serve_inter_token_seconds_count"] == 3
    assert got["dgr_serve_route_changes_total"] == 2
    assert got["dgr_serve_sessions_open"] == 3
