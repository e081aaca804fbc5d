"""A 3,900-token prompt over ``dgr serve`` on SmolLM2, and the conversation's next turn: with
``--ctx 4608 --certify`` (one command: the lane at that context certified under a fresh
operator home) the long prompt is answered, and the next turn starts from its whole chunks on
every stage, as ``/metrics`` counts (``dgr_serve_prompt_tokens_reused_total``)."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve_latency import ServerProcess
from dgr_engine.cli._own_model import OPERATOR_HOME_ENV
from dgr_engine.options import EngineOptions
from tests.harness import SMOLLM2, RealLane

COLOURS = ("red", "green", "blue", "white")
TEXT = " ".join(f"Item {i} is a {COLOURS[i % 4]} box." for i in range(400))
CHUNK = EngineOptions().n_batch


def reused(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dgr_serve_prompt_tokens_reused_total":
                return sample.value
    raise AssertionError("no dgr_serve_prompt_tokens_reused_total")


def test_a_long_prompt_is_answered_and_the_next_turn_starts_from_it(
    smollm2_lane: RealLane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DGR_EVIDENCE_DIR", raising=False)
    monkeypatch.delenv("DGR_LOCK", raising=False)
    monkeypatch.setenv(OPERATOR_HOME_ENV, str(tmp_path / "operator"))
    options = EngineOptions(n_ctx_per_session=4608)
    server = ServerProcess.dgr(SMOLLM2, 2, options=options, extra=["--certify"])
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            messages = [{"role": "user", "content": f"{TEXT} How many items are there?"}]
            first = client.post(
                "/v1/chat/completions",
                json={"messages": messages, "max_tokens": 8, "temperature": 0},
            )
            assert first.status_code == 200, first.text
            prompt_tokens = first.json()["usage"]["prompt_tokens"]
            assert prompt_tokens > 3800
            assert reused(server) == 0
            answer = first.json()["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "Which colour is item 7?"},
            ]
            second = client.post(
                "/v1/chat/completions",
                json={"messages": messages, "max_tokens": 8, "temperature": 0},
            )
            assert second.status_code == 200, second.text
            assert reused(server) == prompt_tokens // CHUNK * CHUNK
    finally:
        server.stop()
