"""In-process fakes for tests and benchmarks (not imported by ``dgr_session``).

* :class:`FakeModel`: a deterministic stand-in for a layered model. Each layer keeps a running
  digest per session (its "KV"), so outputs depend on the whole history, on positions being
  continued exactly, and on every layer seeing every token once: any KV mix-up, skipped or
  repeated position changes the tokens. Cut points do not: chaining stages equals one stage.
  :meth:`FakeModel.reference` is the trivially correct whole-model greedy run.
* :class:`FakeTransport`: a :class:`~dgr_session.transport.StageTransport` over the fake model
  with per-``(session, epoch)`` state per endpoint and fault injection: kill, hang (replies are
  computed, then held), release (held replies arrive late), fail the next calls.
* :class:`ReplyGate`: the hang / release / latency machinery of an endpoint, shared with
  ``dgr_engine.engine_transport.EngineTransport`` (the same faults over real engines).
* :class:`PoolRouteProvider` and :class:`ScriptedRouteProvider`: route providers for tests.
* :class:`NullTransport`: answers at once with constant results (benchmarks).
* :class:`VirtualClockLoop`: an asyncio loop whose clock jumps to the next timer whenever
  nothing is ready, so deadlines fire without real waiting and runs are deterministic;
  :func:`settle` runs everything ready without moving the clock.
"""

from __future__ import annotations

import asyncio
import hashlib
import selectors
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from dgr_session.errors import DgrError, StageDead, StaleEpoch
from dgr_session.faults import FailureReport
from dgr_session.identity import CertificationStatus, EvidenceClass, Lane, ModelIdentity, Recipe
from dgr_session.route import Route, StageSpec
from dgr_session.sampling import greedy
from dgr_session.transport import Boundary, Logits, StageResult

T = TypeVar("T")

_MASK = (1 << 61) - 1


def _mix(*parts: int) -> int:
    # Hashes of int tuples are deterministic across processes (no hash randomisation for ints).
    return hash(parts) & _MASK


# ------------------------------------------------------------------------------------------------
# The fake model


@attrs.frozen
class FakeModel:
    """A deterministic layered "model" with per-layer state, vocabulary ``vocab``."""

    n_layer: int = 6
    """Number of layers."""
    vocab: int = 32
    """Vocabulary size (length of the logits)."""
    width: int = 16
    """Boundary width advertised by stages (the rows themselves are ints, one per token)."""
    hash_layers: int = 2
    """Layers below this index also read the token id (like V4's hash-routed layers), so later
    stages holding them need the token-id sideband."""

    def embed(self, token: int) -> int:
        """Input of layer 0 for ``token``."""
        return _mix(-1, token)

    def seed(self, layer: int) -> int:
        """A layer's state before any position."""
        return _mix(-2, layer)

    def layer(self, layer: int, state: int, x: int, position: int, token: int) -> tuple[int, int]:
        """One layer at one position: ``(new state, output)``."""
        if layer < self.hash_layers:
            state = _mix(layer, state, x, position, token)
        else:
            state = _mix(layer, state, x, position)
        return state, _mix(layer, state)

    def logits(self, x: int) -> list[float]:
        """Logits from the last layer's output."""
        return [float(_mix(x, i) % 1_000_003) for i in range(self.vocab)]

    def reference(
        self, prompt: Sequence[int], max_new_tokens: int, stop_tokens: Iterable[int] = ()
    ) -> tuple[int, ...]:
        """Fault-free whole-model greedy generation (the oracle)."""
        stops = frozenset(stop_tokens)
        states = [self.seed(layer) for layer in range(self.n_layer)]
        history = list(prompt)
        out: list[int] = []
        fed = 0
        while True:
            x = 0
            for position in range(fed, len(history)):
                token = history[position]
                x = self.embed(token)
                for layer in range(self.n_layer):
                    states[layer], x = self.layer(layer, states[layer], x, position, token)
            fed = len(history)
            token = greedy(self.logits(x))
            out.append(token)
            history.append(token)
            if token in stops or len(out) >= max_new_tokens:
                return tuple(out)


# ------------------------------------------------------------------------------------------------
# Fixture values


def fixture_identity(n_layer: int) -> ModelIdentity:
    """Model identity of the fake model with ``n_layer`` layers."""
    digest = hashlib.blake2b(f"dgr-fake-model/{n_layer}".encode(), digest_size=32).digest()
    return ModelIdentity(content_hash=digest, arch="fake", n_layer=n_layer)


