"""dgr data plane: the shard engine (cffi over the patched llama.cpp), its clients and workers.

What to import, by role (``docs/api.md`` says the same, per name; a test keeps the two equal):

* a **tracker author** (routing, adverts, billing): the route session, its failure reports and
  fault kinds from ``dgr_session``; from here the transports and the shard client, the advert
  and its parts, TLS and route grants, the certification check, and the shard errors;
* a **test author**: from here the engine in-process, fixtures and real models, the whole-model
  reference run, and the single-machine harness (worker processes, loopback routes, a
  throwaway CA); the test doubles from ``dgr_engine.testing`` and ``dgr_session.testing``;
* an **operator**: the ``dgr`` command (``dgr worker``, ``dgr certify``, ...), not Python.

Also public: ``dgr_engine.errors`` (every refusal by name) and ``dgr_engine.testing``. The
other modules are the implementation, importable with no promise that a name stays where it
is; the rooms they live in, and who may import whom, are in ``docs/rooms.md``.

``import dgr_engine`` imports no other module of dgr: each public name is imported on first
use (module ``__getattr__``), so a worker process pays for gRPC, the web server or the compiled
binding only where it uses them, and fixture generation and other pure-Python parts import
without a native build.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from loguru import logger

logger.disable("dgr_engine")

if TYPE_CHECKING:  # the same names as the tables below (a test keeps them equal)
    from dgr_engine.certification.verify import LockVerifier
    from dgr_engine.client.chained import ChainStageTransport
    from dgr_engine.client.relay import GrpcStageTransport
    from dgr_engine.client.routes import EndpointRouteProvider, describe
    from dgr_engine.client.shard_client import ShardClient
    from dgr_engine.client.text import prompt_ids
    from dgr_engine.engine import EngineStats, ShardEngine, ShardInfo
    from dgr_engine.errors import (
        ClientCallError,
        EngineError,
        ShardDeadlineExceeded,
        ShardError,
        ShardRpcError,
        ShardTransportError,
        ShardUnavailable,
    )
    from dgr_engine.fixtures import ensure_fixture
    from dgr_engine.models import resolve_model
    from dgr_engine.options import EngineOptions
    from dgr_engine.reference import (
        InProcessRoute,
        n_layer_of,
        whole_model_greedy,
        whole_model_reference,
    )
    from dgr_engine.security.grants import GrantIssuer
    from dgr_engine.security.tls import ClientTls
    from dgr_engine.tokenizer import Tokenizer
    from dgr_engine.tooling.loopback import LoopbackRouteProvider
    from dgr_engine.tooling.processes import WorkerProcess, dgr_command
    from dgr_engine.tooling.throwaway_ca import local_pki
    from dgr_engine.wire.advert import (
        Advert,
        Capacity,
        DataPaths,
        Health,
        LayerSpan,
        Load,
        SeamCost,
        Security,
    )

_FOR_TRACKERS: dict[str, str] = {
    # reaching workers: the transports a SessionManager runs over, one worker's client
    "ChainStageTransport": "dgr_engine.client.chained",
    "EndpointRouteProvider": "dgr_engine.client.routes",
    "GrpcStageTransport": "dgr_engine.client.relay",
    "ShardClient": "dgr_engine.client.shard_client",
    "describe": "dgr_engine.client.routes",
    # what a worker advertises: compatibility, capacity, load, seam, health, security, paths
    "Advert": "dgr_engine.wire.advert",
    "Capacity": "dgr_engine.wire.advert",
    "DataPaths": "dgr_engine.wire.advert",
    "Health": "dgr_engine.wire.advert",
    "LayerSpan": "dgr_engine.wire.advert",
    "Load": "dgr_engine.wire.advert",
    "SeamCost": "dgr_engine.wire.advert",
    "Security": "dgr_engine.wire.advert",
    # trust: the channel, the tracker's route grants, certification against the tracker's lock
    "ClientTls": "dgr_engine.security.tls",
    "GrantIssuer": "dgr_engine.security.grants",
    "LockVerifier": "dgr_engine.certification.verify",
    # the shard errors' two branches (the engine's refusals one by one: dgr_engine.errors)
    "ClientCallError": "dgr_engine.errors",
    "EngineError": "dgr_engine.errors",
    "ShardDeadlineExceeded": "dgr_engine.errors",
    "ShardError": "dgr_engine.errors",
    "ShardRpcError": "dgr_engine.errors",
    "ShardTransportError": "dgr_engine.errors",
    "ShardUnavailable": "dgr_engine.errors",
}
"""What a tracker author imports from ``dgr_engine``, and the module that defines each."""

_FOR_TESTS: dict[str, str] = {
    # the engine in-process, its options, the tokenizer
    "EngineOptions": "dgr_engine.options",
    "EngineStats": "dgr_engine.engine",
    "ShardEngine": "dgr_engine.engine",
    "ShardInfo": "dgr_engine.engine",
    "Tokenizer": "dgr_engine.tokenizer",
    "prompt_ids": "dgr_engine.client.text",
    # models: generated fixtures, real models of the catalog
    "ensure_fixture": "dgr_engine.fixtures",
    "resolve_model": "dgr_engine.models",
    # the in-process reference run: a route's stages in one process, the whole model's tokens
    "InProcessRoute": "dgr_engine.reference",
    "n_layer_of": "dgr_engine.reference",
    "whole_model_greedy": "dgr_engine.reference",
    "whole_model_reference": "dgr_engine.reference",
    # the single-machine harness (production code, never imported by a worker or a client)
    "LoopbackRouteProvider": "dgr_engine.tooling.loopback",
    "WorkerProcess": "dgr_engine.tooling.processes",
    "dgr_command": "dgr_engine.tooling.processes",
    "local_pki": "dgr_engine.tooling.throwaway_ca",
}
"""What a test author imports from ``dgr_engine`` (test doubles: ``dgr_engine.testing``)."""

_PUBLIC = {**_FOR_TRACKERS, **_FOR_TESTS}

__all__ = [
    "Advert",
    "Capacity",
    "ChainStageTransport",
    "ClientCallError",
    "ClientTls",
    "DataPaths",
    "EndpointRouteProvider",
    "EngineError",
    "EngineOptions",
    "EngineStats",
    "GrantIssuer",
    "GrpcStageTransport",
    "Health",
    "InProcessRoute",
    "LayerSpan",
    "Load",
    "LockVerifier",
    "LoopbackRouteProvider",
    "SeamCost",
    "Security",
    "ShardClient",
    "ShardDeadlineExceeded",
    "ShardEngine",
    "ShardError",
    "ShardInfo",
    "ShardRpcError",
    "ShardTransportError",
    "ShardUnavailable",
    "Tokenizer",
    "WorkerProcess",
    "describe",
    "dgr_command",
    "ensure_fixture",
    "local_pki",
    "n_layer_of",
    "prompt_ids",
    "resolve_model",
    "whole_model_greedy",
    "whole_model_reference",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'dgr_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
