"""A :class:`dgr_session.transport.StageTransport` over in-process ``ShardEngine``s.

The same route sessions that run over gRPC workers run here with no network: each endpoint
names one engine (``inproc://...``), and faults are injected per endpoint - kill (the worker and
its state are gone), hang (replies are computed, then held past any deadline; released late or
dropped), fail the next calls with an engine error. Engine calls run on the event loop thread:
the tiny fixtures take well under a millisecond, and it keeps test runs deterministic.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
import numpy as np

from dgr_engine.engine import ShardEngine
from dgr_engine.errors import EngineError, PositionMismatch, ShapeMismatch, UnknownSession
from dgr_engine.errors import StaleEpoch as EngineStaleEpoch
from dgr_session.errors import StageDead, StaleEpoch
from dgr_session.route import StageSpec
from dgr_session.testing import ReplyGate
from dgr_session.transport import Boundary, Logits, StageResult

T = TypeVar("T")


class InjectedEngineError(EngineError):
    """An engine error injected by a test (``fail_next``)."""

    status = "DGR_E_INJECTED"


@attrs.define
class _Endpoint:
    engine: ShardEngine | None
    failures: int = 0
    gate: ReplyGate = attrs.Factory(ReplyGate)


class EngineTransport:
    """Stage transport over in-process engines with fault injection.

    ``factory(begin, end)`` makes a fresh engine for a layer range; it is used to (re)start an
    endpoint's worker. Session ids (strings in dgr_session) map to engine ids (integers) once,
    for the transport's lifetime.
    """

    def __init__(self, factory: Callable[[int, int], ShardEngine], *, latency: float = 0.0) -> None:
        self._factory = factory
        #: Seconds (loop clock) each reply takes, so that faults can land while calls are in
        #: flight; killing the worker meanwhile fails the call.
        self.latency = latency
        self._endpoints: dict[str, _Endpoint] = {}
        self._ranges: dict[str, tuple[int, int]] = {}
        self._ids: dict[str, int] = {}
        self._next_id = itertools.count(1)
        #: Requests a correct driver never sends, as the engines refused them: positions that
        #: do not continue an epoch's KV from 0 (the Petals bug), rows of the wrong shape.
        self.violations: list[str] = []

    # -- workers -----------------------------------------------------------------------------

    def start(self, endpoint: str, layers: tuple[int, int]) -> None:
        """Starts (or restarts, empty) the worker at ``endpoint`` for ``layers``."""
        old = self._endpoints.get(endpoint)
        if old is not None and old.engine is not None:
            old.engine.close()
        self._endpoints[endpoint] = _Endpoint(self._factory(*layers))
        self._ranges[endpoint] = layers

    def kill(self, endpoint: str) -> None:
        """The worker dies: its engine and every session's state are gone; held replies fail."""
        ep = self._endpoints[endpoint]
        if ep.engine is not None:
            ep.engine.close()
        ep.engine = None
        ep.gate.fail(StageDead(f"{endpoint}: connection lost"))

    def revive(self, endpoint: str) -> None:
        """A killed worker restarts with no state; a hanging one stops hanging (late replies)."""
        ep = self._endpoints[endpoint]
        if ep.engine is None:
            self.start(endpoint, self._ranges[endpoint])
        else:
            self.release(endpoint)

    def hang(self, endpoint: str) -> None:
        """Replies from ``endpoint`` are held until :meth:`release` or :meth:`kill`."""
        self._endpoints[endpoint].gate.hanging = True

    def release(self, endpoint: str) -> None:
        """Held replies are delivered now (late; the session drops those of an old epoch)."""
        self._endpoints[endpoint].gate.release()

    def fail_next(self, endpoint: str, count: int = 1) -> None:
        """The next ``count`` open/forward calls to ``endpoint`` raise an engine error."""
        self._endpoints[endpoint].failures += count

    def alive(self, endpoint: str) -> bool:
        return self._endpoints[endpoint].engine is not None

    def engines(self) -> dict[str, ShardEngine]:
        """Live engines by endpoint."""
        return {e: ep.engine for e, ep in self._endpoints.items() if ep.engine is not None}

    def shutdown(self) -> None:
        """Stops every worker."""
        for endpoint in list(self._endpoints):
            self.kill(endpoint)

    # -- StageTransport ----------------------------------------------------------------------

    async def open(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        sid = self._sid(session_id)
        await self._call(stage, session_id, epoch, True, lambda e: e.open_session(sid, epoch))

    async def forward(
        self,
        stage: StageSpec,
        session_id: str,
        epoch: int,
        step: int,
        positions: range,
        token_ids: Sequence[int],
        boundary: object | None,
        *,
        want_logits: bool = True,
    ) -> StageResult:
        sid = self._sid(session_id)
        pos = np.arange(positions.start, positions.stop, dtype=np.int32)
        tokens = np.asarray(token_ids, dtype=np.int32)
        # no logits wanted: no output row (the engine skips the output head)
        none = None if want_logits else np.zeros(len(pos), dtype=np.uint8)

        def run(engine: ShardEngine) -> StageResult:
            info = engine.info
            rows = None if info.is_first else boundary
            out = engine.forward(
                sid,
                epoch,
                pos,
                tokens=tokens if info.needs_token_ids else None,
                rows=rows,  # type: ignore[arg-type]
                want=none if info.is_last else None,
            )
            if not info.is_last:
                return Boundary(out)
            return Logits.last_row(out)

        return await self._call(stage, session_id, epoch, True, run)

    async def close(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        sid = self._sid(session_id)

        def run(engine: ShardEngine) -> None:
            try:
                engine.close_session(sid, epoch)
            except (UnknownSession, EngineStaleEpoch):
                pass  # not held (or a newer epoch is): nothing to release

        await self._call(stage, session_id, epoch, False, run)

    # -- internals ---------------------------------------------------------------------------

    def _sid(self, session_id: str) -> int:
        if session_id not in self._ids:
            self._ids[session_id] = next(self._next_id)
        return self._ids[session_id]

    async def _call(
        self,
        stage: StageSpec,
        session_id: str,
        epoch: int,
        may_fail: bool,
        apply: Callable[[ShardEngine], T],
    ) -> T:
        ep = self._endpoints.get(stage.endpoint)
        if ep is None or ep.engine is None:
            raise StageDead(f"{stage.endpoint}: unreachable")
        if ep.engine.info.layers != (stage.layer_begin, stage.layer_end):
            raise StageDead(f"{stage.endpoint}: serves {ep.engine.info.layers}, not the route's")
        result: T | None = None
        error: BaseException | None = None
        if may_fail and ep.failures > 0:
            ep.failures -= 1
            error = InjectedEngineError(f"{stage.endpoint}: injected engine error")
        else:
            try:
                result = apply(ep.engine)
            except EngineStaleEpoch as err:
                error = StaleEpoch(
                    str(err),
                    session_id=session_id,
                    epoch=epoch,
                    held_epoch=err.held_epoch if err.held_epoch is not None else epoch + 1,
                )
            except (PositionMismatch, ShapeMismatch) as err:
                self.violations.append(f"{stage.endpoint} {session_id} epoch {epoch}: {err}")
                error = err
            except EngineError as err:
                error = err
        await ep.gate.pass_through(self.latency)
        if error is not None:
            raise error
        return result  # type: ignore[return-value]
