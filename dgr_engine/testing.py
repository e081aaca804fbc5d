"""Test doubles of the data plane, for users' own suites (as ``trio.testing`` is).

* :class:`EngineTransport`: a :class:`~dgr_session.transport.StageTransport` over in-process
  ``ShardEngine``s with fault injection per endpoint (kill, hang, release, fail the next calls).
* :func:`write_truncated_copy`, :func:`write_corrupt_copy`: damaged GGUF files.

Production code never imports this module.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

import attrs
import numpy as np

from dgr_engine.engine import ShardEngine
from dgr_engine.errors import (
    EngineError,
    PositionMismatch,
    ShapeMismatch,
    StaleEpoch,
    UnknownSession,
)
from dgr_session.commands import Forward
from dgr_session.errors import StageDead
from dgr_session.route import StageSpec
from dgr_session.sampling import Sampling
from dgr_session.testing import ReplyGate
from dgr_session.transport import Boundary, Logits, StageResult, StageTransport

T = TypeVar("T")


class InjectedEngineError(EngineError):
    """An engine error injected by a test (``fail_next``)."""

    status = "DGR_E_INJECTED"


@attrs.define
class _Endpoint:
    engine: ShardEngine | None
    failures: int = 0
    gate: ReplyGate = attrs.Factory(ReplyGate)


class EngineTransport(StageTransport):
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

    async def open(
        self, stage: StageSpec, session_id: str, epoch: int, sampling: Sampling | None = None
    ) -> None:
        sid = self._sid(session_id)
        await self._call(stage, session_id, epoch, True, lambda e: e.open_session(sid, epoch))

    async def forward(self, call: Forward) -> StageResult:
        sid, epoch, boundary = self._sid(call.session_id), call.epoch, call.boundary
        pos = np.arange(call.positions.start, call.positions.stop, dtype=np.int32)
        tokens = np.asarray(call.token_ids, dtype=np.int32)
        # no logits wanted: no output row (the engine skips the output head)
        none = None if call.wants_logits else np.zeros(len(pos), dtype=np.uint8)
        if call.drafts:  # a verification pass: every row's logits
            none = np.ones(len(pos), dtype=np.uint8)

        def run(engine: ShardEngine) -> StageResult:
            info = engine.info
            rows = None if info.is_first else boundary
            if call.kept_drafts is not None:  # drop the drafts of the last pass not kept
                engine.truncate(sid, epoch, int(pos[0]))
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

        return await self._call(call.stage, call.session_id, epoch, True, run)

    async def close(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        sid = self._sid(session_id)

        def run(engine: ShardEngine) -> None:
            try:
                engine.close_session(sid, epoch)
            except (UnknownSession, StaleEpoch):
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
            except StaleEpoch as err:  # the engine names the epoch it holds, not the call's
                err.session_id, err.epoch = session_id, epoch
                error = err
            except (PositionMismatch, ShapeMismatch) as err:
                self.violations.append(f"{stage.endpoint} {session_id} epoch {epoch}: {err}")
                error = err
            except EngineError as err:
                error = err
        await ep.gate.pass_through(self.latency)
        if error is not None:
            raise error
        return result  # type: ignore[return-value]


# -- bad-input files ---------------------------------------------------------------------------

CorruptionKind = Literal["magic", "version", "tensor_count"]
"""How :func:`write_corrupt_copy` damages a GGUF header."""


def write_truncated_copy(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], keep_fraction: float
) -> Path:
    """Copy the first ``keep_fraction`` (0 < f < 1) of ``src``'s bytes to ``dst``."""
    if not 0.0 < keep_fraction < 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1), got {keep_fraction}")
    data = Path(src).read_bytes()
    dst = Path(dst)
    dst.write_bytes(data[: int(len(data) * keep_fraction)])
    return dst


def write_corrupt_copy(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], kind: CorruptionKind = "magic"
) -> Path:
    """Copy ``src`` to ``dst`` with a damaged header; the rest is unchanged.

    - ``magic``: the 4-byte ``GGUF`` magic becomes ``XXXX``.
    - ``version``: the format version becomes 0xFFFF (unsupported).
    - ``tensor_count``: the tensor count becomes 2**62 (more than the file can hold).
    """
    data = bytearray(Path(src).read_bytes())
    if data[:4] != b"GGUF":
        raise ValueError(f"{src} is not a GGUF file")
    if kind == "magic":
        data[0:4] = b"XXXX"
    elif kind == "version":
        data[4:8] = (0xFFFF).to_bytes(4, "little")
    elif kind == "tensor_count":
        data[8:16] = (1 << 62).to_bytes(8, "little")
    else:
        raise ValueError(f"unknown corruption kind {kind!r}")
    dst = Path(dst)
    dst.write_bytes(bytes(data))
    return dst
