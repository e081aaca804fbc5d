"""``dgr serve``: an OpenAI-compatible HTTP server over a route, and a page to chat with it.

* :class:`ServedRoute` (``served``): the route a server answers with (its ``SessionManager``,
  the tokenizer, a session's context, where its stages are read from);
* :func:`create_app` (``app``): the FastAPI app: ``/v1/chat/completions``,
  ``/v1/completions``, ``/v1/models``, ``/v1/route`` and the page at ``/``;
* :func:`serve` (``server``): uvicorn on a socket bound first (:func:`listen`), stopped by
  SIGINT or SIGTERM;
* :class:`AdvertStages` (``route_view``): the stages from the workers' adverts;
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
    ServeError,
    SessionTimedOut,
)
from dgr_engine.serve.route_view import AdvertStages, StageSource, StageStatus
from dgr_engine.serve.served import ServedRoute
from dgr_engine.serve.server import listen, serve, url_of

__all__ = [
    "AdvertStages",
    "BadRequest",
    "ContextLengthExceeded",
    "NotFound",
    "RouteFailed",
    "RouteOverloaded",
    "ServeError",
    "ServedRoute",
    "SessionTimedOut",
    "StageSource",
    "StageStatus",
    "create_app",
    "listen",
    "serve",
    "url_of",
]
