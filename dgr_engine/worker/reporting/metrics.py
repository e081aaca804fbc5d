"""A worker's Prometheus metrics (``prometheus_client``, a registry of its own per worker).

Counted always (a few counter increments per frame); served over HTTP only when the worker is
given a metrics port (``dgr worker --metrics-port``), on loopback unless told otherwise
(``--metrics-host``), over the worker's own TLS when asked (``--metrics-tls``;
``worker/reporting/metrics_server.py``). Names start with ``dgr_worker_``; the build and lane
are the labels of ``dgr_worker_info``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dgr_engine.security.tls import ServerTls
from dgr_engine.worker.lifecycle.prefixes import PrefixCounters
from dgr_engine.worker.reporting.metrics_server import MetricsHttpServer

_KINDS = ("prefill", "decode", "replay")
_TIME_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class WorkerMetrics:
    """Every metric of one worker. ``sessions_open``, ``slots`` and ``waiting`` are read when
    scraped."""

    def __init__(
        self,
        *,
        sessions_open: Callable[[], float],
        slots: Callable[[], float],
        waiting: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        Gauge("dgr_worker_sessions_open", "Sessions open", registry=r).set_function(sessions_open)
        Gauge("dgr_worker_session_slots", "Session slots", registry=r).set_function(slots)
        Gauge(
            "dgr_worker_admissions_waiting", "Opens waiting for a free slot", registry=r
        ).set_function(waiting)
        self.forwards = Counter(
            "dgr_worker_forwards", "Forward frames run, by kind", ["kind"], registry=r
        )
        self.rows = Counter("dgr_worker_rows", "Rows run, by kind", ["kind"], registry=r)
        self.engine_seconds = Histogram(
            "dgr_worker_engine_seconds", "Engine time per frame", buckets=_TIME_BUCKETS, registry=r
        )
        self.frame_seconds = Histogram(
            "dgr_worker_frame_seconds",
            "Handling time per frame (decode, queue, engine, encode)",
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.seam_bytes = Counter(
            "dgr_worker_seam_bytes", "Frame bytes, by direction", ["direction"], registry=r
        )
        self.refusals = Counter(
            "dgr_worker_refusals", "Calls refused, by dgr-status", ["status"], registry=r
        )
        self.frame_link = Counter(
            "dgr_worker_frame_link_calls",
            "Frame link connections, by what came of them: the call they opened (ChainStream, "
            "ChainOutput), or refused (over the limit, not the protocol, silent too long)",
            ["call"],
            registry=r,
        )
        self.native_link = Counter(
            "dgr_worker_native_link_connections",
            "Native link connections, by what came of them: the role they took (input, ring, "
            "output), dialled (to a next stage), or refused",
            ["what"],
            registry=r,
        )
        self.lease_expiries = Counter(
            "dgr_worker_lease_expiries", "Sessions closed because their lease ran out", registry=r
        )
        self.engine_calls = Counter(
            "dgr_worker_engine_calls", "Engine calls made by co-batching", registry=r
        )
        self.frames_per_call = Histogram(
            "dgr_worker_frames_per_engine_call",
            "Sessions' frames run together in one co-batched engine call",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.info = Info("dgr_worker", "The build, model and lane this worker serves", registry=r)
        # labelled children looked up once: a label lookup costs more than the increment
        self._by_kind = {k: (self.forwards.labels(k), self.rows.labels(k)) for k in _KINDS}
        self._bytes_in = self.seam_bytes.labels("in")
        self._bytes_out = self.seam_bytes.labels("out")
        self._server: MetricsHttpServer | None = None

    def watch_prefixes(
        self, counters: Callable[[], PrefixCounters], held: Callable[[], int]
    ) -> None:
        """Reports the kept prompt prefixes (``worker/lifecycle/prefixes.py``) when scraped."""
        self.registry.register(_PrefixCollector(counters, held))

    def describe(self, labels: Mapping[str, str]) -> None:
        self.info.info(dict(labels))

    def forwarded(
        self, kind: str, rows: int, engine_s: float, frame_s: float, bytes_in: int, bytes_out: int
    ) -> None:
        children = self._by_kind.get(kind)
        if children is None:
            children = self._by_kind[kind] = (self.forwards.labels(kind), self.rows.labels(kind))
        children[0].inc()
        children[1].inc(rows)
        self.engine_seconds.observe(engine_s)
        self.frame_seconds.observe(frame_s)
        self._bytes_in.inc(bytes_in)
        self._bytes_out.inc(bytes_out)

    def engine_call(self, frames: int, rows: int) -> None:
        """One co-batched engine call ran ``frames`` frames (``rows`` rows together)."""
        self.engine_calls.inc()
        self.frames_per_call.observe(frames)

    def serve(self, host: str, port: int, tls: ServerTls | None = None) -> int:
        """Serves ``/metrics`` on ``host:port`` (0: a free port) in a thread, over HTTPS with
        ``tls`` (client certificates required when it is mutual); returns the port."""
        self._server = MetricsHttpServer(self.registry, host, port, tls)
        return self._server.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


class _PrefixCollector(Collector):
    """The kept prompt prefixes' counters, read when scraped."""

    def __init__(self, counters: Callable[[], PrefixCounters], held: Callable[[], int]) -> None:
        self._counters = counters
        self._held = held

    def collect(self) -> Iterator[Metric]:
        c = self._counters()
        for name, text, value in (
            ("kept", "Prompt prefixes kept for clients", c.kept),
            ("hits", "Opens that started from a kept prefix", c.hits),
            ("misses", "Opens that named a prefix not kept here", c.misses),
            (
                "positions_reused",
                "Positions opens started with: rows not computed again",
                c.positions_reused,
            ),
            ("evicted", "Kept prefixes dropped for room", c.evicted),
        ):
            yield CounterMetricFamily(f"dgr_worker_prefix_{name}", text, value=value)
        yield GaugeMetricFamily(
            "dgr_worker_prefix_bytes", "Bytes of kept prompt prefixes", value=self._held()
        )
