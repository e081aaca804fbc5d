"""A route provider over worker processes it spawns itself: a local stand-in for the tracker.

* :class:`LoopbackRouteProvider` spawns ``dgr worker`` subprocesses on 127.0.0.1 for a layout
  (contiguous layer ranges), plus optional spares, and assigns routes from them as a tracker
  with honest failure reports would: a worker named by a failure report (dead, deadline,
  engine or protocol fault) is never routed to again, and its range goes to a spare, or to a
  worker spawned on demand (``spawn_on_demand``), or to nobody (then no route). It owns every
  process it started: :meth:`~LoopbackRouteProvider.aclose` stops them all (SIGCONT first for
  a stopped one), :meth:`~LoopbackRouteProvider.kill_all` is the synchronous last resort.

It checks every worker's certification against the client's own lock, not the worker's word:
its ``certification_verifier`` (default :class:`~dgr_engine.certification.verify.LockVerifier`
of the default lock) is what a ``SessionManager`` over it validates routes with.

Routing policy is the tracker's; this exists for the demo, ``dgr generate`` and the tests.
Every wait is bounded (worker start-up, ``Describe``, health checks, shutdown).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
from loguru import logger

from dgr_engine.certification.verify import LockVerifier
from dgr_engine.client.routes import describe
from dgr_engine.options import EngineOptions
from dgr_engine.security.grants import GrantIssuer
from dgr_engine.security.tls import ClientTls
from dgr_engine.tooling.processes import WorkerPlacement, WorkerProcess
from dgr_engine.wire.advert import Advert
from dgr_session.faults import FailureReport, FaultKind
from dgr_session.identifiers import log_field
from dgr_session.route import CertificationVerifier, Route, StageSpec

__all__ = ["LoopbackRouteProvider", "PooledWorker"]


def _silent(_text: str) -> None:
    """The default notice: nobody listens."""


def _counted(n: int, noun: str) -> str:
    """``1 worker``, ``3 workers``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


_BLAMED = frozenset(
    {FaultKind.DEAD, FaultKind.DEADLINE, FaultKind.ENGINE_ERROR, FaultKind.PROTOCOL}
)
"""Faults that disqualify the worker named by the report (never ``busy``, ``state_lost`` or
``client``: load, a cache miss, and a failure of the client's own making blame nobody)."""


@attrs.define(eq=False)
class PooledWorker:
    """One worker process of a :class:`LoopbackRouteProvider`."""

    process: WorkerProcess = attrs.field(repr=False)
    """The subprocess."""
    layers: tuple[int, int]
    """Owned range."""
    advert: Advert = attrs.field(repr=False)
    """Its advert at start-up."""
    role: str
    """``"primary"``, ``"spare"`` or ``"replacement"``."""
    excluded: str | None = None
    """Why it is no longer routed to (``None``: routable)."""

    @property
    def endpoint(self) -> str:
        """``HOST:PORT`` (``127.0.0.1:PORT`` unless placed elsewhere)."""
        return self.process.address

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stage(self) -> StageSpec:
        """This worker as a route stage."""
        return self.advert.stage_spec(self.endpoint)

    @property
    def running(self) -> bool:
        """The process has not exited (it may still be stopped or hung)."""
        return self.process.proc.poll() is None


