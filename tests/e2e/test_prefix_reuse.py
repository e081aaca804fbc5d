"""Prompt prefixes kept across sessions (``docs/prefix-cache.md``) on SmolLM2 over two workers,
on every route mode and data path: a session whose prompt extends an earlier one's starts from
the earlier prompt's whole chunks on every stage, so the stages' own counters show those rows
never computed again, and its tokens are the whole model's (the chunks it computes are the ones
a fresh session computes). A stage that keeps nothing (``--prefix-cache-mb 0``) while the other
kept it: the other is opened again empty, and the tokens are still the whole model's."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dgr_engine.cli import _route
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_greedy
from dgr_engine.tokenizer import Tokenizer
from dgr_engine.tooling.processes import WorkerProcess
from tests.harness import RealLane

TEXT = "The history of the printing press begins in the fifteenth century. " * 12
CHUNK = EngineOptions().n_batch  # the route's prefill chunk: its stages' max_rows


def spawn(lane: RealLane, last_args: Sequence[str] = ()) -> list[WorkerProcess]:
    args = ["--lock", str(lane.lock), "--evidence", str(lane.evidence), "--metrics-port", "0"]
    started: list[WorkerProcess] = []
    try:
        started.append(WorkerProcess.spawn(lane.model, (0, 15), extra_args=args))
        started.append(WorkerProcess.spawn(lane.model, (15, 30), extra_args=[*args, *last_args]))
    except BaseException:
        for worker in started:
            worker.stop()
        raise
    return started


@pytest.fixture(scope="module")
def workers(smollm2_lane: RealLane) -> Iterator[list[WorkerProcess]]:
    started = spawn(smollm2_lane)
    try:
        yield started
    finally:
        for worker in started:
            worker.stop()


def counters(worker: WorkerProcess) -> dict[str, float]:
    (line,) = [x for x in worker.stdout_lines if x.startswith("METRICS ")]
    text = httpx.get(f"http://{line.split()[1]}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "dgr_worker_rows_total":
                out[f"rows_{sample.labels['kind']}"] = sample.value
            elif sample.name.startswith("dgr_worker_prefix_"):
                out[sample.name] = sample.value
    return out


def plan(lane: RealLane, workers: list[WorkerProcess], transport: str) -> _route.RoutePlan:
    parser = argparse.ArgumentParser()
    _route.add_route_arguments(parser)
    endpoints = ",".join(w.address for w in workers)
    args = parser.parse_args(
        ["--endpoints", endpoints, "--model", str(lane.model), "--lock", str(lane.lock)]
        + ["--transport", transport]
    )
    return _route.plan_route(_route.RouteSettings.from_args(args))


@pytest.mark.parametrize("transport", ["relay", "chain", "ring"])
def test_a_prompt_that_extends_a_kept_one_computes_only_the_rest(
    smollm2_lane: RealLane, workers: list[WorkerProcess], transport: str
) -> None:
    with Tokenizer(smollm2_lane.model) as tokenizer:
        first = list(tokenizer.encode(TEXT))
    assert len(first) >= 2 * CHUNK + 1

    async def conversation() -> tuple[tuple[int, ...], list[int], list[dict[str, float]]]:
        async with _route.open_route(plan(smollm2_lane, workers, transport)) as route:
            answer = await route.manager.generate(first, max_new_tokens=6)
            second = [*first, *answer[:-1], *first[:40]]
            before = [counters(w) for w in workers]
            tokens = await route.manager.generate(second, max_new_tokens=8)
            await route.manager.aclose()
            after = [counters(w) for w in workers]
        return tokens, second, [_diff(a, b) for a, b in zip(after, before, strict=True)]

    tokens, second, spent = asyncio.run(conversation())
    kept = len(first) // CHUNK * CHUNK
    for stage in spent:  # each stage: the kept chunks never computed again
        assert stage["dgr_worker_prefix_hits_total"] == 1, stage
        assert stage["dgr_worker_prefix_positions_reused_total"] == kept, stage
        rows = sum(v for k, v in stage.items() if k.startswith("rows_"))
        assert rows == len(second) - kept + 7, stage  # the rest of the prompt, 7 decode rows
        if transport != "ring":  # a native link's rows are counted as such, of every kind
            assert stage["rows_prefill"] == len(second) - kept, stage
    assert list(tokens) == whole_model_greedy(smollm2_lane.model, [second], 8, EngineOptions())[0]


def test_a_stage_that_kept_nothing_makes_the_others_start_empty(smollm2_lane: RealLane) -> None:
    with Tokenizer(smollm2_lane.model) as tokenizer:
        first = list(tokenizer.encode(TEXT))
    started = spawn(smollm2_lane, ["--prefix-cache-mb", "0"])
    try:

        async def conversation() -> tuple[tuple[int, ...], list[int]]:
            async with _route.open_route(plan(smollm2_lane, started, "ring")) as route:
                answer = await route.manager.generate(first, max_new_tokens=6)
                second = [*first, *answer[:-1], *first[:40]]
                tokens = await route.manager.generate(second, max_new_tokens=8)
                await route.manager.aclose()
            return tokens, second

        tokens, second = asyncio.run(conversation())
        kept, nothing = (counters(w) for w in started)
    finally:
        for worker in started:
            worker.stop()
    assert kept["dgr_worker_prefix_hits_total"] == 1  # it started from it, then was emptied
    assert nothing["dgr_worker_prefix_kept_total"] == 0
    assert nothing["dgr_worker_prefix_misses_total"] == 1
    assert kept["rows_native"] == nothing["rows_native"]  # both computed the whole prompt
    assert list(tokens) == whole_model_greedy(smollm2_lane.model, [second], 8, EngineOptions())[0]


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, Any]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
