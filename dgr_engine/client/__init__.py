"""The client side of a route: what a tracker or a user's program runs to reach workers.

* :mod:`~dgr_engine.client.shard_client`: a typed asyncio client for one worker;
* :mod:`~dgr_engine.client.relay`: ``GrpcStageTransport``, the client relaying every hop;
* :mod:`~dgr_engine.client.chained`: ``ChainStageTransport``, chained routes and rings;
* :mod:`~dgr_engine.client.routes`: ``describe`` and ``EndpointRouteProvider`` (fixed endpoints);
* :mod:`~dgr_engine.client.text`: prompts to token ids and generated ids back to text.

It never imports the worker or the single-machine tooling (a test keeps that rule). The names
of the former module ``dgr_engine.client`` are re-exported here, so ``from dgr_engine.client
import ShardClient`` keeps working.
"""

from dgr_engine.client.shard_client import (
    DEFAULT_MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    Expectations,
    ForwardResult,
    ShardClient,
    WorkerTimings,
    client_call_error,
    expectations_of,
    session_metadata,
)

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "SCHEMA_VERSION",
    "Expectations",
    "ForwardResult",
    "ShardClient",
    "WorkerTimings",
    "client_call_error",
    "expectations_of",
    "session_metadata",
]
