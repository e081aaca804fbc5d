"""The shard worker: one ``ShardEngine`` over one layer range, served over gRPC (``dgr worker``).

Its modules, one job each (``docs/worker.md``):

* ``server``: builds the parts and wires them together, the gRPC lifecycle, session opens
  (admission, grants) and the public ``ShardWorker``;
* ``config``: ``WorkerConfig``, how the worker serves;
* ``servicer``: the ``Shard`` service's calls, over its declared ``ShardHost``;
* ``chain``: the ``Chain`` service (chained routes), over its declared ``ChainHost``;
* ``chain_hub``: where each session's output goes, and the channels to next stages;
* ``chain_downstream``: a stream to the next stage, and how its end is passed up;
* ``chain_frames``: the frames a chained stage sends on (the next stage's, a ring's);
* ``frame_path``: the per-frame path (decode, check, forward, refuse) over ``FrameHost``;
* ``engine_dispatch``: where engine calls run (the engine thread, the loop, co-batches);
* ``engine_thread``: the one thread that calls the engine;
* ``co_batch``: frames of different sessions in one engine call;
* ``sessions``: the session table over the engine, which publishes every close;
* ``closes``: what a close is (``SessionClosed``, its cause) and how listeners hear of it;
* ``housekeeping``: closes on the engine thread, and those the worker makes by itself
  (leases, stalls, abandoned calls);
* ``tombstones``: closes that arrived before their opens;
* ``admission``: the line of opens waiting for a slot;
* ``grant_gate``: route grants at open, session secrets after;
* ``peer_limits``: sessions per client identity, frames per second per session;
* ``usage``: the worker's usage records;
* ``advertiser``: the lane, its certification, and the advert;
* ``identity``: the build and model identity an advert states; ``start_times``: where a
  worker's start-up seconds went, the line it logs and how that line reads back;
* ``load``: the load meter; ``metrics`` and ``metrics_server``: Prometheus metrics;
* ``registration``: the ``Shard`` service's lenient registration; ``preflight``: checks
  before loading.
"""

from dgr_engine.worker.server import SERVICE_NAME, ShardWorker, WorkerConfig

__all__ = ["SERVICE_NAME", "ShardWorker", "WorkerConfig"]
