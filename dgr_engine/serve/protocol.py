"""The OpenAI request bodies ``dgr serve`` accepts (pydantic models: fields it does not know
are ignored, as OpenAI-compatible servers do; fields it knows are checked) and the response
objects it answers with (plain dicts built by functions: the wire shape stays out of the
classes).

Beyond OpenAI's fields a request may give ``top_k``, ``min_p``, ``repeat_penalty`` and
``penalty_last_n`` (as llama-server takes them); every sampling field goes to dgr's one sampler
(``docs/sampling.md``). Refused with 400: ``n`` other than 1, log-probabilities, tools, more
than one prompt, ``echo`` and ``suffix``, and a body with a string that is not Unicode text (a
lone UTF-16 surrogate, which JSON escapes can carry), named by its path.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dgr_engine.serve.errors import BadRequest

FinishReasonText = Literal["stop", "length"]
"""Why a choice ended: a stop token or stop string, or the token limit."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    """A last chunk, with no choices, carries the usage."""


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's text (text parts joined; anything else is refused)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise BadRequest(
                    f"content parts of type {part.type!r} are not supported (text only)",
                    param="messages",
                )
            texts.append(part.text)
        return "".join(texts)


def not_text(value: Any, where: str = "") -> tuple[str, str] | None:
    """Where ``value`` (a parsed JSON body) holds a string that is not Unicode text (a lone
    UTF-16 surrogate, which JSON's ``\\ud800`` escapes can carry and no tokenizer can encode),
    and why: ``(path, reason)``; ``None`` when every string, key or value, is text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            code = ord(value[exc.start])
            return where, f"not Unicode text (a lone surrogate U+{code:04X} at {exc.start})"
        return None
    items: list[tuple[Any, Any]] = []
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    for key, item in items:
        name = str(key).encode("utf-8", "backslashreplace").decode()  # a key may be the culprit
        inner = f"{where}.{name}" if where else name
        found = (not_text(key, inner) if isinstance(key, str) else None) or not_text(item, inner)
        if found:
            return found
    return None


UNICODE_ERROR = "unicode"
"""The validation error type of a body that is not text (:func:`not_text`); its context's
``param`` says where."""


class SamplingFields(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """A body whose strings are not all Unicode text is a 400 naming the first."""
        found = not_text(data)
        if found is not None:
            where, why = found
            raise PydanticCustomError(UNICODE_ERROR, "{param}: {why}", {"param": where, "why": why})
        return data

    model: str | None = None
    """Ignored beyond the answer's ``model`` (one route serves one model)."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, lt=1 << 31)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    penalty_last_n: int | None = Field(default=None, ge=0, lt=1 << 31)
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s for s in stops):
            raise ValueError("a stop string cannot be empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        """:class:`BadRequest` for what dgr does not offer."""
        if self.n is not None and self.n != 1:
            raise BadRequest("only n = 1 is supported", param="n")


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    tools: list[Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise BadRequest("logprobs are not supported", param="logprobs")
        if self.tools:
            raise BadRequest("tools are not supported", param="tools")

    def token_limit(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens`` (``None``: none given)."""
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens

    def conversation(self) -> list[tuple[str, str]]:
        """``(role, text)`` for the chat template (``developer`` is the system's role)."""
        return [("system" if m.role == "developer" else m.role, m.text()) for m in self.messages]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool | None = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise BadRequest("echo is not supported", param="echo")
        if self.suffix:
            raise BadRequest("suffix is not supported", param="suffix")
        if self.logprobs:
            raise BadRequest("logprobs are not supported", param="logprobs")
        if self.best_of is not None and self.best_of != 1:
            raise BadRequest("only best_of = 1 is supported", param="best_of")

    def token_limit(self) -> int | None:
        return self.max_tokens

    def single_prompt(self) -> str | list[int]:
        """The one prompt: text or token ids (:class:`BadRequest` for several or none)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if len(prompt) == 1 and isinstance(prompt[0], str | list):
            only = prompt[0]
            return only if isinstance(only, str) else list(only)
        if prompt and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]  # type: ignore[arg-type]
        if not prompt:
            raise BadRequest("the prompt is empty", param="prompt")
        raise BadRequest("only one prompt per request is supported", param="prompt")


# -- responses ------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_completion(
    rid: str, created: int, model: str, text: str, finish: str, usage_: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": usage_,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, str],
    finish: str | None = None,
    *,
    with_usage: bool = False,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if with_usage:
        chunk["usage"] = None  # OpenAI: null on every chunk but the last
    return chunk


def completion(
    rid: str, created: int, model: str, text: str, finish: str, usage_: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": usage_,
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str | None = None,
    *,
    with_usage: bool = False,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(
    rid: str, created: int, model: str, obj: str, usage_: dict[str, int]
) -> dict[str, Any]:
    """The last chunk of a stream that asked for usage: no choices."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_,
    }


def model_list(model: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "dgr"}],
    }
