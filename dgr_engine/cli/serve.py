"""Serve a route over HTTP: an OpenAI-compatible API and a page to chat with the model.

The route is generate's (--spawn N workers of --model or --fixture, or --endpoints already
running; the same engine, trust and transport options). The server answers
POST /v1/chat/completions and POST /v1/completions (streaming with server-sent events or not;
temperature, top_p, top_k, seed, stop, max_tokens; n = 1), GET /v1/models, GET /v1/route (the
stages as their workers describe themselves) and, at /, a page showing the route with a chat
with the model. Each request is one session of the route: concurrent requests are concurrent
sessions, a client that goes away cancels its session, temperature 0 is the whole model's
greedy answer. Errors are OpenAI's shape: 400 for a bad request (context_length_exceeded for
a prompt the context cannot hold), 503 with Retry-After when every slot stayed busy for
--admission-wait seconds, 502 naming the stage when the route could not be recovered. With
--api-key (or --api-key-file, or DGR_API_KEY) the API takes only requests that carry a key
('Authorization: Bearer KEY', as OpenAI's clients send it), else 401.
Every request takes the fastest path the stages offer (--transport auto: a ring, its last stage
sampling each token with the request's own parameters) and prompt-lookup speculation
(--speculate ngram, the default; --speculate off, draft:PATH or mtp as for generate): the same
text in fewer passes wherever the timed draft length says drafts pay.

    dgr serve --model smollm2-135m-instruct --spawn 3 --port 8000

Prints one line with the URL once it listens (--port 0: any free port); SIGINT or SIGTERM
stops it and its workers. See docs/serve.md.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import socket
import sys
from pathlib import Path

import attrs

from dgr_engine.argtypes import float_in, int_in
from dgr_engine.cli._progress import sayer
from dgr_engine.cli._route import (
    RouteHandle,
    RouteOptionsRefused,
    RoutePlan,
    RouteSettings,
    RouteStartFailed,
    add_route_arguments,
    open_route,
    plan_route,
)
from dgr_engine.cli._signals import sigterm_as_interrupt
from dgr_engine.cli._speculate import (
    SpeculateSource,
    SpeculationPlan,
    SpeculationSettings,
    add_speculation_arguments,
    plan_speculation,
)
from dgr_engine.security.tls import is_loopback
from dgr_engine.serve import (
    AdvertStages,
    PoolStages,
    ServedRoute,
    create_app,
    listen,
    serve,
    url_of,
)
from dgr_engine.serve.keys import KEY_ENV, ApiKeyError, ApiKeys
from dgr_session import FailurePolicy

DEFAULT_PORT = 8000
"""``--port``'s default."""