class LoopbackRouteProvider:
    """A :class:`dgr_session.transport.RouteProvider` over worker subprocesses on loopback.

    ``layout``: the ranges of a route, in order, covering the model. ``spares``: extra workers
    to start with (a range may repeat). ``options``: the workers' engine options;
    ``worker_args``: further ``dgr worker`` arguments. ``observer(session_id, report, route)``
    is called with each request's answer (``route`` ``None``: no route); it must not raise.
    ``notice(text)`` hears what a slow step is doing, in one line each: workers starting
    (``starting 3 workers ...``) and ready (``3 workers ready in 2.1 s``), a replacement
    spawned on demand; a command routes it to its progress (stderr), the default drops it.
    Call ``await start()`` first; ``await aclose()`` at the end, in a ``finally`` (or
    ``async with``).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        layout: Sequence[tuple[int, int]],
        *,
        spares: Sequence[tuple[int, int]] = (),
        spawn_on_demand: bool = False,
        options: EngineOptions | None = None,
        worker_args: Sequence[str] = (),
        startup_timeout: float = 60.0,
        stop_timeout: float = 10.0,
        observer: Callable[[str, FailureReport | None, Route | None], None] | None = None,
        grants: GrantIssuer | None = None,
        client_tls: ClientTls | None = None,
        certification_verifier: CertificationVerifier | None = None,
        notice: Callable[[str], None] | None = None,
        placement: Callable[[int], WorkerPlacement] | None = None,
    ) -> None:
        if not layout:
            raise ValueError("a layout needs at least one range")
        self.certification_verifier = (
            certification_verifier if certification_verifier is not None else LockVerifier()
        )
        """Checks the workers' certifications against the client's lock (routes validated by a
        ``SessionManager`` over this provider)."""
        self.grants = grants
        """Signs every route's stages for its session and epoch (``None``: no grants)."""
        self.client_tls = client_tls
        """How the provider reaches its workers (their ``worker_args`` say what they serve)."""
        self.model = Path(model)
        self.layout = tuple((int(a), int(b)) for a, b in layout)
        self.spares = tuple((int(a), int(b)) for a, b in spares)
        self.spawn_on_demand = spawn_on_demand
        self.options = options if options is not None else EngineOptions()
        self.worker_args = tuple(worker_args)
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.observer = observer
        self.notice = notice if notice is not None else _silent
        """Hears what a slow step is doing (one line each)."""
        self.placement = placement
        """Where the n-th worker started runs (0: the first of the layout); ``None``: here,
        on loopback."""
        self._started = 0
        #: Every worker started, in start order (also those that died or were excluded).
        self.workers: list[PooledWorker] = []
        #: Every report received, in order.
        self.reports: list[FailureReport] = []
        #: Routes assigned, in order, as ``(session_id, route)``.
        self.assigned: list[tuple[str, Route]] = []
        # Serialises assignment: concurrent sessions that lost the same worker share one
        # replacement instead of spawning one each.
        self._lock = asyncio.Lock()
        # Every process started (list.append is atomic: threads add to it), stopped at the end.
        self._processes: list[WorkerProcess] = []
        self._closed = False
        self._log = logger.bind(stage="provider")

    def grant_route(self, session_id: str, epoch: int, route: Route) -> Route:
        """The route with the issuer's grants for ``(session_id, epoch)`` (unchanged without
        an issuer): the manager asks after every assignment."""
        return route if self.grants is None else self.grants.grant_route(session_id, epoch, route)

    async def __aenter__(self) -> LoopbackRouteProvider:
        await self.start()  # stops what it started if it fails
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- workers -------------------------------------------------------------------------------

    async def start(self) -> list[PooledWorker]:
        """Spawns the layout's workers and the spares, concurrently; returns them. If any fails
        to start, every process started so far is stopped before the error is raised."""
        jobs = [(r, "primary") for r in self.layout] + [(r, "spare") for r in self.spares]
        spares = f" and {_counted(len(self.spares), 'spare')}" if self.spares else ""
        self.notice(
            f"starting {_counted(len(jobs), 'worker')} ({_counted(len(self.layout), 'stage')}"
            f"{spares}) of {self.model.name} ..."
        )
        began = time.perf_counter()
        results = await asyncio.gather(
            *(self._start_one(r, role) for r, role in jobs), return_exceptions=True
        )
        started = [r for r in results if isinstance(r, PooledWorker)]
        self.workers.extend(started)  # in layout order: primaries are preferred to spares
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.aclose()
            raise errors[0]
        seconds = time.perf_counter() - began
        self.notice(f"{_counted(len(jobs), 'worker')} ready in {seconds:.1f} s")
        return started

    async def spawn(self, layers: tuple[int, int], role: str = "replacement") -> PooledWorker:
        """Starts one more worker for ``layers`` and reads its advert."""
        a, b = layers
        self.notice(f"starting a {role} worker for layers [{a},{b}) ...")
        began = time.perf_counter()
        worker = await self._start_one(layers, role)
        self.workers.append(worker)
        self.notice(f"{role} worker [{a},{b}) ready in {time.perf_counter() - began:.1f} s")
        return worker

    async def _start_one(self, layers: tuple[int, int], role: str) -> PooledWorker:
        if self._closed:
            raise RuntimeError("the provider is closed")
        n, self._started = self._started, self._started + 1  # before any wait: in start order
        where = self.placement(n) if self.placement is not None else WorkerPlacement()
        process = await asyncio.to_thread(self._spawn_process, layers, where)
        try:
            advert = await describe(
                process.address, timeout=self.startup_timeout, tls=self.client_tls
            )
        except BaseException:
            await asyncio.to_thread(process.kill)
            raise
        if self._closed:  # closed while it started: stop it too
            await asyncio.to_thread(process.stop, self.stop_timeout)
            raise RuntimeError("the provider is closed")
        worker = PooledWorker(process, layers, advert, role)
        self._log.info(
            "{} worker pid {} serves {} on {}", role, worker.pid, layers, worker.endpoint
        )
        return worker

    def _spawn_process(self, layers: tuple[int, int], where: WorkerPlacement) -> WorkerProcess:
        # On a worker thread. Recorded here, not by the awaiting task: if that task is
        # cancelled (Ctrl-C) while the worker starts, the process is still stopped at the end.
        process = WorkerProcess.spawn(
            self.model,
            layers,
            options=self.options,
            log_level="WARNING",
            extra_args=self.worker_args,
            startup_timeout=self.startup_timeout,
            host=where.host,
            runner=where.runner,
        )
        self._processes.append(process)
        return process

    def worker(self, endpoint: str) -> PooledWorker:
        """The worker at ``endpoint`` (``KeyError`` if none)."""
        for worker in self.workers:
            if worker.endpoint == endpoint:
                return worker
        raise KeyError(endpoint)

    def kill(self, endpoint: str) -> PooledWorker:
        """SIGKILLs the worker at ``endpoint`` (a crash: nothing is closed). Returns at once."""
        worker = self.worker(endpoint)
        if worker.running:
            worker.process.proc.send_signal(signal.SIGKILL)
        return worker

    def suspend(self, endpoint: str) -> PooledWorker:
        """SIGSTOPs the worker at ``endpoint`` (a hung stage); :meth:`aclose` resumes it."""
        worker = self.worker(endpoint)
        if worker.running:
            worker.process.proc.send_signal(signal.SIGSTOP)
        return worker

    def exclude(self, endpoint: str, why: str) -> None:
        """Never route to ``endpoint`` again."""
        worker = self.worker(endpoint)
        if worker.excluded is None:
            worker.excluded = why
            self._log.info("excluded {} {}: {}", worker.layers, endpoint, log_field(why))

    async def aclose(self) -> None:
        """Stops every worker started (SIGTERM, bounded wait, then SIGKILL). Idempotent."""
        self._closed = True
        await asyncio.gather(*(asyncio.to_thread(self._stop, p) for p in list(self._processes)))

    def kill_all(self) -> None:
        """Synchronous last resort (e.g. after the event loop is gone): stop every worker."""
        self._closed = True
        for process in list(self._processes):
            self._stop(process)

    def _stop(self, process: WorkerProcess) -> None:
        if process.proc.poll() is None:
            process.proc.send_signal(signal.SIGCONT)  # a stopped worker cannot handle SIGTERM
        process.stop(self.stop_timeout)

    def live_endpoint(self, layers: tuple[int, int]) -> str | None:
        """The endpoint of the worker a route takes for ``layers`` now: the first routable one
        whose process runs (``None``: none; a spawn on demand comes with the next route)."""
        for worker in self.workers:
            if worker.layers == layers and worker.excluded is None and worker.running:
                return worker.endpoint
        return None

    async def repair(self) -> None:
        """For each range of the layout no running worker serves, the exited ones excluded
        and, when spawning on demand, a replacement started (as the next route would)."""
        async with self._lock:
            for layers in self.layout:
                await self._routable(layers)

    # -- RouteProvider -------------------------------------------------------------------------

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        async with self._lock:
            if report is not None:
                self.reports.append(report)
                if report.endpoint is not None and report.fault in _BLAMED:
                    try:
                        self.exclude(report.endpoint, f"{report.fault.value}: {report.detail}")
                    except KeyError:
                        pass  # not one of ours
            busy = None
            if report is not None and report.fault is FaultKind.BUSY:
                busy = report.endpoint  # load, not a fault: try another worker first
            route = await self._route(session_id, avoid=busy)
            if route is not None:
                self.assigned.append((session_id, route))
            if self.observer is not None:
                self.observer(session_id, report, route)
            return route

    async def _route(self, session_id: str, avoid: str | None = None) -> Route | None:
        """A worker per range of the layout; for the range of ``avoid`` (a busy worker: load,
        not a fault), another worker when one is routable, else that one again."""
        stages: list[StageSpec] = []
        for layers in self.layout:
            worker = await self._routable(layers, avoid)
            if worker is None:
                log = self._log.bind(session=log_field(session_id))
                log.info("no route: nobody serves {}", layers)
                return None
            stages.append(worker.stage)
        return Route(stages)

    async def _routable(
        self, layers: tuple[int, int], avoid: str | None = None
    ) -> PooledWorker | None:
        fallback = None
        for worker in self.workers:
            if worker.layers != layers or worker.excluded is not None:
                continue
            if not worker.running:
                self.exclude(worker.endpoint, f"process exited ({worker.process.proc.returncode})")
                continue
            if worker.endpoint == avoid:
                fallback = worker
                continue
            return worker
        if fallback is not None:
            return fallback
        if not self.spawn_on_demand or self._closed:
            return None
        return await self.spawn(layers)
