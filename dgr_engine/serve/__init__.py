"""``dgr serve``: an OpenAI-compatible HTTP server over a route, and a page to chat with it.

* :class:`ServedRoute` (``served``): the route a server answers with (its ``SessionManager``,
  the tokenizer, a session's context, where its stages are read from);
* :func:`create_app` (``app``): the FastAPI app: ``/v1/chat/completions``,
  ``/v1/completions``, ``/v1/models``, ``/v1/route``, ``/health``, ``/metrics`` and the page at
  ``/``; API keys (``keys``) and the server's metrics (``metrics``);
* :func:`serve` (``server``): uvicorn on a socket bound first (:func:`listen`), stopped by
  SIGINT or SIGTERM;
* :class:`AdvertStages` and :class:`PoolStages` (``route_view``): the stages from the workers'
  adverts, at fixed endpoints or the server's own spawned workers;
* the errors (``errors``): one class per HTTP answer, OpenAI's error shape.

``docs/serve.md`` says how to run it and what each answer means.
"""

from dgr_engine.serve.app import create_app
from dgr_engine.serve.errors import (
    BadRequest,
    ContextLengthExceeded,
    NotFound,
    RouteFailed,
    RouteOverloaded,
    RouteUnhealthy,
    ServeError,
    SessionTimedOut,
    Unauthorized,
)
from dgr_engine.serve.route_view import AdvertStages, PoolStages, StageSource, StageStatus
from dgr_engine.serve.served import ServedRoute
from dgr_engine.serve.server import listen, serve, url_of

__all__ = [
    "AdvertStages",
    "PoolStages",
    "BadRequest",
    "ContextLengthExceeded",
    "NotFound",
    "RouteFailed",
    "RouteOverloaded",
    "RouteUnhealthy",
    "ServeError",
    "ServedRoute",
    "SessionTimedOut",
    "StageSource",
    "StageStatus",
    "Unauthorized",
    "create_app",
    "listen",
    "serve",
    "url_of",
]
