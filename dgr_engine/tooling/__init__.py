"""Single-machine tooling: what the demo, the tests, the benchmarks and local trials use to
stand a route up on one machine, and what a deployed worker or client never needs.

* :mod:`~dgr_engine.tooling.processes`: starting and stopping ``dgr worker`` processes;
* :mod:`~dgr_engine.tooling.loopback`: ``LoopbackRouteProvider``, routes over workers it spawns;
* :mod:`~dgr_engine.tooling.delay_proxy`: a WAN between stages (latency, jitter, bandwidth);
* :mod:`~dgr_engine.tooling.fault_campaign`: faults injected into concurrent route sessions;
* :mod:`~dgr_engine.tooling.throwaway_ca`: self-signed CAs and certificates for local TLS;
* :mod:`~dgr_engine.tooling.llama_build`: the pinned llama.cpp tree and its tools (converter,
  ``llama-gguf-split``) for what needs them at run time;
* :mod:`~dgr_engine.tooling.peer_build`: llama.cpp's own peers (``llama-bench``,
  ``ggml-rpc-server``, ``llama-batched-bench``) built from that tree, cached;
* :mod:`~dgr_engine.tooling.rpc_peer`: running them beside dgr (llama.cpp RPC with dgr's split,
  the same threads, KV type and flash attention) and reading their reports.

``dgr_engine.worker`` and ``dgr_engine.client`` never import this room (a test keeps the rule).
"""
