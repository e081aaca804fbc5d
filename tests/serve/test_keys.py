"""API keys of ``dgr serve`` (``dgr_engine.serve.keys``, issue 50): where keys come from, what
is refused before the server starts, and the API over a real route taking only requests that
carry one (OpenAI's 401 otherwise, before the body is read), the page staying open."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from dgr_engine.serve.keys import KEY_ENV, ApiKeyError, ApiKeys
from tests.serve.conftest import Served, start_served

KEYS = ("sk-first-0123", "sk-second-4567")


@pytest.fixture(scope="module")
def keyed(converted_model: Path) -> Iterator[Served]:
    yield from start_served(converted_model, keys=ApiKeys.of(KEYS))


def test_keys_come_from_the_options_the_files_and_the_environment(tmp_path: Path) -> None:
    listed = tmp_path / "keys"
    listed.write_text("# the team's keys\nsk-file-1\n\n  sk-file-2  \n")
    keys = ApiKeys.gathered(["sk-cli"], [listed], {KEY_ENV: "sk-env-1, sk-env-2,"})
    assert keys is not None and len(keys) == 5
    for key in ("sk-cli", "sk-file-1", "sk-file-2", "sk-env-1", "sk-env-2"):
        assert keys.allows(f"Bearer {key}") and keys.allows(f"bearer {key}"), key
    for wrong in (None, "", "Bearer", "Bearer ", "sk-cli", "Basic sk-cli", "Bearer sk-cl"):
        assert not keys.allows(wrong), wrong
    assert "# the team's keys" not in repr(keys) and "sk-cli" not in repr(keys)
    assert ApiKeys.gathered([], [], {}) is None  # none given: the API is open
    assert len(ApiKeys.of(["sk-a", "sk-a"]) or ()) == 1


def test_a_key_that_cannot_be_one_is_refused_without_showing_it(tmp_path: Path) -> None:
    for bad in ("", "two words", "tab\there", "caf\u00e9", "new\nline"):
        with pytest.raises(ApiKeyError) as refused:
            ApiKeys.of(["sk-good", bad])
        assert bad not in str(refused.value) or not bad, str(refused.value)
    with pytest.raises(ApiKeyError, match="cannot read the API key file"):
        ApiKeys.gathered([], [tmp_path / "no-such-file"], {})


def test_the_api_takes_only_requests_with_a_key(keyed: Served) -> None:
    request = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    for headers, words in (
        ({}, "no API key"),
        ({"authorization": "Bearer sk-wrong"}, "not one this server takes"),
    ):
        response = httpx.post(keyed.url + "/v1/completions", json=request, headers=headers)
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert words in error["message"]
        assert "sk-wrong" not in response.text
    # refused before the body is read: a body that is not even JSON is still a 401
    garbage = httpx.post(keyed.url + "/v1/chat/completions", content=b"{not json")
    assert garbage.status_code == 401
    for key in KEYS:  # every key is taken, by the official client as by hand
        client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0)
        answer = client.completions.create(model="m", **request)
        assert answer.choices[0].text is not None
        assert client.models.list().data[0].id == "hf-llama-gqa"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-nope", max_retries=0).models.list()
    page = httpx.get(keyed.url + "/")  # the page holds no data: open
    assert page.status_code == 200 and "<html" in page.text.lower()