@attrs.frozen
class ServeSettings:
    """``dgr serve``'s command line, read once at its edge (:meth:`from_args`)."""

    route: RouteSettings
    """Where the route runs and how."""
    host: str
    """``--host``: the address to listen on."""
    port: int
    """``--port``: the port to listen on (0: any free one)."""
    name: str | None
    """``--name``: the model's name in answers (``None``: :attr:`model_name`'s default)."""
    admission_wait: float
    """``--admission-wait``: seconds a request may wait for a free session slot."""
    speculation: SpeculationSettings
    """``--speculate`` (default ``ngram``) and ``--draft-max``."""
    api_keys: ApiKeys | None = None
    """``--api-key``, ``--api-key-file`` and ``DGR_API_KEY``: the keys the API takes
    (``None``: open to anyone who reaches it)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        """The settings :func:`configure` parsed; :class:`RouteOptionsRefused` for engine
        options out of range, :class:`ApiKeyError` for a key or key file that cannot be."""
        return cls(
            route=RouteSettings.from_args(args),
            host=args.host,
            port=args.port,
            name=args.name,
            admission_wait=args.admission_wait,
            speculation=SpeculationSettings.from_args(args),
            api_keys=ApiKeys.gathered(args.api_key, args.api_key_file),
        )

    @property
    def model_name(self) -> str:
        """The model's name in answers and /v1/models: ``--name``, else ``--model`` or
        ``--fixture`` as given (a file's name without .gguf), else ``dgr``."""
        if self.name:
            return self.name
        given = self.route.model if self.route.model is not None else self.route.fixture
        if given is None:
            return "dgr"
        name = given.rsplit("/", 1)[-1]
        return name[: -len(".gguf")] if name.endswith(".gguf") else name


def configure(p: argparse.ArgumentParser) -> None:
    add_route_arguments(p)
    add_speculation_arguments(p, default=SpeculateSource("ngram"))
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int_in(0, 65535),
        default=DEFAULT_PORT,
        help=f"port to listen on (default {DEFAULT_PORT}; 0: any free port)",
    )
    p.add_argument(
        "--name",
        default=None,
        help="the model's name in answers and /v1/models (default: --model or --fixture as "
        "given, a file's name without .gguf)",
    )
    p.add_argument(
        "--admission-wait",
        type=float_in(0.001, 3600.0),
        default=30.0,
        metavar="SECONDS",
        help="how long a request may wait for a free session slot on every stage before it is "
        "answered 503 with Retry-After (default 30)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key the API takes as 'Authorization: Bearer KEY' (repeat for several; also "
        f"--api-key-file and {KEY_ENV}, comma-separated); without any, the API is open to "
        "anyone who reaches the address",
    )
    p.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a file of keys the API takes, one a line (blank lines and # comments skipped)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        settings = ServeSettings.from_args(args)
        speculate = plan_speculation(settings.speculation, notice=sayer("dgr serve: "))
        plan = plan_route(settings.route, notice=sayer("dgr serve: "))
    except (RouteOptionsRefused, ApiKeyError) as exc:
        return _refused(str(exc))
    if speculate is not None:
        try:
            speculate.check_vocab(plan.vocab)
            speculate.check_model(plan.model)
        except RouteOptionsRefused as exc:
            plan.close()
            return _refused(str(exc))
    if plan.tokenizer is None:
        plan.close()
        return _refused(
            "the model has no tokenizer (like the generated fixtures): dgr serve answers text; "
            "give a model with one (--model, or --vocab GGUF with --endpoints)"
        )
    try:
        sock = listen(settings.host, settings.port)
    except OSError as exc:
        plan.close()
        return _refused(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}")
    try:
        with sigterm_as_interrupt():
            asyncio.run(_serve(settings, plan, speculate, sock))
    except KeyboardInterrupt:  # before the server was up (starting the workers)
        print("dgr serve: interrupted", file=sys.stderr)
        return 130
    except RouteStartFailed as exc:
        return _refused(str(exc))
    finally:
        sock.close()
    print("dgr serve: stopped", file=sys.stderr)
    return 0


async def _serve(
    settings: ServeSettings,
    plan: RoutePlan,
    speculate: SpeculationPlan | None,
    sock: socket.socket,
) -> None:
    async with open_route(plan, notice=sayer("dgr serve: ")) as handle:
        assert handle.tokenizer is not None
        drafter = None if speculate is None else speculate.open(handle, plan.options)
        try:
            served = ServedRoute(
                handle.manager,
                handle.tokenizer,
                model=settings.model_name,
                context=handle.context,
                stages=PoolStages(handle.pool)  # the workers it spawned, replacements too
                if handle.pool is not None
                else AdvertStages([(s.endpoint, s.layers) for s in handle.stages], tls=plan.tls),
                policy=FailurePolicy(
                    step_deadline=plan.step_deadline, admission_budget=settings.admission_wait
                ),
                # one drafter serves every request, each with a speculation of its own
                speculations=None
                if speculate is None or drafter is None
                else functools.partial(speculate.session, drafter),
            )
            url = url_of(sock)
            print(
                f"dgr serve: {url}  (model {served.model}, {len(handle.stages)} stage(s), "
                f"context {served.context}; the page at {url}/, the API at {url}/v1)",
                flush=True,
            )
            keys = settings.api_keys
            if keys is None and not is_loopback(settings.host):
                print(
                    f"dgr serve: no --api-key: anyone who reaches {settings.host} can use the API",
                    file=sys.stderr,
                    flush=True,
                )
            app = create_app(served, keys)
            await serve(app, sock, on_stop=lambda: _cancel_all(handle))
        finally:
            if drafter is not None:
                drafter.close()


def _cancel_all(handle: RouteHandle) -> None:
    """The server is stopping: every running session ends (its stream says so)."""
    for session in handle.manager.sessions:
        session.cancel("the server is stopping")


def _refused(text: str) -> int:
    print(f"dgr serve: {text}", file=sys.stderr)
    return 2