def fixture_recipe(context: int = 4096) -> Recipe:
    """Recipe of the fake model."""
    return Recipe(quant_types=("F32",), context=context, kv_type="f32")


def fixture_lane(certified: bool = True) -> Lane:
    """A CPU lane, certified with fixture evidence (or dark)."""
    return Lane(
        backend="cpu",
        llama_cpp_commit="0" * 40,
        patch_stack_hash=b"\x00" * 8,
        dgr_version="0.1.0",
        hardware="fake",
        certification=CertificationStatus.CERTIFIED if certified else CertificationStatus.DARK,
        evidence=EvidenceClass.FIXTURE if certified else None,
    )


def make_route(
    endpoints: Sequence[str],
    cuts: Sequence[int],
    *,
    identity: ModelIdentity,
    recipe: Recipe | None = None,
    lane: Lane | None = None,
    width: int = 16,
) -> Route:
    """A route over ``endpoints`` split at the interior layer indices ``cuts``."""
    bounds = [0, *cuts, identity.n_layer]
    if len(endpoints) != len(bounds) - 1:
        raise ValueError(f"{len(cuts)} cuts need {len(bounds) - 1} endpoints, got {len(endpoints)}")
    last = len(endpoints) - 1
    return Route(
        StageSpec(
            endpoint=endpoint,
            layer_begin=bounds[i],
            layer_end=bounds[i + 1],
            identity=identity,
            recipe=recipe if recipe is not None else fixture_recipe(),
            lane=lane if lane is not None else fixture_lane(),
            boundary_in=0 if i == 0 else width,
            boundary_out=0 if i == last else width,
        )
        for i, endpoint in enumerate(endpoints)
    )


# ------------------------------------------------------------------------------------------------
# The fake transport


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
class ReplyGate:
    """Holds one endpoint's replies, for test transports: while the endpoint *hangs*, until
    :meth:`release` (delivered late) or :meth:`fail` (the connection drops); otherwise for the
    transport's latency in loop time (a reply still waits if the endpoint hangs meanwhile)."""

    hanging: bool = False
    """Replies are held until released or failed."""
    _held: list[asyncio.Future[None]] = attrs.Factory(list)

    async def pass_through(self, latency: float) -> None:
        """Returns when the reply may be delivered; raises what :meth:`fail` was given."""
        if not self.hanging and latency <= 0:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._held.append(future)
        if not self.hanging:
            loop.call_later(latency, self._deliver, future)
        await future

    def release(self) -> None:
        """Stop hanging; held replies are delivered now (late)."""
        self.hanging = False
        for future in self._held:
            if not future.done():
                future.set_result(None)
        self._held.clear()

    def fail(self, error: BaseException) -> None:
        """Stop hanging; held replies fail with ``error``."""
        self.hanging = False
        for future in self._held:
            if not future.done():
                future.set_exception(error)
        self._held.clear()

    def pending(self) -> int:
        """Replies not delivered yet."""
        return sum(1 for future in self._held if not future.done())

    def _deliver(self, future: asyncio.Future[None]) -> None:
        # The latency elapsed: deliver, unless the endpoint hangs now (then it waits for release).
        if not future.done() and not self.hanging:
            future.set_result(None)
            self._held.remove(future)


@attrs.define
class _Stage:
    alive: bool = True
    failures: int = 0  # the next `failures` open/forward calls raise FakeEngineError
    sessions: dict[str, _Sequence] = attrs.Factory(dict)
    gate: ReplyGate = attrs.Factory(ReplyGate)


