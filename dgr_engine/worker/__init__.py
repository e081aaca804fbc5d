"""The shard worker: one ``ShardEngine`` over one layer range, served over gRPC (``dgr worker``).

Its modules, one job each, in five sub-rooms by concern (``docs/worker.md``):

* at the top: ``server``, which builds the parts and wires them together, the gRPC lifecycle,
  session opens (admission, grants) and the public ``ShardWorker``; ``config``,
  ``WorkerConfig``, how the worker serves;
* ``calls``: what a peer calls: ``servicer`` (the ``Shard`` service, over its declared
  ``ShardHost``), ``chain`` (the ``Chain`` service, over ``ChainHost``), ``frame_path`` (the
  per-frame path: decode, check, forward, refuse, over ``FrameHost``), ``registration`` (the
  ``Shard`` service's lenient registration), ``frame_link_server`` (the ``Chain`` calls over
  raw TCP), ``native_link_server`` (the native links' control shell);
* ``route``: a chained route's plumbing: ``chain_hub`` (where each session's output goes, the
  channels to next stages), ``chain_downstream`` (a stream to the next stage, how its end is
  passed up), ``chain_frames`` (the frames a chained stage sends on), ``ring_drafts`` (a
  drafting ring's last stage);
* ``engine_access``: ``preflight`` (checks before loading), ``engine_thread`` (the one thread
  that calls the engine), ``engine_dispatch`` (where engine calls run: the engine thread, the
  loop, co-batches), ``co_batch`` (frames of different sessions in one engine call);
* ``lifecycle``: ``admission`` (the line of opens waiting for a slot), ``grant_gate`` (route
  grants at open, session secrets after), ``peer_limits`` (sessions per client identity,
  frames per second per session), ``sessions`` (the session table, which publishes every
  close), ``closes`` (what a close is and how listeners hear of it), ``tombstones`` (closes
  that arrived before their opens), ``housekeeping`` (closes on the engine thread, and those
  the worker makes by itself: leases, stalls, abandoned calls);
* ``reporting``: ``identity`` (the build and model identity an advert states),
  ``advertiser`` (the lane, its certification, and the advert), ``load`` (the load meter),
  ``usage`` (the worker's usage records), ``metrics`` and ``metrics_server`` (Prometheus
  metrics), ``start_times`` (where a worker's start-up seconds went).

The sub-rooms' ``__init__`` modules hold a docstring only: they add nothing to what a worker
imports.
"""

from dgr_engine.worker.server import SERVICE_NAME, ShardWorker, WorkerConfig

__all__ = ["SERVICE_NAME", "ShardWorker", "WorkerConfig"]
