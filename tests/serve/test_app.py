"""The OpenAI API of ``dgr serve`` over a real route of in-process engines, called with the
official ``openai`` client: answers equal to the whole model's for greedy requests, streaming
and not, usage, stop strings, limits, the errors' shape and status, concurrent sessions, and a
stream cancelled by its client closing every stage's session."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import httpx2 as httpx
import openai
import pytest

from dgr_engine.client.text import until_stop
from dgr_engine.reference import whole_model_greedy
from dgr_engine.serve import StageStatus
from dgr_engine.serve.route_view import health
from dgr_engine.tokenizer import Tokenizer
from dgr_session import FailurePolicy
from tests.serve.conftest import OPTIONS, Served, start_served

QUESTION = "hello world, the cat"


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(served: Served) -> Tokenizer:
    with Tokenizer(served.model) as t:
        yield t


def whole_model_text(model: Path, tokenizer: Tokenizer, prompt: list[int], n: int) -> str:
    """The whole model's greedy answer, cut at its first end-of-generation token."""
    tokens = until_stop(whole_model_greedy(model, [prompt], n, OPTIONS)[0], tokenizer.eog_tokens)
    return tokenizer.decode([t for t in tokens if t not in tokenizer.eog_tokens])


def chat_prompt(tokenizer: Tokenizer, question: str) -> list[int]:
    text = tokenizer.chat([("user", question)])
    return tokenizer.encode(text, parse_special=True)


