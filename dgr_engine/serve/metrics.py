"""``dgr serve``'s own Prometheus metrics (``GET /metrics``; the workers keep theirs): requests
by path and status, prompt and completion tokens, time to first token and between tokens,
sessions open, and route changes (a session moved to another route after a stage was lost).

A registry of its own per server (``prometheus_client``). Counted by an ASGI wrapper (the
status of every answer, refusals before the app included) and by each request's
:class:`~dgr_engine.serve.generation.Generation` (its tokens, as they are accepted). Names
start with ``dgr_serve_``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PATHS = frozenset(
    {
        "/",
        "/health",
        "/metrics",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/route",
    }
)
"""Paths counted by name; any other is counted as ``other`` (a bounded set of labels)."""

_FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""``/metrics``'s media type (Prometheus' text format)."""


class ServeMetrics:
    """Every metric of one server. ``sessions_open`` is read when scraped."""

    def __init__(self, *, sessions_open: Callable[[], float]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "dgr_serve_requests",
            "HTTP requests answered, by path and status",
            ["path", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "dgr_serve_prompt_tokens", "Prompt tokens of the sessions started", registry=r
        )
        self.reused_tokens = Counter(
            "dgr_serve_prompt_tokens_reused",
            "Prompt tokens the sessions started from, kept on the stages by earlier ones "
            "(docs/prefix-cache.md): computed by no stage again",
            registry=r,
        )
        self.completion_tokens = Counter(
            "dgr_serve_completion_tokens", "Tokens the sessions generated", registry=r
        )
        self.first_token = Histogram(
            "dgr_serve_time_to_first_token_seconds",
            "From a session's start to its first accepted token",
            buckets=_FIRST_TOKEN_BUCKETS,
            registry=r,
        )
        self.token_gap = Histogram(
            "dgr_serve_inter_token_seconds",
            "Between two accepted tokens of a session (0 for tokens a pass accepted together)",
            buckets=_TOKEN_GAP_BUCKETS,
            registry=r,
        )
        Gauge("dgr_serve_sessions_open", "Route sessions running", registry=r).set_function(
            sessions_open
        )
        self.route_changes = Counter(
            "dgr_serve_route_changes",
            "Times a session moved to another route (a stage lost, the route recovered)",
            registry=r,
        )

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)

    def session(self, prompt_tokens: int) -> TokenClock:
        """A clock for one session starting now with ``prompt_tokens``."""
        self.prompt_tokens.inc(prompt_tokens)
        return TokenClock(self)


class TokenClock:
    """One session's token times: the first token against its start, each later one against
    the one before."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self._metrics = metrics
        self._last = time.perf_counter()
        self._first = True

    def token(self) -> None:
        """A token was accepted now."""
        now = time.perf_counter()
        (self._metrics.first_token if self._first else self._metrics.token_gap).observe(
            now - self._last
        )
        self._first, self._last = False, now

    def ended(self, completion_tokens: int, route_changes: int, reused_tokens: int = 0) -> None:
        """The session ended with so many tokens, after so many route changes, having started
        from so many kept prompt tokens."""
        self._metrics.completion_tokens.inc(completion_tokens)
        self._metrics.route_changes.inc(route_changes)
        self._metrics.reused_tokens.inc(reused_tokens)


class CountRequests:
    """ASGI middleware: every HTTP answer counted by path and status (``metrics.requests``)."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in PATHS else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(label, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


__all__ = ["CONTENT_TYPE", "PATHS", "CountRequests", "ServeMetrics", "TokenClock"]
