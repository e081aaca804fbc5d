"""The shard worker: builds its parts over one ``ShardEngine`` and wires them together, serves
them over gRPC (the ``Shard`` and ``Chain`` services and health) from ``start`` to ``stop``,
and opens, closes and admits sessions. Why it is built this way: ``docs/worker.md``.

Every part is built here and handed what it needs; none of them imports this module. The
session table tells the chain hub, the grant gate and the per-client limits of every close
(``worker/lifecycle/closes.py``), on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from loguru import logger

from dgr_engine.certification.lane import BATCHING_CO_BATCH, LaneKey
from dgr_engine.certification.registry import LaneLookup
from dgr_engine.engine import LinkSockets, NativeLink, ShardEngine
from dgr_engine.errors import EngineError
from dgr_engine.gguf_check import GgufHeader, check_gguf
from dgr_engine.numerics import Numerics
from dgr_engine.options import EngineOptions
from dgr_engine.security.grants import Grant, GrantVerifier
from dgr_engine.security.tls import check_plaintext_bind, is_loopback
from dgr_engine.wire import frames as frames
from dgr_engine.wire.advert import Advert, DataPaths
from dgr_engine.wire.keepalive import GRPC_SERVER_OPTIONS
from dgr_engine.worker.calls.chain import ChainServicer, add_chain_service
from dgr_engine.worker.calls.frame_link_server import FrameLinkServer, connection_limit
from dgr_engine.worker.calls.frame_path import FramePath
from dgr_engine.worker.calls.native_link_server import NativeLinkServer
from dgr_engine.worker.calls.registration import SERVICE_NAME, add_shard_service
from dgr_engine.worker.calls.servicer import ShardServicer
from dgr_engine.worker.config import WorkerConfig
from dgr_engine.worker.engine_access.co_batch import (
    CoBatchConfig,
    CoBatcher,
    FrameResult,
    co_batch_rows,
)
from dgr_engine.worker.engine_access.engine_dispatch import EngineDispatch
from dgr_engine.worker.lifecycle.admission import Admission
from dgr_engine.worker.lifecycle.closes import CloseCause, OnLoop
from dgr_engine.worker.lifecycle.grant_gate import GrantGate
from dgr_engine.worker.lifecycle.housekeeping import Housekeeping
from dgr_engine.worker.lifecycle.peer_limits import PeerLimitConfig, PeerLimits
from dgr_engine.worker.lifecycle.prefixes import KeptPrefix, PrefixStore
from dgr_engine.worker.lifecycle.sessions import EngineLike, SessionTable
from dgr_engine.worker.reporting.advertiser import Advertiser
from dgr_engine.worker.reporting.identity import BuildIdentity
from dgr_engine.worker.reporting.load import LoadMeter
from dgr_engine.worker.reporting.metrics import WorkerMetrics
from dgr_engine.worker.reporting.usage import UsageBook
from dgr_engine.worker.route.chain_hub import ChainHub
from dgr_session.identity import Lane
from dgr_session.prefixes import PrefixRef
from dgr_session.sampling import GREEDY, Sampling

_T = TypeVar("_T")
_FRAME_OVERHEAD = 64 * 1024
"""Bytes allowed per message beyond its rows (ids, expectations, framing)."""
_SIDEBAND_PER_ROW = 16
"""Bytes per row of positions, token ids and logit-row indices (packed varints, worst case)."""


_DEFAULTS = EngineOptions()
"""The engine options :meth:`ShardWorker.load` defaults to."""


class ShardWorker:
    """One engine served over gRPC. ``await start()``, then ``await stop()`` (idempotent).

    It is the host its parts are given (``FrameHost``, ``ShardHost``, ``ChainHost``: the
    few members each declares)."""

    def __init__(
        self,
        engine: EngineLike,
        build: BuildIdentity,
        config: WorkerConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        # the KV type and flash-attention mode are the engine's: the advert and lane say them
        self.config = config if config is not None else WorkerConfig()
        self.build = build.with_numerics(engine.numerics)
        if self.config.co_batch:
            self.build = attrs.evolve(self.build, batching=BATCHING_CO_BATCH)
        self.info = engine.info
        self.expect = frames.Expectations.of_shard(build.model_sha256, self.info)
        self.log = logger.bind(stage=f"{self.info.layer_begin}:{self.info.layer_end}")
        self.port = 0
        self.metrics_port = 0
        """Where the metrics are served once started (0: not served)."""
        keys = self.config.grant_keys
        self.grants = GrantGate(GrantVerifier(keys) if keys else None)
        self.limits = PeerLimits(
            PeerLimitConfig(self.config.sessions_per_client, self.config.frames_per_second),
            clock,
        )
        self.chain = ChainHub(self.config.chain_tls)
        """Chained routes' links and output streams (``worker/route/chain_hub.py``)."""
        self.native_links = NativeLinkServer(
            self,
            introductions=self.config.introduction_gate(),
            hello_seconds=self.config.frame_link_hello_seconds,
            counted=self._native_link_counted,
        )
        """Native links (``worker/calls/native_link_server.py``): served from ``start`` when
        offered (:attr:`native_link_port`)."""
        self.native_link_port = 0
        """Where native links are served once started (0: not offered)."""
        self.frame_link_port = 0
        """Where the frame link is served once started (0: not offered)."""
        self._close_listeners = tuple(
            OnLoop(listener, self.log)
            for listener in (self.chain, self.grants, self.limits, self.native_links)
        )
        # a tombstone is kept a lease long: an open older than that would have lost its slot
        self.table = SessionTable(
            engine,
            clock,
            tombstone_seconds=self.config.session_lease_seconds or 600.0,
            listeners=self._close_listeners,
            log=self.log,
        )
        self.admission = Admission(self._free_slots)
        self.meter = LoadMeter(self.config.load_window_seconds)
        self.advertiser = Advertiser(
            self.build,
            self.info,
            self.config,
            self.log,
            sessions=self.table.snapshot,
            load=self.meter.snapshot,
            waiting=lambda: self.admission.waiting,
            data_paths=lambda: DataPaths(
                frame_link_port=self.frame_link_port,
                native_link_port=self.native_link_port,
                native_link_sealed=self.native_links.sealed,
            ),
            mtp=bool(getattr(engine, "mtp_loaded", False)),
        )
        self.metrics = WorkerMetrics(
            sessions_open=lambda: self.table.snapshot().sessions_open,
            slots=lambda: self.info.max_sessions,
            waiting=lambda: self.admission.waiting,
        )
        self.metrics.describe(self._metric_labels())
        self.usage = UsageBook((self.info.layer_begin, self.info.layer_end))
        self.prefixes = PrefixStore(self.config.prefix_cache_bytes)
        """Prompt prefixes kept for clients across sessions (``docs/prefix-cache.md``)."""
        self.metrics.watch_prefixes(
            lambda: self.prefixes.counters, lambda: self.prefixes.held_bytes
        )
        rows = co_batch_rows(self.info.n_batch, self.build.quant_types, self.build.hardware)
        co_batch = CoBatchConfig(rows, self.config.co_batch_wait_ms / 1000)
        self._link_co_batch_rows = rows if self.config.co_batch else None
        """Rows a co-batched engine call of the native links may carry (``None``: none
        co-batch)."""
        self.dispatch = EngineDispatch(
            self.table,
            self.meter,
            inline_max_rows=self.config.inline_max_rows,
            inline_max_ms=self.config.inline_max_ms,
            co_batch=co_batch if self.config.co_batch else None,
            on_call=self.metrics.engine_call,
        )
        self.housekeeping = Housekeeping(
            self.table,
            self.dispatch.engine_thread,
            self.admission,
            self.meter,
            self.metrics,
            self.log,
            lease_seconds=self.config.session_lease_seconds,
            stall_seconds=self.config.stall_seconds,
            resume_grace_seconds=self.config.resume_grace_seconds,
        )
        path = FramePath(self)
        self._shard_servicer = ShardServicer(self, path)
        self._chain_servicer = ChainServicer(self, path, self.chain)
        self._frame_link: FrameLinkServer | None = None
        self._health = health_aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._stopped: int | None = None  # sessions closed at stop; None until stopped

    @classmethod
    def load(
        cls,
        model: str | os.PathLike[str],
        layers: tuple[int, int],
        *,
        max_sessions: int = _DEFAULTS.max_sessions,
        n_ctx_per_session: int = _DEFAULTS.n_ctx_per_session,
        n_threads: int = _DEFAULTS.n_threads,
        n_batch: int = _DEFAULTS.n_batch,
        n_ubatch: int = _DEFAULTS.n_batch,
        numerics: Numerics | None = None,
        config: WorkerConfig | None = None,
        build: BuildIdentity | None = None,
        load_mtp: bool | None = None,
        header: GgufHeader | None = None,
    ) -> ShardWorker:
        """Hashes the GGUF (streaming), loads the engine over ``layers``. Blocking. The engine
        options default to :class:`~dgr_engine.options.EngineOptions`' (``dgr worker``'s).
        ``build``: the identity already established (a split model's,
        :meth:`BuildIdentity.of_artifacts`; ``model`` is then its first file).
        ``load_mtp``: load the model's MTP block (``None``: when the shard is the last stage
        of a deepseek4 model that has one: ``GgufHeader.owns_mtp_block``).
        ``header``: ``model``'s header already parsed (the preflight's), so that the file's
        header is read once at start."""
        header = header if header is not None else check_gguf(model)
        build = build if build is not None else BuildIdentity.of_model(model, header)
        if load_mtp is None:
            load_mtp = header.owns_mtp_block(layers)
        engine = ShardEngine(
            Path(model),
            layers=layers,
            max_sessions=max_sessions,
            n_ctx_per_session=n_ctx_per_session,
            n_threads=n_threads,
            n_batch=n_batch,
            n_ubatch=n_ubatch,
            numerics=numerics,
            load_mtp=load_mtp,
        )
        return cls(engine, build, config)

    def _metric_labels(self) -> dict[str, str]:
        return {
            "model_sha256": self.build.model_sha256.hex(),
            "arch": self.info.arch,
            "layers": f"{self.info.layer_begin}:{self.info.layer_end}",
            "lane_id": self.lane_key.lane_id,
            "batching": self.build.batching,
            "llama_cpp_commit": self.build.llama_cpp_commit,
            "patch_stack_sha256": self.build.patch_stack_sha256.hex(),
            "dgr_version": self.build.dgr_version,
            "certification": self.lane().certification.value,
        }

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def frame_link(self) -> FrameLinkServer | None:
        """The frame link's server once started (``None``: not offered, or not started)."""
        return self._frame_link

    @property
    def address(self) -> str:
        """``host:port`` the server is bound to (after ``start``)."""
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def message_limits(self) -> tuple[int, int]:
        """(receive, send) byte caps."""
        if self.config.max_message_bytes is not None:
            return self.config.max_message_bytes, self.config.max_message_bytes
        rows = self.info.n_batch
        receive = rows * (4 * self.info.in_width + _SIDEBAND_PER_ROW) + _FRAME_OVERHEAD
        send = rows * 4 * self.info.out_width + _FRAME_OVERHEAD
        return receive, send

    async def start(self) -> str:
        """Binds and starts serving; returns the address."""
        receive, send = self.message_limits()
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", receive),
                ("grpc.max_send_message_length", send),
                ("grpc.so_reuseport", 0),  # two workers must never share a port
                *GRPC_SERVER_OPTIONS,  # a silent client is found out (wire/keepalive.py)
            ]
        )
        add_shard_service(self._shard_servicer, server)
        add_chain_service(self._chain_servicer, server)  # chained routes
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        tls = self.config.tls
        if tls is not None:
            self.port = server.add_secure_port(f"{host}:{self.config.port}", tls.credentials())
        else:
            check_plaintext_bind(self.config.host, self.config.allow_plaintext_remote)
            if not is_loopback(self.config.host):
                self.log.warning(
                    "serving PLAINTEXT on {}: anyone on the network can read and inject frames",
                    self.config.host,
                )
            self.port = server.add_insecure_port(f"{host}:{self.config.port}")
        if self.port == 0:
            raise OSError(f"could not bind {host}:{self.config.port}")
        loop = asyncio.get_running_loop()
        for listener in self._close_listeners:  # closes on the engine thread: told on the loop
            listener.bind(loop)
        await server.start()
        self._server = server
        if self.config.frame_link_port is not None:
            link = FrameLinkServer(
                self._chain_servicer,
                self.log,
                tls=tls,
                max_message_bytes=receive,
                max_connections=connection_limit(self.info.max_sessions),
                introductions=self.config.introduction_gate(),
                hello_seconds=self.config.frame_link_hello_seconds,
                counted=lambda call: self.metrics.frame_link.labels(call).inc(),
            )
            self.frame_link_port = await link.start(self.config.host, self.config.frame_link_port)
            self._frame_link = link
        native_port = self.config.native_link_port
        if native_port is not None and hasattr(self.engine, "start_link"):
            self.native_links.sealed = tls is not None  # TLS's equal on the native links
            self.native_link_port = await self.native_links.start(self.config.host, native_port)
        if self.config.metrics_port is not None:
            self._serve_metrics(self.config.metrics_port)
        self.housekeeping.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.log.info(
            "serving layers [{}, {}) of {} on {} ({}){}{}",
            self.info.layer_begin,
            self.info.layer_end,
            self.build.model_sha256.hex()[:12],
            self.address,
            "plaintext" if tls is None else "mutual TLS" if tls.mutual else "TLS",
            f", frame link on port {self.frame_link_port}" if self.frame_link_port else "",
            f", native link on port {self.native_link_port}" if self.native_link_port else "",
        )
        return self.address

    def _serve_metrics(self, port: int) -> None:
        host, tls = self.config.metrics_host, self.config.tls if self.config.metrics_tls else None
        self.metrics_port = self.metrics.serve(host, port, tls)
        if tls is None and not is_loopback(host):
            self.log.warning(
                "serving metrics in PLAINTEXT on {}: anyone on the network can read them "
                "(--metrics-tls serves them with the worker's certificate)",
                host,
            )

    @property
    def metrics_address(self) -> str:
        """``host:port`` the metrics are served on (after ``start``; port 0: not served)."""
        host = self.config.metrics_host
        return f"[{host}]:{self.metrics_port}" if ":" in host else f"{host}:{self.metrics_port}"

    async def stop(self) -> int:
        """Stops serving, closes every session and the engine; returns the sessions closed."""
        if self._stopped is not None:
            return self._stopped
        await self._health.enter_graceful_shutdown()
        await self.housekeeping.stop_watching()
        if self._server is not None:
            await self._server.stop(self.config.grace_seconds)
        if self._frame_link is not None:
            await self._frame_link.stop()
        await self.native_links.stop()
        await self.chain.aclose()
        await self.housekeeping.finish()
        closed = await self.dispatch.engine_thread.run(self._close)
        self.dispatch.shutdown()
        self.metrics.stop()
        self._stopped = closed
        self.log.info("stopped: closed {} session(s) and the engine", closed)
        return closed

    def _close(self) -> int:
        try:
            return self.table.close_all()
        finally:
            self.engine.close()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    # -- sessions: admission, grants, closes -------------------------------------------------

    def _free_slots(self) -> int:
        return self.info.max_sessions - self.table.snapshot().sessions_open

    async def open_session(
        self, session_id: str, epoch: int, sampling: Sampling = GREEDY, *, wait: float | None
    ) -> bool:
        """Opens ``(session_id, epoch)`` on the engine with the session's sampler (which the
        last stage applies); True if an older epoch was discarded.
        A session new here takes a slot: when none is free it waits in line (first come, first
        served) for at most ``admission_wait_seconds`` and ``wait`` (the call's time left),
        then raises ``CapacityExceeded`` with a retry hint."""
        if self.table.holds(session_id):  # a newer epoch reuses the session's slot
            return await self.run_on_engine(self.table.open, session_id, epoch, sampling)
        limit = self.config.admission_wait_seconds
        if wait is not None:
            limit = min(limit, wait - 0.05)  # answer busy before the caller gives up
        async with self.admission.turn(limit, f"open of session {session_id!r}"):
            return await self.run_on_engine(self.table.open, session_id, epoch, sampling)

    async def close_session(self, session_id: str, epoch: int) -> int:
        """Closes the session if open at ``epoch`` or older; returns the epoch closed."""
        return await self.housekeeping.close_session(session_id, epoch)

    async def keep_prefix(self, session_id: str, epoch: int, client: str, keep: PrefixRef) -> bool:
        """Keeps the open epoch's first ``keep.length`` positions for ``client`` under
        ``keep.digest`` (the session is about to close); False when it cannot (fewer
        positions, no room, a model whose state it cannot cut)."""
        if not self.prefixes.capacity:
            return False
        state = await self.run_on_engine(self.table.save_prefix, session_id, epoch, keep.length)
        if state is None:
            return False
        return self.prefixes.put(client, keep.digest, KeptPrefix(keep.length, state))

    async def start_from_prefix(
        self, session_id: str, epoch: int, client: str, prefix: PrefixRef
    ) -> int:
        """Sets the open epoch to the first ``prefix.length`` positions ``client`` kept under
        ``prefix.digest``, or empty when there is no such prefix here; the positions it holds."""
        kept = self.prefixes.take(client, prefix.digest, prefix.length) if prefix.length else None
        state = None if kept is None else kept.state
        return await self.run_on_engine(
            self.table.start_from, session_id, epoch, state, prefix.length
        )

    def abandon(self, session_id: str, epoch: int, why: str) -> None:
        """A call of ``(session_id, epoch)`` was cancelled by its caller: the session is
        closed at that epoch, in the background (``Housekeeping.abandon``)."""
        self.housekeeping.abandon(session_id, epoch, why)

    async def expire_idle_sessions(self) -> list[tuple[str, int]]:
        """Closes every session unused for the lease or longer; returns their ``(session_id,
        epoch)`` (``Housekeeping.expire_idle_sessions``; while serving, the worker calls this
        itself when the oldest session's lease runs out)."""
        return await self.housekeeping.expire_idle_sessions()

    def admit_grant(self, token: bytes, session_id: str, epoch: int) -> Grant | None:
        """The route grant that permits opening ``(session_id, epoch)`` on this stage (spent),
        ``None`` without grant keys; raises ``GrantUnauthenticated`` / ``GrantDenied``."""
        return self.grants.admit(
            token,
            session_id=session_id,
            epoch=epoch,
            endpoint=self.config.grant_endpoint or self.address,
            layers=(self.info.layer_begin, self.info.layer_end),
            model_sha256=self.build.model_sha256.hex(),
            lane_id=self.lane_key.lane_id,
        )

    def permits_usage(self, token: bytes, session_id: str) -> bool:
        """Whether ``token`` is the tracker's credential for ``session_id``'s usage here (a
        grant for it and this stage, signed by a grant key, unexpired); False without keys."""
        verifier = self.grants.verifier
        if not token or verifier is None:
            return False
        endpoint = self.config.grant_endpoint or self.address
        return verifier.permits_usage(token, session_id=session_id, endpoint=endpoint)

    @property
    def sessions_expired(self) -> int:
        """Sessions closed because their lease ran out."""
        return self.housekeeping.sessions_expired

    @property
    def sessions_reclaimed(self) -> int:
        """Sessions closed after a stall, an abandoned call or a newer epoch's close."""
        return self.housekeeping.sessions_reclaimed

    @property
    def calls_abandoned(self) -> int:
        """Calls whose caller cancelled them (each closes its session at that epoch)."""
        return self.housekeeping.calls_abandoned

    # -- the advert (``worker/reporting/advertiser.py``) -------------------------------------

    @property
    def lane_key(self) -> LaneKey:
        """The exact lane this worker serves."""
        return self.advertiser.lane_key

    @property
    def lane_lookup(self) -> LaneLookup:
        """The lane's certification (``None``: dark) and why, found at start."""
        return self.advertiser.lane_lookup

    def lane(self) -> Lane:
        """The lane with its certification (dark unless a record of exactly it was loaded)."""
        return self.advertiser.lane()

    def advert(self) -> Advert:
        """The capability advert now (never waits for the engine)."""
        return self.advertiser.advert()

    # -- the engine (``worker/engine_access/engine_dispatch.py``) ----------------------------

    @property
    def co_batcher(self) -> CoBatcher | None:
        """Co-batches forward frames (``WorkerConfig.co_batch``); ``None``: one per call."""
        return self.dispatch.co_batcher

    @property
    def small_frame_ns(self) -> float:
        """Engine time of the last frame of at most ``inline_max_rows`` rows (none yet: inf)."""
        return self.dispatch.small_frame_ns

    @small_frame_ns.setter
    def small_frame_ns(self, value: float) -> None:
        self.dispatch.small_frame_ns = value

    async def run_forward(self, frame: frames.ForwardFrame, deadline: float | None) -> FrameResult:
        """Runs one decoded frame on the engine (``EngineDispatch.run_forward``)."""
        return await self.dispatch.run_forward(frame, deadline)

    def _native_link_counted(self, what: str) -> None:
        self.metrics.native_link.labels(what).inc()

    def start_link(
        self,
        key: int,
        epoch: int,
        hop: int,
        sockets: LinkSockets,
        notify_fd: int,
        sampling: Sampling = GREEDY,
    ) -> NativeLink:
        """Starts the engine's native link of the session keyed ``key`` (``NativeLinkHost``),
        its last stage taking the tokens with ``sampling``."""
        start: Callable[..., NativeLink] = self.engine.start_link  # type: ignore[attr-defined]
        budget = self.limits.config  # the per-client frame rate, kept by the link itself
        return start(
            key,
            epoch,
            hop=hop,
            sockets=sockets,
            notify_fd=notify_fd,
            frames_per_second=budget.frames_per_second,
            burst=budget.burst,
            co_batch_rows=self._link_co_batch_rows,  # co-batched with each other, as the
            sampling=sampling,  # Python path's frames are (the lane's batching)
        )

    async def close_for(self, session_id: str, epoch: int, cause: CloseCause) -> None:
        """Closes ``(session_id, epoch)`` on the engine's thread, for ``cause``."""
        try:
            await self.run_on_engine(self.table.close, session_id, epoch, cause)
        except EngineError as exc:  # closed meanwhile, or a newer epoch: nothing to close
            self.log.bind(session=session_id, epoch=epoch).debug("not closed: {}", exc)

    async def run_on_engine(
        self, job: Callable[..., _T], *args: Any, inline_ok: bool = False
    ) -> _T:
        """Runs ``job(*args)`` on the engine thread (``EngineDispatch.run_on_engine``)."""
        return await self.dispatch.run_on_engine(job, *args, inline_ok=inline_ok)


__all__ = ["SERVICE_NAME", "ShardWorker", "WorkerConfig"]
