"""The closes a worker makes through its session table, and those it makes by itself so that
slots always come back (``docs/worker.md``, "Slots always come back"):

* every close runs here, on the engine thread (:meth:`Housekeeping.close_session`; the
  client's ``CloseSession`` too), and wakes the admission line;
* **leases**: a session unused for the lease is closed, when the least recently used one's
  lease runs out (a sweeper task, bounded even if a close keeps failing);
* **stalls**: a watchdog ticks every stall/4; a tick a stall late means the process was
  stopped or starved, and every session unused since before the gap is closed unless used
  within the resume grace;
* **abandoned calls**: a call cancelled by its caller closes its session at that epoch, in
  the background.

The session table tells its listeners of each of these closes itself
(``worker/lifecycle/closes.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from dgr_engine.errors import StaleEpoch, UnknownSession
from dgr_engine.worker.engine_access.engine_thread import EngineThread
from dgr_engine.worker.lifecycle.admission import Admission
from dgr_engine.worker.lifecycle.closes import CloseCause
from dgr_engine.worker.lifecycle.sessions import SessionTable
from dgr_engine.worker.reporting.load import LoadMeter
from dgr_engine.worker.reporting.metrics import WorkerMetrics

if TYPE_CHECKING:
    from loguru import Logger


class Housekeeping:
    """One worker's closes. ``lease_seconds``: ``WorkerConfig.session_lease_seconds``
    (``None``: no lease); ``stall_seconds`` (0: no watchdog) and ``resume_grace_seconds``:
    the config's fields of those names. Used from one event loop only."""

    def __init__(
        self,
        table: SessionTable,
        engine_thread: EngineThread,
        admission: Admission,
        meter: LoadMeter,
        metrics: WorkerMetrics,
        log: Logger,
        *,
        lease_seconds: float | None,
        stall_seconds: float,
        resume_grace_seconds: float,
    ) -> None:
        self._table = table
        self._engine_thread = engine_thread
        self._admission = admission
        self._meter = meter
        self._metrics = metrics
        self._log = log
        self.lease_seconds = lease_seconds
        self.stall_seconds = stall_seconds
        self.resume_grace_seconds = resume_grace_seconds
        self.sessions_expired = 0
        """Sessions closed because their lease ran out."""
        self.sessions_reclaimed = 0
        """Sessions closed after a stall because nobody used them again (their clients moved
        on), or because a newer epoch's close named them, or a call of theirs was abandoned."""
        self.calls_abandoned = 0
        """Calls whose caller cancelled them (deadline passed, or gave up); each schedules a
        close of its session at that epoch."""
        self._tasks: list[asyncio.Task[None]] = []  # the sweeper and the watchdog, once started
        self._background: set[asyncio.Task[None]] = set()  # abandoned calls' closes
        self._finished = False  # the worker stopped: abandoned calls close nothing any more

    # -- closes --------------------------------------------------------------------------

    async def close_session(
        self, session_id: str, epoch: int, cause: CloseCause = CloseCause.CLIENT
    ) -> int:
        """Closes the session if open at ``epoch`` or older; returns the epoch closed."""
        try:
            closed = await self._engine_thread.run(self._table.close, session_id, epoch, cause)
        finally:
            self._admission.changed()
        if closed < epoch:
            self.sessions_reclaimed += 1
        return closed

    def abandon(self, session_id: str, epoch: int, why: str) -> None:
        """A call of ``(session_id, epoch)`` was cancelled by its caller (its deadline passed,
        or it gave up): a dgr client never uses an epoch again after a failed call, so the
        session is closed here at that epoch (not a newer one), in the background."""
        log = self._log.bind(session=session_id, epoch=epoch)

        async def close() -> None:
            try:
                closed = await self.close_session(session_id, epoch, CloseCause.ABANDONED)
            except (UnknownSession, StaleEpoch):
                return  # already gone, or a newer epoch holds the slot
            except Exception as exc:  # noqa: BLE001 - logged; the lease still bounds it
                log.error("closing an abandoned session failed: {!r}", exc)
                return
            if closed == epoch:  # an older epoch is counted by close_session
                self.sessions_reclaimed += 1
            log.warning("session closed: {} by its client (it gave up on this epoch)", why)

        self.calls_abandoned += 1
        if not self._finished:
            task = asyncio.get_running_loop().create_task(close(), name="dgr-abandoned-close")
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def expire_idle_sessions(self) -> list[tuple[str, int]]:
        """Closes (on the engine thread) every session unused for the lease or longer; returns
        their ``(session_id, epoch)``. While serving, the sweeper calls this itself when the
        oldest session's lease runs out."""
        lease = self.lease_seconds
        if lease is None:
            return []
        sweep = await self._engine_thread.run(self._table.expire_idle, lease)
        for session_id, epoch in sweep.closed:
            self._log.bind(session=session_id, epoch=epoch).warning(
                "session closed: unused for {} s (its lease ran out)", lease
            )
        for session_id, epoch, exc in sweep.failed:
            self._meter.error()
            self._log.bind(session=session_id, epoch=epoch).error(
                "session lease ran out but closing it failed: {}", exc
            )
        self.sessions_expired += len(sweep.closed)
        self._metrics.lease_expiries.inc(len(sweep.closed))
        self._admission.changed()
        return sweep.closed

    async def _reclaim_unused_since(self, since: float) -> None:
        try:
            sweep = await self._engine_thread.run(self._table.expire_unused_since, since)
        except Exception as exc:  # noqa: BLE001 - the watchdog must outlive one bad sweep
            self._meter.error()
            self._log.opt(exception=exc).error("closing sessions after a stall failed: {!r}", exc)
            return
        self._admission.changed()
        for session_id, epoch in sweep.closed:
            self._log.bind(session=session_id, epoch=epoch).warning(
                "session closed: unused since before a stall (its client moved on)"
            )
        for session_id, epoch, error in sweep.failed:
            self._meter.error()
            self._log.bind(session=session_id, epoch=epoch).error(
                "closing a session unused since a stall failed: {}", error
            )
        self.sessions_reclaimed += len(sweep.closed)

    # -- the tasks that watch ----------------------------------------------------------------

    def start(self) -> None:
        """Starts the lease sweeper and the stall watchdog (those configured) on this loop."""
        loop = asyncio.get_running_loop()
        if self.lease_seconds is not None:
            sweeper = self._sweep_leases(self.lease_seconds)
            self._tasks.append(loop.create_task(sweeper, name="dgr-session-leases"))
        if self.stall_seconds > 0:
            watchdog = self._watch_for_stalls()
            self._tasks.append(loop.create_task(watchdog, name="dgr-stall-watchdog"))

    async def stop_watching(self) -> None:
        """Cancels the sweeper and the watchdog (abandoned calls still close)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def finish(self) -> None:
        """Waits for the abandoned calls' closes; afterwards they close nothing."""
        await asyncio.gather(*self._background, return_exceptions=True)
        self._finished = True

    async def _watch_for_stalls(self) -> None:
        # Ticks every stall/4; a tick that comes a stall late means the process was stopped
        # (SIGSTOP) or starved. Every session unused since before the gap is then closed unless
        # used within the resume grace: its client hit its step deadline while we were gone.
        stall, grace = self.stall_seconds, self.resume_grace_seconds
        clock = self._table.clock
        last = clock()
        while True:
            await asyncio.sleep(stall / 4)
            now = clock()
            if now - last >= stall:
                self._log.warning(
                    "stalled for {:.1f} s: sessions unused since are closed in {} s unless used",
                    now - last,
                    grace,
                )
                await asyncio.sleep(grace)
                await self._reclaim_unused_since(last)
                now = clock()
            last = now

    async def _sweep_leases(self, lease: float) -> None:
        # Wakes when the least recently used session's lease runs out (a lease at most when
        # none is open), and never more often than every lease/16 (bounded even if a close
        # keeps failing).
        pause = min(lease / 16, 1.0)
        while True:
            oldest = self._table.oldest_use()
            due = lease if oldest is None else oldest + lease - self._table.clock()
            await asyncio.sleep(max(due, pause))
            try:
                await self.expire_idle_sessions()
            except Exception as exc:  # noqa: BLE001 - the sweeper must outlive one bad sweep
                self._meter.error()
                self._log.opt(exception=exc).error("session lease sweep failed: {!r}", exc)