class FakeTransport:
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

    async def open(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        self._log(Call("open", stage.endpoint, session_id, epoch, layers=_layers(stage)))
        await self._call(stage, True, lambda st: self._open(st, stage, session_id, epoch))

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
        ids = tuple(token_ids)
        self._log(
            Call(
                "forward",
                stage.endpoint,
                session_id,
                epoch,
                step,
                positions,
                ids,
                _layers(stage),
                want_logits,
            )
        )

        def forward(st: _Stage) -> StageResult:
            result = self._forward(st, stage, session_id, epoch, positions, ids, boundary)
            return result if want_logits or isinstance(result, Boundary) else Logits(())

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


# ------------------------------------------------------------------------------------------------
# Route providers


class PoolRouteProvider:
    """Builds routes from a pool of workers, as a tracker with perfect health knowledge would.

    Request *n* uses layout ``layouts[n % len(layouts)]`` (interior cut points) and puts each
    stage on the next healthy worker (rotating, distinct within a route). ``None`` when too few
    workers are healthy.
    """

    def __init__(
        self,
        transport: FakeTransport,
        workers: Sequence[str],
        layouts: Sequence[Sequence[int]],
        *,
        identity: ModelIdentity,
        width: int = 16,
    ) -> None:
        self._transport = transport
        self._workers = tuple(workers)
        self._layouts = tuple(tuple(cuts) for cuts in layouts)
        self._identity = identity
        self._width = width
        self._requests = 0
        #: Every report received, in order.
        self.reports: list[FailureReport] = []

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        if report is not None:
            self.reports.append(report)
        n = self._requests
        self._requests += 1
        cuts = self._layouts[n % len(self._layouts)]
        count = len(self._workers)
        healthy = [
            self._workers[(n + k) % count]
            for k in range(count)
            if self._transport.healthy(self._workers[(n + k) % count])
        ]
        if len(healthy) < len(cuts) + 1:
            return None
        return make_route(
            healthy[: len(cuts) + 1], cuts, identity=self._identity, width=self._width
        )


HANG = "hang"
"""In a :class:`ScriptedRouteProvider` script: never answer this request."""


class ScriptedRouteProvider:
    """Answers route requests from a script, in order: a route, ``None`` (no route), or
    :data:`HANG` (never answers). After the script, answers with the last entry (or ``None``)."""

    def __init__(self, script: Sequence[Route | None | str]) -> None:
        self._script = list(script)
        self._index = 0
        #: ``(session_id, report)`` per request, in order.
        self.requests: list[tuple[str, FailureReport | None]] = []

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        self.requests.append((session_id, report))
        if not self._script:
            return None
        entry = self._script[min(self._index, len(self._script) - 1)]
        self._index += 1
        if entry == HANG:
            await asyncio.get_running_loop().create_future()  # cancelled when the session ends
        if isinstance(entry, Route):
            return entry
        return None


# ------------------------------------------------------------------------------------------------
# A transport that does nothing (benchmarks)


class NullTransport:
    """Answers every call at once with constant results (token 0). When :attr:`gate` is set,
    forwards wait for it first, which parks every session mid-step."""

    _BOUNDARY = Boundary(None)
    _LOGITS = Logits((1.0, 0.0))

    def __init__(self) -> None:
        #: Forwards await this future while it is set.
        self.gate: asyncio.Future[None] | None = None

    async def open(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        return None

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
        if self.gate is not None:
            await self.gate
        return self._BOUNDARY if stage.boundary_out else self._LOGITS

    async def close(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        return None


class FixedRouteProvider:
    """Always answers with the same route."""

    def __init__(self, route: Route) -> None:
        self.route = route

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        return self.route


# ------------------------------------------------------------------------------------------------
# Virtual time


class _AutojumpSelector(selectors.BaseSelector):
    """Delegates to a real selector, but never blocks: when the loop would wait ``timeout``
    seconds for a timer, the virtual clock jumps by ``timeout`` instead."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        self._inner = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._inner.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("deadlock: the event loop would wait forever (nothing scheduled)")
        self._loop.advance(timeout)
        return ready

    def close(self) -> None:
        self._inner.close()

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.get_key(fileobj)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._inner.get_map()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time that jumps to the next timer whenever nothing is ready.

    Work that is ready always runs before time moves, so "let ``dt`` seconds pass" is
    ``loop.run_until_complete(asyncio.sleep(dt))``. A wait with nothing scheduled raises
    ``RuntimeError`` (a deadlock) instead of hanging.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._virtual_now = start
        super().__init__(selector=_AutojumpSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        if seconds > 0:
            self._virtual_now += seconds


async def settle(limit: int = 100_000) -> None:
    """Let every task that can run, run, without moving the clock: return once nothing but the
    caller is ready. (Peeks at the loop's ready queue, a CPython implementation detail.)"""
    loop = asyncio.get_running_loop()
    for _ in range(limit):
        await asyncio.sleep(0)
        if not loop._ready:  # type: ignore[attr-defined]
            return
    raise RuntimeError(f"still busy after {limit} iterations (livelock?)")


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]] | Coroutine[Any, Any, T]) -> T:
    """Run a coroutine (or a coroutine function) to completion on a fresh
    :class:`VirtualClockLoop`; then cancel what is left (like :func:`asyncio.run`) and close."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main() if callable(main) else main)
    finally:
        close_loop(loop)


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task left on ``loop``, let them finish, and close it (like the end of
    :func:`asyncio.run`)."""
    try:
        leftover = asyncio.all_tasks(loop)
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
