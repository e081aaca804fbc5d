"""``dgr serve --model smollm2-135m-instruct --spawn 3 --port 0`` as a user runs it, called with
the official ``openai`` client: chat completions streaming and not, equal to the whole model's
greedy answer; completions; the models list; 400s; two requests at once; a stream cancelled
mid-way closes every stage's session; stopped, it leaves no worker behind."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

from benchmarks.serve_latency import ServerProcess
from dgr_engine.client.text import prompt_ids, until_stop
from dgr_engine.options import EngineOptions
from dgr_engine.reference import whole_model_greedy
from dgr_engine.tokenizer import Tokenizer
from tests.harness import SMOLLM2, RealLane

QUESTION = "What is the capital of France?"
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"


OPTIONS = EngineOptions()
"""The lane's engine options: ``dgr certify``'s (the one set of defaults)."""


@pytest.fixture(scope="module")
def lane(smollm2_lane: RealLane) -> RealLane:
    return smollm2_lane


@pytest.fixture(scope="module")
def server(lane: RealLane) -> Iterator[ServerProcess]:
    started = ServerProcess.dgr(SMOLLM2, 3, options=OPTIONS, extra=lane.serve_args())
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def whole_answer(lane: RealLane) -> str:
    """The whole model's greedy chat answer, run in-process, cut at end of turn."""
    with Tokenizer(lane.model) as tokenizer:
        prompt = prompt_ids(tokenizer, QUESTION, chat=True)
        tokens = whole_model_greedy(lane.model, [prompt], 40, OPTIONS)[0]
        stops = tokenizer.eog_tokens
        return tokenizer.decode([t for t in until_stop(tokens, stops) if t not in stops])


def route(server: ServerProcess) -> dict[str, object]:
    return dict(httpx.get(server.url + "/v1/route", timeout=30).json())


def open_sessions(server: ServerProcess) -> list[int]:
    return [s["sessions"]["open"] for s in route(server)["stages"]]  # type: ignore[index,union-attr]


def wait_until_closed(server: ServerProcess, limit: float = 30.0) -> list[int]:
    """Reads the stages' adverts until none holds a session or ``limit`` s pass."""
    end = time.monotonic() + limit
    while True:
        counts = open_sessions(server)
        if not any(counts) or time.monotonic() >= end:
            return counts
        time.sleep(0.1)


def test_a_greedy_chat_answer_is_the_whole_models(client: openai.OpenAI, whole_answer: str) -> None:
    answer = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": QUESTION}], temperature=0
    )
    assert whole_answer == "The capital of France is Paris."
    assert answer.choices[0].message.content == whole_answer
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None and answer.usage.completion_tokens == 8  # with end of turn
    assert answer.model == SMOLLM2


def test_a_streamed_chat_answer_is_the_same_text(client: openai.OpenAI, whole_answer: str) -> None:
    stream = client.chat.completions.create(
        model=SMOLLM2,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == whole_answer and len([p for p in pieces if p]) > 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_the_completions_endpoint_continues_text(client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model=SMOLLM2, prompt="The capital of France is", temperature=0, max_tokens=5
    )
    assert answer.choices[0].text.strip().startswith("Paris"), answer.choices[0].text
    assert answer.usage is not None and answer.usage.completion_tokens == 5
    assert answer.choices[0].finish_reason == "length"


def test_models_lists_smollm2(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [SMOLLM2]


def test_n_two_and_a_bad_body_are_400s(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=SMOLLM2, messages=[{"role": "user", "content": QUESTION}], n=2
        )
    assert caught.value.param == "n"
    bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": "hi"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_two_requests_at_once_are_two_sessions(client: openai.OpenAI, whole_answer: str) -> None:
    def ask(_: int) -> str:
        answer = client.chat.completions.create(
            model=SMOLLM2, messages=[{"role": "user", "content": QUESTION}], temperature=0
        )
        return answer.choices[0].message.content or ""

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(ask, range(2))) == [whole_answer] * 2


def test_a_stream_cancelled_mid_way_closes_every_stages_session(server: ServerProcess) -> None:
    # counting goes on to the token limit (200 tokens: a few seconds on three stages)
    body = {"prompt": COUNTING, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: a generator let go closes the response
        texts = 0
        for _ in range(50):
            line = next(lines)
            if line.startswith("data:") and json.loads(line[5:])["choices"][0]["text"]:
                texts += 1
                if texts == 3:
                    break
        assert texts == 3
        assert open_sessions(server) == [1, 1, 1]  # the session is open on every stage
    # the client went away: its session is cancelled and every stage is told to close it
    assert wait_until_closed(server) == [0, 0, 0]
    stages = route(server)["stages"]
    assert [s["layers"] for s in stages] == [[0, 10], [10, 20], [20, 30]]  # type: ignore[index]


def test_stopping_the_server_leaves_no_worker(lane: RealLane) -> None:
    server = ServerProcess.dgr(SMOLLM2, 2, options=OPTIONS, extra=lane.serve_args())
    workers = [int(s["endpoint"].rsplit(":", 1)[1]) for s in route(server)["stages"]]  # type: ignore[index]
    pids = _listening_pids(workers)
    assert len(pids) == 2 and server.proc.pid not in pids
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    assert "dgr serve: stopped" in server.log.read_text()
    assert [pid for pid in pids if _alive(pid)] == []
    server.stop()  # nothing left of it: its log removed too
    assert not server.log.exists()


def _listening_pids(ports: list[int]) -> list[int]:
    """The processes listening on ``ports`` on this machine (read from /proc)."""
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                port = int(fields[1].rsplit(":", 1)[1], 16)
                if port in ports and fields[3] == "0A":  # LISTEN
                    inodes[fields[9]] = port
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                pids.add(int(pid))
    return sorted(pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for good
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _health_until(server: ServerProcess, status: int, limit: float) -> httpx.Response:
    """``GET /health`` until it answers ``status`` (the last answer after ``limit`` s)."""
    end = time.monotonic() + limit
    while True:
        answer = httpx.get(server.url + "/health", timeout=30)
        if answer.status_code == status or time.monotonic() >= end:
            return answer
        time.sleep(0.2)


def test_health_is_503_while_a_stage_is_down_and_200_once_it_is_replaced(lane: RealLane) -> None:
    """A load balancer's view: a worker killed, the health check says which stage is down
    (and starts its replacement, as a session meeting the dead worker would), then 200 once
    the replacement serves, and the route answers again."""
    server = ServerProcess.dgr(SMOLLM2, 2, options=OPTIONS, extra=lane.serve_args())
    try:
        ok = httpx.get(server.url + "/health", timeout=30)
        assert ok.status_code == 200 and ok.json() == {"status": "ok", "stages": 2}
        before = route(server)["stages"][1]["endpoint"]  # type: ignore[index]
        (pid,) = _listening_pids([int(before.rsplit(":", 1)[1])])
        os.kill(pid, signal.SIGKILL)
        down = _health_until(server, 503, 30)
        assert down.status_code == 503, down.text
        error = down.json()["error"]
        assert error["code"] == "route_unhealthy" and error["message"].startswith("stage 1 ")
        assert [s["serving"] for s in down.json()["stages"]] == [True, False]
        up = _health_until(server, 200, 120)
        assert up.status_code == 200, up.text
        after = route(server)["stages"][1]["endpoint"]  # type: ignore[index]
        assert after != before  # a replacement, on a port of its own
        answer = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
    finally:
        server.stop()