def test_a_greedy_chat_completion_is_the_whole_models_answer(
    served: Served, client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    answer = client.chat.completions.create(
        model="hf-llama-gqa",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=12,
    )
    prompt = chat_prompt(tokenizer, QUESTION)
    assert answer.choices[0].message.content == whole_model_text(
        served.model, tokenizer, prompt, 12
    )
    assert answer.choices[0].message.role == "assistant"
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.total_tokens == len(prompt) + answer.usage.completion_tokens
    assert answer.choices[0].finish_reason in ("stop", "length")
    if answer.choices[0].finish_reason == "length":
        assert answer.usage.completion_tokens == 12
    assert served.settled() == {"stage-a": 0, "stage-b": 0}


def test_a_streamed_chat_completion_is_the_same_text_chunk_by_chunk(
    served: Served, client: openai.OpenAI
) -> None:
    request = {
        "model": "hf-llama-gqa",
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 12,
    }
    whole = client.chat.completions.create(**request)
    chunks = list(
        client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # the usage chunk
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_a_completion_takes_text_or_token_ids(
    served: Served, client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    prompt = tokenizer.encode(QUESTION)
    want = whole_model_text(served.model, tokenizer, prompt, 10)
    by_text = client.completions.create(
        model="hf-llama-gqa", prompt=QUESTION, temperature=0, max_tokens=10
    )
    by_ids = client.completions.create(
        model="hf-llama-gqa", prompt=prompt, temperature=0, max_tokens=10
    )
    assert by_text.choices[0].text == by_ids.choices[0].text == want
    assert by_text.object == "text_completion" and by_text.usage is not None
    assert by_text.usage.prompt_tokens == len(prompt)
    streamed = client.completions.create(
        model="hf-llama-gqa", prompt=QUESTION, temperature=0, max_tokens=10, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == want


def test_the_default_completion_limit_is_sixteen_tokens(client: openai.OpenAI) -> None:
    answer = client.completions.create(model="m", prompt=QUESTION, temperature=0, stop=None)
    assert answer.usage is not None and answer.usage.completion_tokens <= 16


def test_a_stop_string_ends_the_text_before_it(
    served: Served, client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    full = client.completions.create(model="m", prompt=QUESTION, temperature=0, max_tokens=24)
    text = full.choices[0].text
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = client.completions.create(
        model="m", prompt=QUESTION, temperature=0, max_tokens=24, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="m", prompt=QUESTION, temperature=0, max_tokens=24, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]
    assert served.settled() == {"stage-a": 0, "stage-b": 0}  # the cut session was closed


def test_a_seeded_request_gives_the_same_text_again(client: openai.OpenAI) -> None:
    kw = {"model": "m", "prompt": QUESTION, "max_tokens": 12, "temperature": 1.5, "seed": 7}
    first = client.completions.create(**kw, top_p=0.9, extra_body={"top_k": 40})
    again = client.completions.create(**kw, top_p=0.9, extra_body={"top_k": 40})
    other = client.completions.create(**{**kw, "seed": 8}, top_p=0.9, extra_body={"top_k": 40})
    greedy = client.completions.create(**{**kw, "temperature": 0})
    assert first.choices[0].text == again.choices[0].text
    # another seed, or none at all, gives other text (at 1.5 on random weights: almost surely)
    assert greedy.choices[0].text not in (first.choices[0].text, other.choices[0].text)
    assert other.choices[0].text != first.choices[0].text


def test_models_lists_the_one_model(client: openai.OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == "hf-llama-gqa" and model.owned_by == "dgr"


def test_the_route_json_shows_every_stage(served: Served) -> None:
    route = httpx.get(served.url + "/v1/route", timeout=10).json()
    assert route["model"] == "hf-llama-gqa" and route["context"] == OPTIONS.n_ctx_per_session
    assert [(s["endpoint"], s["layers"]) for s in route["stages"]] == [
        ("stage-a", [0, 2]),
        ("stage-b", [2, 3]),
    ]
    assert all(s["serving"] and s["lane"]["evidence"] == "fixture" for s in route["stages"])


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"n": 2}, "n", "n = 1"),
        ({"temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"messages": []}, "messages", "at least 1"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": 1000}, "max_tokens", "holds 128"),
    ],
)
def test_a_bad_request_is_a_400_in_openais_shape(
    served: Served, body: dict[str, object], param: str, words: str
) -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    response = httpx.post(served.url + "/v1/chat/completions", json=request, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error["message"]


def test_the_openai_client_raises_its_bad_request_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=2)
    assert caught.value.status_code == 400 and caught.value.param == "n"


def test_a_body_that_is_not_json_is_a_400(served: Served) -> None:
    response = httpx.post(
        served.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "a\\ud800"}]}',
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
            "messages.0.content.0.text",
        ),
        ("/v1/completions", '{"prompt": "x", "stop": ["\\ud83d"]}', "stop.0"),
        ("/v1/completions", '{"prompt": "ok", "user": "\\udc00"}', "user"),
        (
            "/v1/completions",
            '{"prompt": "ok", "\\ud800": 1}',
            r"\ud800",
        ),  # the path spells the key out
    ],
)
def test_a_lone_surrogate_anywhere_in_a_body_is_a_400_naming_it(
    served: Served, path: str, body: str, param: str
) -> None:
    """JSON's escapes can carry a lone UTF-16 surrogate, which is no text a tokenizer takes:
    a 400 in OpenAI's shape saying where, never a 500; and the server serves on."""
    response = httpx.post(
        served.url + path, content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "not Unicode text (a lone surrogate U+" in error["message"], error
    fine = httpx.post(served.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert fine.status_code == 200, fine.text


def test_a_prompt_over_the_context_is_context_length_exceeded(served: Served) -> None:
    long = " ".join(["cat"] * 400)
    response = httpx.post(
        served.url + "/v1/completions", json={"prompt": long, "max_tokens": 4}, timeout=30
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"


def test_an_unknown_path_is_a_404_in_openais_shape(served: Served) -> None:
    response = httpx.get(served.url + "/v1/nothing", timeout=10)
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_concurrent_requests_are_concurrent_sessions(served: Served, client: openai.OpenAI) -> None:
    def ask(question: str) -> str:
        answer = client.completions.create(model="m", prompt=question, temperature=0, max_tokens=8)
        return answer.choices[0].text or ""

    questions = [QUESTION, "the cat", QUESTION, "the cat"]
    alone = [ask(q) for q in questions[:2]]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, questions))
    assert together == alone * 2
    assert served.settled() == {"stage-a": 0, "stage-b": 0}


def test_a_stream_cancelled_by_its_client_closes_every_stages_session(served: Served) -> None:
    body = {"prompt": QUESTION, "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["choices"][0]["text"] is not None
        # the sessions are open on both stages while the stream runs
        assert served.open_sessions() == {"stage-a": 1, "stage-b": 1}
    # the client went away mid-stream: the session is cancelled, its stages closed
    assert served.settled() == {"stage-a": 0, "stage-b": 0}


@pytest.fixture()
def impatient(converted_model: Path) -> Iterator[Served]:
    """A server whose sessions wait at most half a second for a free slot."""
    yield from start_served(converted_model, FailurePolicy(admission_budget=0.5, busy_retry=0.1))


def test_a_route_with_no_free_slot_is_a_503_with_retry_after(impatient: Served) -> None:
    async def fill(open_: bool) -> None:
        engine = impatient.transport.engines()["stage-a"]
        for sid in (900, 901):  # every slot of the first stage taken by other sessions
            (engine.open_session if open_ else engine.close_session)(sid, 0)

    impatient.call(fill(True))
    try:
        response = httpx.post(
            impatient.url + "/v1/completions", json={"prompt": QUESTION}, timeout=30
        )
    finally:
        impatient.call(fill(False))
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"  # no hint from the engine: busy_retry, up
    error = response.json()["error"]
    assert error["type"] == "overloaded_error" and error["code"] == "route_busy"
    assert "stage 0 (stage-a) still busy" in error["message"]
    answer = httpx.post(impatient.url + "/v1/completions", json={"prompt": QUESTION}, timeout=30)
    assert answer.status_code == 200  # slots free again: served


def test_the_page_is_served_whole_from_the_package(served: Served) -> None:
    page = httpx.get(served.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "<title>dgr serve</title>" in html and 'id="stages"' in html
    # self-contained: nothing is fetched from elsewhere (the machine may have no internet)
    assert "src=" not in html and "<link" not in html and "@import" not in html
    assert "/v1/route" in html and "/v1/chat/completions" in html


def test_health_is_200_while_every_stage_answers_and_is_certified(served: Served) -> None:
    answer = httpx.get(served.url + "/health", timeout=30)
    assert answer.status_code == 200 and answer.json() == {"status": "ok", "stages": 2}


def test_the_health_verdict_names_the_first_stage_down_or_dark() -> None:
    up = StageStatus(0, "a:1", (0, 2), serving=True, certification="certified")
    dark = StageStatus(1, "b:2", (2, 4), serving=True, certification="dark")
    down = StageStatus.unreachable(1, "b:2", (2, 4), "connection refused")
    assert health([up, attrs.evolve(up, index=1, endpoint="b:2", layers=(2, 4))]) is None
    assert health([up, dark]) == "stage 1 (b:2, layers [2, 4]) is not certified (its lane is dark)"
    assert health([up, down]) == "stage 1 (b:2, layers [2, 4]) is not serving: connection refused"
