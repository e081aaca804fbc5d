"""A stage transport over :class:`~dgr_session.testing.fake_model.FakeModel` with per-endpoint
fault injection: kill, hang, release (late replies), fail the next calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import attrs

from dgr_session.commands import Forward
from dgr_session.errors import DgrError, StageDead, StaleEpoch
from dgr_session.route import StageSpec
from dgr_session.sampling import Sampling
from dgr_session.testing.fake_model import FakeModel
from dgr_session.testing.reply_gate import ReplyGate
from dgr_session.transport import Boundary, Logits, StageResult, StageTransport

T = TypeVar("T")


class FakeEngineError(DgrError):
    """What a fake stage raises for a refused operation (like an engine status code)."""


@attrs.frozen
class Call:
    """One call received by the fake transport (recorded when ``record=True``)."""

    op: str
    """``"open"``, ``"forward"`` or ``"close"``."""
    endpoint: str
    """Stage endpoint."""
    session_id: str
    """Session."""
    epoch: int
    """Epoch."""
    step: int | None = None
    """Step (forward only)."""
    positions: range | None = None
    """Positions (forward only)."""
    token_ids: tuple[int, ...] = ()
    """Token ids (forward only)."""
    layers: tuple[int, int] = (0, 0)
    """Layer range of the stage addressed."""
    want_logits: bool = True
    """Whether the forward asked for logits (forward only)."""


@attrs.define
class _Sequence:
    # One session's state on one stage. Invariant: states[i] is layer (begin + i)'s state after
    # positions [0, n_pos) of this epoch.
    epoch: int
    begin: int
    end: int
    states: list[int]
    n_pos: int = 0


@attrs.define
@attrs.define
class _Stage:
    alive: bool = True
    failures: int = 0  # the next `failures` open/forward calls raise FakeEngineError
    sessions: dict[str, _Sequence] = attrs.Factory(dict)
    gate: ReplyGate = attrs.Factory(ReplyGate)


class FakeTransport(StageTransport):
    """:class:`~dgr_session.transport.StageTransport` over :class:`FakeModel` with faults.

    Endpoints are created on first use. Every call is applied when it is made (state changes at
    once); a *hanging* endpoint then holds the reply until :meth:`release` (a late reply) or
    :meth:`kill` (the connection drops: :class:`~dgr_session.errors.StageDead`).
    """

    def __init__(self, model: FakeModel, *, latency: float = 0.0, record: bool = False) -> None:
        self.model = model
        #: Seconds (loop clock) each reply takes; killing the worker meanwhile fails the call.
        self.latency = latency
        self._stages: dict[str, _Stage] = {}
        #: Calls received, in order (only when ``record``).
        self.calls: list[Call] = []
        #: Requests no correct driver sends (duplicate open, positions that do not continue the
        #: KV, wrong layers or row counts), as error texts. Faults injected here never land here.
        self.violations: list[str] = []
        self._record = record

    # -- fault injection ---------------------------------------------------------------------

    def kill(self, endpoint: str) -> None:
        """The worker dies: its sessions are lost, held replies fail, calls raise StageDead."""
        stage = self._stage(endpoint)
        stage.alive = False
        stage.sessions.clear()
        stage.gate.fail(StageDead(f"{endpoint}: connection lost"))

    def hang(self, endpoint: str) -> None:
        """Replies from ``endpoint`` are held until :meth:`release` or :meth:`kill`."""
        self._stage(endpoint).gate.hanging = True

    def release(self, endpoint: str) -> None:
        """Stop hanging; held replies are delivered now (late)."""
        self._stage(endpoint).gate.release()

    def revive(self, endpoint: str) -> None:
        """Bring a killed worker back (empty) or release a hanging one."""
        stage = self._stage(endpoint)
        stage.alive = True
        self.release(endpoint)

    def fail_next(self, endpoint: str, count: int = 1) -> None:
        """The next ``count`` open/forward calls to ``endpoint`` raise an engine error."""
        self._stage(endpoint).failures += count

    # -- introspection -----------------------------------------------------------------------

    def healthy(self, endpoint: str) -> bool:
        """Alive and not hanging."""
        stage = self._stage(endpoint)
        return stage.alive and not stage.gate.hanging

    def alive(self, endpoint: str) -> bool:
        """Not killed."""
        return self._stage(endpoint).alive

    def slots(self) -> dict[tuple[str, str], int]:
        """Open sequences: ``(endpoint, session_id) -> epoch``."""
        return {
            (endpoint, sid): seq.epoch
            for endpoint, stage in self._stages.items()
            for sid, seq in stage.sessions.items()
        }

    def held_replies(self, endpoint: str | None = None) -> int:
        """Replies not delivered yet (held by hanging endpoints or in transit)."""
        stages = self._stages.values() if endpoint is None else [self._stage(endpoint)]
        return sum(stage.gate.pending() for stage in stages)

    # -- StageTransport ----------------------------------------------------------------------

    async def open(
        self, stage: StageSpec, session_id: str, epoch: int, sampling: Sampling | None = None
    ) -> None:
        self._log(Call("open", stage.endpoint, session_id, epoch, layers=_layers(stage)))
        await self._call(stage, True, lambda st: self._open(st, stage, session_id, epoch))

    async def forward(self, call: Forward) -> StageResult:
        stage, ids = call.stage, tuple(call.token_ids)
        self._log(
            Call(
                "forward",
                stage.endpoint,
                call.session_id,
                call.epoch,
                call.step,
                call.positions,
                ids,
                _layers(stage),
                call.wants_logits,
            )
        )

        def forward(st: _Stage) -> StageResult:
            result = self._forward(
                st, stage, call.session_id, call.epoch, call.positions, ids, call.boundary
            )
            return result if call.wants_logits or isinstance(result, Boundary) else Logits(())

        return await self._call(stage, True, forward)

    async def close(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        self._log(Call("close", stage.endpoint, session_id, epoch, layers=_layers(stage)))
        await self._call(stage, False, lambda st: self._close(st, session_id, epoch))

    # -- internals ---------------------------------------------------------------------------

    def _stage(self, endpoint: str) -> _Stage:
        stage = self._stages.get(endpoint)
        if stage is None:
            stage = self._stages[endpoint] = _Stage()
        return stage

    def _log(self, call: Call) -> None:
        if self._record:
            self.calls.append(call)

    async def _call(self, spec: StageSpec, may_fail: bool, apply: Callable[[_Stage], T]) -> T:
        stage = self._stage(spec.endpoint)
        if not stage.alive:
            raise StageDead(f"{spec.endpoint}: unreachable")
        result: T | None = None
        error: BaseException | None = None
        if may_fail and stage.failures > 0:
            stage.failures -= 1
            error = FakeEngineError(f"{spec.endpoint}: injected engine error")
        else:
            try:
                result = apply(stage)
            except DgrError as err:
                error = err
        await stage.gate.pass_through(self.latency)
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    def _open(self, stage: _Stage, spec: StageSpec, sid: str, epoch: int) -> None:
        held = stage.sessions.get(sid)
        if held is not None and epoch < held.epoch:
            raise StaleEpoch(
                f"open of epoch {epoch}, holding {held.epoch}",
                session_id=sid,
                epoch=epoch,
                held_epoch=held.epoch,
            )
        if held is not None and epoch == held.epoch:
            raise self._violation(f"session {sid!r} epoch {epoch} already open")
        states = [self.model.seed(layer) for layer in range(spec.layer_begin, spec.layer_end)]
        stage.sessions[sid] = _Sequence(epoch, spec.layer_begin, spec.layer_end, states)

    def _forward(
        self,
        stage: _Stage,
        spec: StageSpec,
        sid: str,
        epoch: int,
        positions: range,
        token_ids: tuple[int, ...],
        boundary: object | None,
    ) -> StageResult:
        seq = stage.sessions.get(sid)
        if seq is not None and epoch < seq.epoch:
            raise StaleEpoch(
                f"forward for epoch {epoch}, holding {seq.epoch}",
                session_id=sid,
                epoch=epoch,
                held_epoch=seq.epoch,
            )
        if seq is None or epoch != seq.epoch:
            raise FakeEngineError(f"session {sid!r} epoch {epoch} is not open")
        if (seq.begin, seq.end) != (spec.layer_begin, spec.layer_end):
            raise self._violation(f"layers {_layers(spec)} but opened {(seq.begin, seq.end)}")
        n = len(positions)
        if positions.step != 1 or positions.start != seq.n_pos or n == 0:
            raise self._violation(
                f"positions {positions} do not continue the KV (next position {seq.n_pos})"
            )
        if len(token_ids) != n:
            raise self._violation(f"{len(token_ids)} token ids for {n} positions")
        if spec.layer_begin == 0:
            xs = [self.model.embed(token) for token in token_ids]
        else:
            if not isinstance(boundary, tuple) or len(boundary) != n:
                raise self._violation(f"boundary rows {boundary!r} do not match {n} positions")
            xs = list(boundary)
        model = self.model
        states = seq.states
        out = []
        for j, position in enumerate(positions):
            x = xs[j]
            token = token_ids[j]
            for i, layer in enumerate(range(seq.begin, seq.end)):
                states[i], x = model.layer(layer, states[i], x, position, token)
            out.append(x)
        seq.n_pos += n
        if spec.layer_end == model.n_layer:
            return Logits(model.logits(out[-1]))
        return Boundary(tuple(out))

    def _violation(self, message: str) -> FakeEngineError:
        self.violations.append(message)
        return FakeEngineError(message)

    @staticmethod
    def _close(stage: _Stage, sid: str, epoch: int) -> None:
        held = stage.sessions.get(sid)
        if held is not None and held.epoch <= epoch:
            del stage.sessions[sid]


def _layers(spec: StageSpec) -> tuple[int, int]:
    return (spec.layer_begin, spec.layer_end)
