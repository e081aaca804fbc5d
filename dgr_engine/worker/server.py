"""The shard worker's lifecycle: load one ``ShardEngine`` over one layer range, serve it over
gRPC (``ShardServicer`` and the health service), state its advert, expire idle sessions, stop.
Why it is built this way: ``docs/worker.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from loguru import logger

from dgr_engine.certification.errors import EvidenceError
from dgr_engine.certification.lane import BATCHING_CO_BATCH
from dgr_engine.certification.lock import load_lock
from dgr_engine.certification.registry import LaneLookup, find_certification
from dgr_engine.engine import ShardEngine
from dgr_engine.errors import StaleEpoch, UnknownSession
from dgr_engine.numerics import Numerics
from dgr_engine.security.grants import Grant, GrantVerifier
from dgr_engine.security.tls import ClientTls, ServerTls, check_plaintext_bind, is_loopback
from dgr_engine.wire import frames as frames
from dgr_engine.wire.advert import (
    Advert,
    Capacity,
    Health,
    LayerSpan,
    Load,
    SeamCost,
    Security,
)
from dgr_engine.worker.admission import Admission
from dgr_engine.worker.chain import ChainHub, add_chain_service
from dgr_engine.worker.co_batch import CoBatchConfig, CoBatcher
from dgr_engine.worker.engine_thread import EngineThread, expired_in_queue
from dgr_engine.worker.grant_gate import GrantGate
from dgr_engine.worker.identity import BuildIdentity
from dgr_engine.worker.load import LoadMeter
from dgr_engine.worker.metrics import WorkerMetrics
from dgr_engine.worker.peer_limits import PeerLimitConfig, PeerLimits
from dgr_engine.worker.registration import SERVICE_NAME, add_shard_service
from dgr_engine.worker.servicer import ShardServicer
from dgr_engine.worker.sessions import EngineLike, SessionTable
from dgr_engine.worker.usage import UsageBook
from dgr_session.identity import CertificationStatus, Lane, ModelIdentity, Recipe

_T = TypeVar("_T")
_FRAME_OVERHEAD = 64 * 1024
"""Bytes allowed per message beyond its rows (ids, expectations, framing)."""
_SIDEBAND_PER_ROW = 16
"""Bytes per row of positions, token ids and logit-row indices (packed varints, worst case)."""


@attrs.frozen
class WorkerConfig:
    """How the worker serves (the engine's own options are ``ShardWorker.load``'s)."""

    host: str = "127.0.0.1"
    """Address to bind; loopback unless told otherwise."""
    port: int = 0
    """Port to bind; 0 picks a free one (see ``ShardWorker.address``)."""
    max_message_bytes: int | None = None
    """Cap on a request and on a reply; ``None``: what ``n_batch`` rows can need."""
    grace_seconds: float = 2.0
    """How long in-flight calls may finish at shutdown before they are cancelled."""
    load_window_seconds: float = 10.0
    """Window of the advert's rows per second and recent errors."""
    inline_max_rows: int = 1
    """Frames of at most this many rows (decode steps) run on the event loop itself when the
    engine thread is idle, saving the hop to the thread and back, while such frames are short
    (``inline_max_ms``; ``docs/worker.md``). 0 turns this off."""
    inline_max_ms: float = 20.0
    """Run small frames on the loop only while the last one took at most this long in the
    engine (the first one always runs on the engine thread, to measure): a model whose decode
    steps are slow never holds the loop, and for it the hop saved is noise anyway."""
    co_batch: bool = False
    """Run frames of different sessions that wait for the engine together in one engine call
    (``dgr_engine.worker.co_batch``; recorded in the lane as ``batching="co-batch"``)."""
    co_batch_wait_ms: float = 0.0
    """With ``co_batch``: how long a call may wait for more sessions' frames (0: never)."""
    session_lease_seconds: float | None = 600.0
    """A session neither opened nor forwarded for this long is closed by the worker (checked
    while serving, see ``ShardWorker.expire_idle_sessions``); ``None``: never."""
    evidence_dir: Path | None = None
    """Where certification records are read from (``evidence/<class>/<lane-id>/``); the lane
    is certified only by a record of exactly its lane. ``None``: the lane is dark."""
    lock_path: Path | None = None
    """The lock records must be made under (default: ``$DGR_LOCK`` or the checkout's)."""
    admission_wait_seconds: float = 5.0
    """How long an open may wait in line for a free session slot (first come, first served)
    before it is answered busy (``DGR_E_CAPACITY`` with a retry hint); 0: answer at once. Also
    bounded by the call's own deadline."""
    stall_seconds: float = 5.0
    """A gap this long in the worker's own timekeeping (the process was stopped or starved)
    means its clients have given up waiting on it: sessions unused across the gap get
    ``resume_grace_seconds`` to be used again, then are closed (their clients moved on)."""
    resume_grace_seconds: float = 5.0
    """See ``stall_seconds``."""
    tls: ServerTls | None = None
    """Serve TLS with this certificate (and, with a client CA, require client certificates);
    ``None``: plaintext, allowed on loopback only unless ``allow_plaintext_remote``."""
    allow_plaintext_remote: bool = False
    """Serve plaintext on a non-loopback address (logged as a warning at every start)."""
    sessions_per_client: int | None = None
    """Sessions one client identity (its TLS certificate's name, else its host) may hold;
    ``None``: no limit beyond the worker's slots."""
    frames_per_second: float | None = None
    """Forward frames one session may send per second (bursts of 8); ``None``: no limit."""
    grant_keys: Mapping[str, Ed25519PublicKey] | None = None
    """The tracker's public keys by key id: an open then needs a route grant signed by one of
    them for exactly that session, epoch and stage (``dgr_engine.security.grants``);
    ``None``: none."""
    grant_endpoint: str | None = None
    """This stage's endpoint as the tracker's routes name it (default: the bound address)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on ``metrics_host:metrics_port`` (0: a free port); ``None``:
    counted, not served."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics bind: loopback unless told otherwise, whatever ``host`` is (a
    plaintext one beyond loopback is logged as a warning at every start)."""
    metrics_tls: bool = False
    """Serve the metrics over HTTPS with the worker's own certificate (``tls``, which this
    needs), requiring client certificates of its client CA when it has one."""
    chain_tls: ClientTls | None = None
    """How this worker dials the next stage of a chained route that serves TLS (the CA it
    trusts, and its client certificate for a next stage that asks for one); ``None``: it
    links only to plaintext next stages (``docs/chain.md``)."""

    def __attrs_post_init__(self) -> None:
        lease = self.session_lease_seconds
        if lease is not None and not lease > 0:
            raise ValueError(f"session_lease_seconds must be > 0 or None, got {lease}")
        for name in ("admission_wait_seconds", "stall_seconds", "resume_grace_seconds"):
            value = getattr(self, name)
            if not (value >= 0 and value != float("inf")):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.metrics_tls and self.tls is None:
            raise ValueError("metrics_tls needs the worker's TLS (tls)")


