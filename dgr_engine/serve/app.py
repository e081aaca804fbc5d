"""The ASGI app of ``dgr serve`` (FastAPI; server-sent events by sse-starlette):

* ``POST /v1/chat/completions`` and ``POST /v1/completions``: OpenAI's, streaming or not;
* ``GET /v1/models``: the one model; ``GET /v1/route``: the route's stages as the workers
  describe themselves now (:mod:`dgr_engine.serve.route_view`);
* ``GET /``: the page (``static/index.html``): the route, and a chat with the model;
* ``GET /metrics``: the server's own metrics, in Prometheus' format
  (:mod:`dgr_engine.serve.metrics`);
* ``GET /health``: 200 when every stage answers and is certified, else 503 saying which
  (for a load balancer: open, like the page).

With API keys (:mod:`dgr_engine.serve.keys`), a request to ``/v1`` or ``/metrics`` without one
of them is answered 401 before its body is read; the page stays open (it holds no data).

Every request is one route session of the served ``SessionManager``; concurrent requests are
concurrent sessions. The first event of a session decides the status: a session that fails
before its first token is answered with its error's status (400, 502, 503 with
``Retry-After``, 504), one that fails later ends its stream with an error event. A client that
goes away cancels its session (every stage is told to close it). Errors are OpenAI's shape
(:mod:`dgr_engine.serve.errors`), validation errors included (400, not 422).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from dgr_engine.serve import protocol as P
from dgr_engine.serve.errors import (
    BadRequest,
    NotFound,
    RouteUnhealthy,
    ServeError,
    Unauthorized,
)
from dgr_engine.serve.generation import Ended, Generation, Piece
from dgr_engine.serve.keys import ApiKeys
from dgr_engine.serve.metrics import CONTENT_TYPE, CountRequests
from dgr_engine.serve.route_view import health, route_json, stage_json
from dgr_engine.serve.served import ServedRoute, sampler_for

T = TypeVar("T")

_DISCONNECT_POLLS = 1_000_000
"""Bound on the messages read while waiting for a client to go away (a body is read before)."""


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


class _KeyGuard:
    """ASGI middleware: a request to the API without one of ``keys`` is answered 401 (OpenAI's
    shape) before anything of it is read."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path in ("/v1", "/metrics") or path.startswith("/v1/"):
            authorization = Headers(scope=scope).get("authorization")
            if not self.keys.allows(authorization):
                error = Unauthorized(
                    "no API key: this server takes one as 'Authorization: Bearer KEY'"
                    if authorization is None
                    else "the API key given is not one this server takes"
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(route: ServedRoute, keys: ApiKeys | None = None) -> FastAPI:
    """The app serving ``route`` (which the caller opened and closes); with ``keys``, its API
    takes only requests carrying one of them."""
    app = FastAPI(title="dgr serve", docs_url=None, redoc_url=None, openapi_url=None)
    if keys is not None:
        app.add_middleware(_KeyGuard, keys=keys)
    app.add_middleware(CountRequests, metrics=route.metrics)  # outermost: 401s counted too
    page = resources.files("dgr_engine.serve").joinpath("static/index.html").read_text()

    @app.exception_handler(ServeError)
    async def _serve_error(_request: Request, exc: ServeError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(ClientGone)
    async def _gone(_request: Request, _exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the session is already cancelled

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFound(f"no such path: {_request.url.path}"))
        error = ServeError(str(exc.detail), code=None)
        response = JSONResponse(error.body(), status_code=exc.status_code)
        response.headers.update(exc.headers or {})
        return response

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def healthy() -> dict[str, Any]:
        stages = await route.stages.stages()
        why = health(stages)
        if why is not None:
            raise RouteUnhealthy(why, stages=[stage_json(s) for s in stages])
        return {"status": "ok", "stages": len(stages)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(route.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return P.model_list(route.model, route.created)

    @app.get("/v1/route")
    async def route_view() -> dict[str, Any]:
        stages = await route.stages.stages()
        return route_json(
            model=route.model,
            context=route.context,
            live_sessions=len(route.manager),
            stages=stages,
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(
        body: P.ChatCompletionRequest, request: Request
    ) -> JSONResponse | EventSourceResponse:
        body.check_supported()
        prompt = route.chat_prompt(body.conversation())
        return await _answer(route, request, body, prompt, chat=True)

    @app.post("/v1/completions", response_model=None)
    async def complete(
        body: P.CompletionRequest, request: Request
    ) -> JSONResponse | EventSourceResponse:
        body.check_supported()
        prompt = route.text_prompt(body.single_prompt())
        return await _answer(route, request, body, prompt, chat=False)

    return app


def error_response(error: ServeError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def validation_error(exc: RequestValidationError) -> BadRequest:
    """A body that is not JSON or not the request's shape, as one 400 naming the field."""
    errors = exc.errors()
    if not errors:
        return BadRequest("invalid request body")
    first = errors[0]
    if first.get("type") == P.UNICODE_ERROR:  # a string no tokenizer can take, and where
        return BadRequest(str(first.get("msg")), param=str(first.get("ctx", {}).get("param")))
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    message = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        return BadRequest(f"the body is not valid JSON: {message}")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return BadRequest(f"{param or 'body'}: {message}{more}", param=param)


async def _answer(
    route: ServedRoute,
    request: Request,
    body: P.ChatCompletionRequest | P.CompletionRequest,
    prompt: list[int],
    *,
    chat: bool,
) -> JSONResponse | EventSourceResponse:
    limit = body.token_limit()
    given = bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)
    job = route.job(
        prompt,
        limit=limit,
        limit_given=given,
        sampler=sampler_for(body),
        stop=body.stop_strings(),
        param="messages" if chat else "prompt",
    )
    answer = _Answer(
        rid=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=route.model,
        chat=chat,
        prompt_tokens=len(prompt),
        include_usage=body.include_usage,
    )
    generation = route.start(job)
    try:
        if not body.streaming:
            text, ended = await _while_connected(request, generation.collect())
            if ended.error is not None:
                raise ended.error
            if ended.cancelled:
                raise ServeError("the session was cancelled: the server is stopping")
            return JSONResponse(answer.whole(text, ended))
        first = await _while_connected(request, generation.next())
    except BaseException:
        with anyio.CancelScope(shield=True):
            await generation.aclose()
        raise
    if isinstance(first, Ended) and first.error is not None:
        raise first.error
    return EventSourceResponse(answer.stream(generation, first), sep="\n", ping=15)


class _Answer:
    """The OpenAI objects of one request's answer."""

    def __init__(
        self,
        *,
        rid: str,
        created: int,
        model: str,
        chat: bool,
        prompt_tokens: int,
        include_usage: bool,
    ) -> None:
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage

    def whole(self, text: str, ended: Ended) -> dict[str, Any]:
        usage = P.usage(self.prompt_tokens, ended.completion_tokens)
        finish = ended.finish_reason or "stop"
        build = P.chat_completion if self.chat else P.completion
        return build(self.rid, self.created, self.model, text, finish, usage)

    def chunk(self, text: str | None, finish: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta = {} if text is None else {"content": text}
            return P.chat_chunk(
                self.rid, self.created, self.model, delta, finish, with_usage=self.include_usage
            )
        return P.completion_chunk(
            self.rid, self.created, self.model, text or "", finish, with_usage=self.include_usage
        )

    async def stream(
        self, generation: Generation, first: Piece | Ended
    ) -> AsyncIterator[dict[str, str]]:
        """The stream's events; the session is closed when it ends, also when the client goes
        away mid-stream (the response's task is cancelled then)."""
        try:
            if self.chat:
                role = P.chat_chunk(
                    self.rid,
                    self.created,
                    self.model,
                    {"role": "assistant", "content": ""},
                    with_usage=self.include_usage,
                )
                yield _data(role)
            event = first
            while isinstance(event, Piece):
                yield _data(self.chunk(event.text))
                event = await generation.next()
            if event.error is not None or event.cancelled:
                error = event.error or ServeError(
                    "the session was cancelled: the server is stopping"
                )
                yield _data(error.body())
            else:
                yield _data(self.chunk(None, event.finish_reason))
                if self.include_usage:
                    usage = P.usage(self.prompt_tokens, event.completion_tokens)
                    obj = "chat.completion.chunk" if self.chat else "text_completion"
                    yield _data(P.usage_chunk(self.rid, self.created, self.model, obj, usage))
            yield {"data": "[DONE]"}
        finally:
            with anyio.CancelScope(shield=True):
                await generation.aclose()


def _data(obj: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(obj, separators=(",", ":"))}


async def _while_connected(request: Request, awaitable: Awaitable[T]) -> T:
    """``awaitable``'s result, or :class:`ClientGone` when the client closes its connection
    first (the awaitable is cancelled then)."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            if not task.done():
                task.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    raise ClientGone(f"{request.url.path}: the client went away")


async def _disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    for _ in range(_DISCONNECT_POLLS):
        message = await receive()
        if message["type"] == "http.disconnect":
            return
