"""The shard worker: one ``ShardEngine`` over one layer range, served over gRPC (``dgr worker``).

``server`` (lifecycle, advert, leases), ``servicer`` (the ``Shard`` calls), ``sessions`` (the
session table over the engine), ``engine_thread`` (the one thread that calls the engine),
``load`` (the load meter), ``identity`` (the build and model identity an advert states).
"""

from dgr_engine.worker.server import SERVICE_NAME, ShardWorker, WorkerConfig

__all__ = ["SERVICE_NAME", "ShardWorker", "WorkerConfig"]
