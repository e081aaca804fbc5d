"""dgr data plane: the shard engine (cffi over the patched llama.cpp), its clients and workers.

The rooms (``docs/architecture-rooms.md`` draws them):

* this top level: the binding (``engine``, ``_binding``, ``errors``, ``numerics``, ``options``,
  ``gguf_check``, ``tokenizer``), the in-process reference run (``reference``), the test doubles
  for users' suites (``testing``) and two small helpers (``argtypes``, ``atomic``);
* ``client``: a shard client, the relay and chained transports, fixed-endpoint routes, text;
* ``security``: TLS and route grants, read by client and worker alike; ``wire``: the frames,
  adverts and status trailers both ends speak;
* ``worker``: the shard worker (``dgr worker``);
* ``certification``: the pure decision framework (lanes, lock, records, gates, signing);
  ``certify``: the runners that drive routes to make records;
* ``artifacts``, ``models``, ``fixtures``, ``baseline``: model files, real models, generated
  models, the DGR-020 baseline;
* ``tooling``: single-machine tooling (worker processes, the loopback provider, a delay proxy,
  the fault campaign, a throwaway CA), never imported by ``worker`` or ``client``;
* ``cli``: the ``dgr`` command.

``ShardEngine`` and friends load the compiled binding on first use, so that fixture generation
and other pure-Python parts import without a native build. Names whose module moved when the
rooms were made are importable from here as well (:data:`MOVED`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from loguru import logger

logger.disable("dgr_engine")

if TYPE_CHECKING:
    from dgr_engine.client.chained import ChainStageTransport
    from dgr_engine.client.relay import GrpcStageTransport
    from dgr_engine.client.routes import EndpointRouteProvider, describe
    from dgr_engine.client.shard_client import ShardClient
    from dgr_engine.engine import EngineStats, ShardEngine, ShardInfo
    from dgr_engine.reference import LocalChain
    from dgr_engine.security.grants import GrantIssuer, GrantVerifier
    from dgr_engine.security.tls import ClientTls, ServerTls
    from dgr_engine.tokenizer import Tokenizer
    from dgr_engine.tooling.loopback import LoopbackRouteProvider
    from dgr_engine.tooling.processes import WorkerProcess

MOVED: dict[str, str] = {
    "ChainStageTransport": "dgr_engine.client.chained",  # was dgr_engine.chain_transport
    "ClientTls": "dgr_engine.security.tls",  # was dgr_engine.tls
    "EndpointRouteProvider": "dgr_engine.client.routes",  # was dgr_engine.route_provider
    "GrantIssuer": "dgr_engine.security.grants",  # was dgr_engine.grants
    "GrantVerifier": "dgr_engine.security.grants",
    "GrpcStageTransport": "dgr_engine.client.relay",  # was dgr_engine.stage_transport
    "LocalChain": "dgr_engine.reference",  # was dgr_engine.chain
    "LoopbackRouteProvider": "dgr_engine.tooling.loopback",  # was dgr_engine.route_provider
    "ServerTls": "dgr_engine.security.tls",
    "ShardClient": "dgr_engine.client.shard_client",  # also dgr_engine.client
    "WorkerProcess": "dgr_engine.tooling.processes",  # was dgr_engine.processes
    "describe": "dgr_engine.client.routes",
}
"""Public names whose module moved, and the module that now holds each."""

_BINDING = {
    "EngineStats": "dgr_engine.engine",
    "ShardEngine": "dgr_engine.engine",
    "ShardInfo": "dgr_engine.engine",
    "Tokenizer": "dgr_engine.tokenizer",
}

__all__ = [
    "ChainStageTransport",
    "ClientTls",
    "EndpointRouteProvider",
    "EngineStats",
    "GrantIssuer",
    "GrantVerifier",
    "GrpcStageTransport",
    "LocalChain",
    "LoopbackRouteProvider",
    "ServerTls",
    "ShardClient",
    "ShardEngine",
    "ShardInfo",
    "Tokenizer",
    "WorkerProcess",
    "describe",
]
assert sorted([*_BINDING, *MOVED]) == __all__


def __getattr__(name: str) -> Any:
    module = _BINDING.get(name) or MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'dgr_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