class ShardWorker:
    """One engine served over gRPC. ``await start()``, then ``await stop()`` (idempotent)."""

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
        # a tombstone is kept a lease long: an open older than that would have lost its slot
        self.table = SessionTable(
            engine, clock, tombstone_seconds=self.config.session_lease_seconds or 600.0
        )
        self.admission = Admission(self._free_slots)
        keys = self.config.grant_keys
        self.grants = GrantGate(GrantVerifier(keys) if keys else None, self.table.holds)
        self.limits = PeerLimits(
            PeerLimitConfig(self.config.sessions_per_client, self.config.frames_per_second),
            self.table.holds,
            clock,
        )
        self.sessions_expired = 0
        """Sessions closed because their lease ran out."""
        self.sessions_reclaimed = 0
        """Sessions closed after a stall because nobody used them again (their clients moved
        on), or because a newer epoch's close named them."""
        self.calls_abandoned = 0
        """Calls whose caller cancelled them (deadline passed, or gave up); each schedules a
        close of its session at that epoch."""
        self._sweeper: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.meter = LoadMeter(self.config.load_window_seconds)
        self.port = 0
        self.log = logger.bind(stage=f"{self.info.layer_begin}:{self.info.layer_end}")
        self.lane_key = self.build.lane_key(
            arch=self.info.arch,
            n_layer=self.info.n_layer,
            context_per_session=self.info.n_ctx_per_session,
        )
        self.lane_lookup = self._find_certification()
        self.metrics = WorkerMetrics(
            sessions_open=lambda: self.table.snapshot().sessions_open,
            slots=lambda: self.info.max_sessions,
            waiting=lambda: self.admission.waiting,
        )
        self.metrics.describe(
            {
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
        )
        self.metrics_port = 0
        """Where the metrics are served once started (0: not served)."""
        self.usage = UsageBook((self.info.layer_begin, self.info.layer_end))
        self._engine_thread = EngineThread()
        self.co_batcher: CoBatcher | None = None
        """Co-batches forward frames (``WorkerConfig.co_batch``); ``None``: one per call."""
        if self.config.co_batch:
            self.co_batcher = CoBatcher(
                CoBatchConfig(self.info.n_batch, self.config.co_batch_wait_ms / 1000),
                self._engine_thread,
                self.table.forward_batch,
                sessions_open=lambda: self.table.snapshot().sessions_open,
                on_call=self.metrics.engine_call,
                started=self.meter.started,
                stopped=self.meter.stopped,
            )
        self._health = health_aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self.chain: ChainHub | None = None
        """Chained routes' links and output streams (``worker/chain.py``), once started."""
        self._stopped: int | None = None  # sessions closed at stop; None until stopped
        self.small_frame_ns: float = float("inf")
        """Engine time of the last frame of at most ``inline_max_rows`` rows (none yet: inf)."""

    @classmethod
    def load(
        cls,
        model: str | os.PathLike[str],
        layers: tuple[int, int],
        *,
        max_sessions: int = 4,
        n_ctx_per_session: int = 512,
        n_threads: int = 2,
        n_batch: int = 512,
        n_ubatch: int = 512,
        numerics: Numerics | None = None,
        config: WorkerConfig | None = None,
        build: BuildIdentity | None = None,
    ) -> ShardWorker:
        """Hashes the GGUF (streaming), loads the engine over ``layers``. Blocking. ``build``:
        the identity already established (a split model's, :meth:`BuildIdentity.of_artifacts`;
        ``model`` is then its first file)."""
        build = build if build is not None else BuildIdentity.of_model(model)
        engine = ShardEngine(
            Path(model),
            layers=layers,
            max_sessions=max_sessions,
            n_ctx_per_session=n_ctx_per_session,
            n_threads=n_threads,
            n_batch=n_batch,
            n_ubatch=n_ubatch,
            numerics=numerics,
        )
        return cls(engine, build, config)

    # -- lifecycle ---------------------------------------------------------------------------

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
            ]
        )
        shard_servicer = ShardServicer(self)
        add_shard_service(shard_servicer, server)
        self.chain = add_chain_service(shard_servicer, server).hub  # chained routes
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
        await server.start()
        self._server = server
        if self.config.metrics_port is not None:
            self._serve_metrics(self.config.metrics_port)
        if self.config.session_lease_seconds is not None:
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep_leases(self.config.session_lease_seconds), name="dgr-session-leases"
            )
        if self.config.stall_seconds > 0:
            self._watchdog = asyncio.get_running_loop().create_task(
                self._watch_for_stalls(), name="dgr-stall-watchdog"
            )
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.log.info(
            "serving layers [{}, {}) of {} on {} ({})",
            self.info.layer_begin,
            self.info.layer_end,
            self.build.model_sha256.hex()[:12],
            self.address,
            "plaintext" if tls is None else "mutual TLS" if tls.mutual else "TLS",
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
        for task in (self._sweeper, self._watchdog):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._server is not None:
            await self._server.stop(self.config.grace_seconds)
        if self.chain is not None:
            await self.chain.aclose()
        await asyncio.gather(*self._background, return_exceptions=True)
        closed = await self._engine_thread.run(self._close)
        self._engine_thread.shutdown()
        self.metrics.stop()
        self._stopped = closed
        self.log.info("stopped: closed {} session(s) and the engine", closed)
        return closed

    def _close(self) -> int:
        try:
            return self.table.close_all()
        finally:
            self.engine.close()

    # -- sessions: admission, close, leases, stalls ------------------------------------------

    def _free_slots(self) -> int:
        return self.info.max_sessions - self.table.snapshot().sessions_open

    async def open_session(self, session_id: str, epoch: int, *, wait: float | None) -> bool:
        """Opens ``(session_id, epoch)`` on the engine; True if an older epoch was discarded.
        A session new here takes a slot: when none is free it waits in line (first come, first
        served) for at most ``admission_wait_seconds`` and ``wait`` (the call's time left),
        then raises ``CapacityExceeded`` with a retry hint."""
        if self.table.holds(session_id):  # a newer epoch reuses the session's slot
            return await self.run_on_engine(self.table.open, session_id, epoch)
        limit = self.config.admission_wait_seconds
        if wait is not None:
            limit = min(limit, wait - 0.05)  # answer busy before the caller gives up
        async with self.admission.turn(limit, f"open of session {session_id!r}"):
            return await self.run_on_engine(self.table.open, session_id, epoch)

    async def close_session(self, session_id: str, epoch: int) -> int:
        """Closes the session if open at ``epoch`` or older; returns the epoch closed."""
        try:
            closed = await self.run_on_engine(self.table.close, session_id, epoch)
        finally:
            self.admission.changed()
        if closed < epoch:
            self.sessions_reclaimed += 1
        return closed

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

    def abandon(self, session_id: str, epoch: int, why: str) -> None:
        """A call of ``(session_id, epoch)`` was cancelled by its caller (its deadline passed,
        or it gave up): a dgr client never uses an epoch again after a failed call, so the
        session is closed here at that epoch (not a newer one), in the background."""

        async def close() -> None:
            try:
                closed = await self.close_session(session_id, epoch)
            except (UnknownSession, StaleEpoch):
                return  # already gone, or a newer epoch holds the slot
            except Exception as exc:  # noqa: BLE001 - logged; the lease still bounds it
                self.log.bind(session=session_id, epoch=epoch).error(
                    "closing an abandoned session failed: {!r}", exc
                )
                return
            if closed == epoch:  # an older epoch is counted by close_session
                self.sessions_reclaimed += 1
            self.log.bind(session=session_id, epoch=epoch).warning(
                "session closed: {} by its client (it gave up on this epoch)", why
            )

        self.calls_abandoned += 1
        if self._stopped is None:
            task = asyncio.get_running_loop().create_task(close(), name="dgr-abandoned-close")
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _watch_for_stalls(self) -> None:
        # Ticks every stall/4; a tick that comes a stall late means the process was stopped
        # (SIGSTOP) or starved. Every session unused since before the gap is then closed unless
        # used within the resume grace: its client hit its step deadline while we were gone.
        stall, grace = self.config.stall_seconds, self.config.resume_grace_seconds
        clock = self.table.clock
        last = clock()
        while True:
            await asyncio.sleep(stall / 4)
            now = clock()
            if now - last >= stall:
                self.log.warning(
                    "stalled for {:.1f} s: sessions unused since are closed in {} s unless used",
                    now - last,
                    grace,
                )
                await asyncio.sleep(grace)
                await self._reclaim_unused_since(last)
                now = clock()
            last = now

    async def _reclaim_unused_since(self, since: float) -> None:
        try:
            sweep = await self._engine_thread.run(self.table.expire_unused_since, since)
        except Exception as exc:  # noqa: BLE001 - the watchdog must outlive one bad sweep
            self.meter.error()
            self.log.opt(exception=exc).error("closing sessions after a stall failed: {!r}", exc)
            return
        self.admission.changed()
        for session_id, epoch in sweep.closed:
            self.log.bind(session=session_id, epoch=epoch).warning(
                "session closed: unused since before a stall (its client moved on)"
            )
        for session_id, epoch, error in sweep.failed:
            self.meter.error()
            self.log.bind(session=session_id, epoch=epoch).error(
                "closing a session unused since a stall failed: {}", error
            )
        self.sessions_reclaimed += len(sweep.closed)

    # -- session leases ----------------------------------------------------------------------

    async def expire_idle_sessions(self) -> list[tuple[str, int]]:
        """Closes (on the engine thread) every session unused for the lease or longer; returns
        their ``(session_id, epoch)``. While serving, the worker calls this itself when the
        oldest session's lease runs out."""
        lease = self.config.session_lease_seconds
        if lease is None:
            return []
        sweep = await self._engine_thread.run(self.table.expire_idle, lease)
        for session_id, epoch in sweep.closed:
            self.log.bind(session=session_id, epoch=epoch).warning(
                "session closed: unused for {} s (its lease ran out)", lease
            )
        for session_id, epoch, exc in sweep.failed:
            self.meter.error()
            self.log.bind(session=session_id, epoch=epoch).error(
                "session lease ran out but closing it failed: {}", exc
            )
        self.sessions_expired += len(sweep.closed)
        self.metrics.lease_expiries.inc(len(sweep.closed))
        self.admission.changed()
        return sweep.closed

    async def _sweep_leases(self, lease: float) -> None:
        # Wakes when the least recently used session's lease runs out (a lease at most when
        # none is open), and never more often than every lease/16 (bounded even if a close
        # keeps failing).
        pause = min(lease / 16, 1.0)
        while True:
            oldest = self.table.oldest_use()
            due = lease if oldest is None else oldest + lease - self.table.clock()
            await asyncio.sleep(max(due, pause))
            try:
                await self.expire_idle_sessions()
            except Exception as exc:  # noqa: BLE001 - the sweeper must outlive one bad sweep
                self.meter.error()
                self.log.opt(exception=exc).error("session lease sweep failed: {!r}", exc)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    # -- the advert --------------------------------------------------------------------------

    def _find_certification(self) -> LaneLookup:
        lock = None
        if self.config.lock_path is not None:
            try:
                lock = load_lock(self.config.lock_path)
            except EvidenceError as exc:
                self.log.warning("lane dark: {}", exc)
                return LaneLookup(None, (str(exc),))
        found = find_certification(self.lane_key, self.config.evidence_dir, lock=lock)
        lane = self.lane_key.lane_id[:12]
        if found.certification is None:
            self.log.info("lane {} dark: {}", lane, "; ".join(found.reasons))
        else:
            cert = found.certification
            self.log.info(
                "lane {} certified: {} evidence, record {}",
                lane,
                cert.evidence_class.value,
                cert.record_id[:12],
            )
        return found

    def lane(self) -> Lane:
        """The lane with its certification (dark unless a record of exactly it was loaded)."""
        build, cert = self.build, self.lane_lookup.certification
        return Lane(
            backend=build.backend,
            llama_cpp_commit=build.llama_cpp_commit,
            patch_stack_hash=build.patch_stack_sha256,
            dgr_version=build.dgr_version,
            hardware=build.hardware,
            certification=CertificationStatus.DARK
            if cert is None
            else CertificationStatus.CERTIFIED,
            evidence=None if cert is None else cert.evidence_class,
            lane_id=self.lane_key.lane_id,
            record_id="" if cert is None else cert.record_id,
            record="" if cert is None else cert.record_text,
        )

    def advert(self) -> Advert:
        """The capability advert now (never waits for the engine)."""
        info, build = self.info, self.build
        table = self.table.snapshot()
        load = self.meter.snapshot()
        token_bytes = 4 if (info.is_first or info.needs_token_ids) else 0
        return Advert(
            identity=ModelIdentity(
                content_hash=build.model_sha256,
                arch=info.arch,
                n_layer=info.n_layer,
                official_target_sha=build.official_target_sha,
            ),
            recipe=Recipe(
                quant_types=build.quant_types,
                context=info.n_ctx_per_session,
                kv_type=build.kv_type,
                flash_attn=build.flash_attn,
            ),
            lane=self.lane(),
            schema_version=frames.SCHEMA_VERSION,
            span=LayerSpan(
                layer_begin=info.layer_begin,
                layer_end=info.layer_end,
                is_first=info.is_first,
                is_last=info.is_last,
                needs_token_ids=info.needs_token_ids,
            ),
            capacity=Capacity(
                sessions_max=info.max_sessions,
                sessions_open=table.sessions_open,
                kv_tokens_free=info.max_sessions * info.n_ctx_per_session - table.kv_tokens_used,
                context_per_session=info.n_ctx_per_session,
                max_rows_per_forward=info.n_batch,
                session_lease_seconds=self.config.session_lease_seconds or 0.0,
                sessions_waiting=self.admission.waiting,
                admission_wait_seconds=self.config.admission_wait_seconds,
            ),
            load=Load(
                in_flight=load.in_flight,
                queued=load.queued,
                rows_per_second=load.rows_per_second,
                window_seconds=load.window_seconds,
            ),
            seam=SeamCost(
                dtype="f32",
                width_in=info.in_width,
                width_out=info.out_width,
                bytes_per_token_in=4 * info.in_width + 4 + token_bytes,
                bytes_per_token_out=4 * info.out_width,
            ),
            artifacts=build.artifacts,
            security=Security(
                tls=self.config.tls is not None,
                client_certificates=self.config.tls is not None and self.config.tls.mutual,
            ),
            health=Health(
                uptime_seconds=load.uptime_seconds,
                recent_errors=load.recent_errors,
                total_errors=load.total_errors,
                window_seconds=load.window_seconds,
            ),
        )

    # -- engine thread -----------------------------------------------------------------------

    async def run_forward(
        self, frame: frames.ForwardFrame, deadline: float | None
    ) -> tuple[frames.FloatRows, int, int, int]:
        """Runs one decoded frame on the engine (thread, or the loop: ``inline_max_rows``);
        returns its output rows, the session's next position, and the ns it queued and
        computed. Raises the engine's refusal, or ``DGR_E_DEADLINE`` when the deadline passed
        while it queued. With co-batching, the frame runs in the next engine call together with
        other sessions' frames: its compute is its share of the call by rows, and the rest of
        the call counts as queueing (``worker/co_batch.py``)."""
        if self.co_batcher is not None:
            return await self.co_batcher.submit(frame, deadline)
        small = frame.n_rows <= self.config.inline_max_rows
        result = await self.run_on_engine(
            self._forward_job,
            frame,
            deadline,
            time.perf_counter_ns(),
            inline_ok=small and self.small_frame_ns <= self.config.inline_max_ms * 1e6,
        )
        if small:
            self.small_frame_ns = result[3]
        return result

    def _forward_job(
        self, frame: frames.ForwardFrame, deadline: float | None, enqueued_ns: int
    ) -> tuple[frames.FloatRows, int, int, int]:
        """On the engine thread: run the frame unless its deadline has passed."""
        started = time.perf_counter_ns()
        if deadline is not None and time.monotonic() >= deadline:
            raise expired_in_queue()
        self.meter.started()
        try:
            out, next_pos = self.table.forward(frame)
        finally:
            self.meter.stopped()
        return out, next_pos, started - enqueued_ns, time.perf_counter_ns() - started

    async def run_on_engine(
        self, job: Callable[..., _T], *args: Any, inline_ok: bool = False
    ) -> _T:
        """Runs ``job(*args)`` on the engine thread (queued behind earlier calls); with
        ``inline_ok``, on the calling loop instead when the engine thread is idle (nothing can
        be queued ahead of it then, and nothing can be queued while it runs: the loop is the
        only submitter)."""
        if inline_ok and self._engine_thread.idle:
            return job(*args)
        return await self._engine_thread.run(job, *args)
