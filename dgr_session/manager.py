"""The asyncio driver: many route sessions at once over a stage transport and a route provider.

Each session is one task that feeds its :class:`~dgr_session.core.RouteSession` events and
executes the commands it returns. Stage and provider calls run as their own tasks and post their
answers (or failures) back as events tagged with the epoch they were issued for, so a late
answer is recognised and dropped by the core. Time is the event loop's clock, fed to the core as
:class:`~dgr_session.events.ClockTick`: deadlines and backoff are loop timers, never sleeps.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

import attrs

from dgr_session.commands import (
    CloseStage,
    Command,
    EmitToken,
    Finish,
    FinishReason,
    Forward,
    OpenStage,
    RequestRoute,
)
from dgr_session.core import RouteSession
from dgr_session.errors import DgrError, NoRoute, RouteStalled, SpeculationNeedsSampling
from dgr_session.events import (
    Cancel,
    ClockTick,
    Event,
    RouteAssigned,
    RouteUnavailable,
    StageFailed,
    StageOpened,
    StageOutput,
    Start,
)
from dgr_session.faults import FailureReport, FaultKind
from dgr_session.identifiers import check_session_id
from dgr_session.identity import EvidenceClass, ModelIdentity, Recipe
from dgr_session.machine import SessionMachine, SessionState
from dgr_session.policy import FailurePolicy
from dgr_session.prefixes import PrefixBook
from dgr_session.route import CertificationVerifier
from dgr_session.sampling import Sampler, greedy
from dgr_session.speculation import Speculation
from dgr_session.transport import (
    Boundary,
    GrantingRouteProvider,
    Logits,
    RouteProvider,
    SessionStart,
    StageTransport,
)
from dgr_session.usage import UsageLedger, UsageRecord


def fault_kind(error: BaseException) -> FaultKind:
    """Classify an exception raised by a transport.

    dgr's errors declare their kind in a ``fault_kind`` attribute
    (:class:`~dgr_session.errors.StaleEpoch`: ``protocol``,
    :class:`~dgr_session.errors.StageDead`: ``dead``, each engine error its own), and so may any
    exception. A foreign one without it: timeouts are ``deadline``, connection and OS errors
    ``dead``, anything else ``engine_error``. A failure of the client's own making declares
    ``client`` (:class:`~dgr_session.identifiers.InvalidIdentifier`,
    ``dgr_engine.errors.ClientCallError``): the session ends without blaming any stage.
    """
    kind = getattr(error, "fault_kind", None)
    if isinstance(kind, FaultKind):
        return kind
    if isinstance(error, TimeoutError):
        return FaultKind.DEADLINE
    if isinstance(error, OSError):
        return FaultKind.DEAD
    return FaultKind.ENGINE_ERROR


def _provider_detail(error: BaseException) -> str:
    """A provider's failure in words: a :class:`~dgr_session.errors.NoRoute` says why it has
    no route in its own; anything else is named by its type."""
    if isinstance(error, NoRoute):
        return str(error)
    return f"provider error: {error!r}"


@attrs.frozen
class SessionResult:
    """How a session ended."""

    session_id: str
    """Session."""
    state: SessionState
    """Terminal state: ``done``, ``failed`` or ``cancelled``."""
    reason: FinishReason
    """Why it finished."""
    tokens: tuple[int, ...]
    """Accepted tokens (for ``failed``/``cancelled``: those accepted before the end)."""
    error: DgrError | None
    """Terminal error (``SessionFailed`` or ``SessionCancelled``); ``None`` when done."""
    epoch: int
    """Last epoch."""
    route_changes: int
    """Route assignments after the first."""
    stale_events_dropped: int
    """Late answers of closed epochs dropped by the core."""
    reports: tuple[FailureReport, ...]
    """Every failure report, oldest first."""
    usage: tuple[UsageRecord, ...] = ()
    """What the session used of each stage in each epoch (successful forwards), for billing;
    the workers keep their own records to reconcile with (``ShardClient.usage``)."""


class SessionHandle:
    """A session running in a :class:`SessionManager`."""

    __slots__ = (
        "session_id",
        "core",
        "_sampler",
        "_on_token",
        "_inbox",
        "_waiter",
        "_ops",
        "_task",
        "_ledger",
    )

    def __init__(
        self,
        core: RouteSession,
        sampler: Sampler,
        on_token: Callable[[int], None] | None,
    ) -> None:
        #: Session id.
        self.session_id = core.session_id
        #: The sans-I/O core (read it; never feed it directly while the manager runs it).
        self.core = core
        self._sampler = sampler
        self._on_token = on_token
        # Events posted by operation tasks, not yet fed to the core. Invariant: the driver task
        # is either running or waiting on _waiter, which any post wakes.
        self._inbox: list[Event] = []
        self._waiter: asyncio.Future[float | None] | None = None
        # Operation tasks (open/forward/route) still running; cancelled when the session ends.
        self._ops: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[SessionResult] | None = None
        self._ledger: UsageLedger | None = None  # made at the first forward (memory)

    def __repr__(self) -> str:
        return f"<SessionHandle {self.core!r}>"

    def ledger(self) -> UsageLedger:
        """The session's usage counts (forwards that succeeded, by epoch and stage)."""
        if self._ledger is None:
            self._ledger = UsageLedger(self.session_id)
        return self._ledger

    def usage(self) -> tuple[UsageRecord, ...]:
        """Usage records so far; the fault that ended each epoch is the next one's replay
        cause."""
        if self._ledger is None:
            return ()
        for report in self.core.reports:
            if report.epoch:
                self._ledger.epoch_ended(report.epoch, report.fault)
        return self._ledger.records()

    @property
    def state(self) -> SessionState:
        """The core's state."""
        return self.core.state

    @property
    def tokens(self) -> tuple[int, ...]:
        """Tokens accepted so far."""
        return self.core.tokens

    @property
    def done(self) -> bool:
        """True once the driver task has finished."""
        return self._task is not None and self._task.done()

    def cancel(self, reason: str = "") -> None:
        """Ask the session to cancel: its stages are closed and it ends ``cancelled``.
        No-op once finished."""
        self._post(Cancel(self.session_id, reason))

    async def wait(self) -> SessionResult:
        """Wait for the end and return how it ended (never raises for a failed session; raises
        only if the driver itself crashed)."""
        assert self._task is not None
        return await asyncio.shield(self._task)

    async def result(self) -> tuple[int, ...]:
        """Wait for the end; return the tokens, or raise the terminal error
        (:class:`~dgr_session.errors.SessionFailed` or
        :class:`~dgr_session.errors.SessionCancelled`)."""
        outcome = await self.wait()
        if outcome.error is not None:
            raise outcome.error
        return outcome.tokens

    def _post(self, event: Event) -> None:
        self._inbox.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _wake(waiter: asyncio.Future[float | None], when: float) -> None:
    if not waiter.done():
        waiter.set_result(when)


class SessionManager:
    """Runs many route sessions concurrently over ``transport`` and ``provider``.

    Must be used from one event loop (the one running when :meth:`start` is first called).
    Sampling is greedy unless a sampler is given (per manager or per session).
    ``certification_verifier`` checks every route's certifications against the client's own
    trust (:func:`~dgr_session.route.validate_route`); by default the provider's
    ``certification_verifier`` when it has one (``dgr_engine``'s route providers check against
    the client's lock), else the workers' word is taken.
    """

    def __init__(
        self,
        transport: StageTransport,
        provider: RouteProvider,
        *,
        policy: FailurePolicy | None = None,
        sampler: Sampler = greedy,
        required_evidence: EvidenceClass = EvidenceClass.REAL_HARDWARE,
        machine: SessionMachine | None = None,
        certification_verifier: CertificationVerifier | None = None,
        prefixes: PrefixBook | None = None,
    ) -> None:
        self._transport = transport
        # prompt prefixes kept on the stages across sessions, where the transport can
        self._prefixes = prefixes if transport.capabilities.keeps_prefixes else None
        self._provider = provider
        self._policy = policy if policy is not None else FailurePolicy()
        self._sampler = sampler
        self._required_evidence = required_evidence
        self._verifier: CertificationVerifier | None = (
            certification_verifier
            if certification_verifier is not None
            else getattr(provider, "certification_verifier", None)
        )
        self._machine = machine
        # Invariant: holds exactly the sessions whose driver task has not finished.
        self._live: dict[str, SessionHandle] = {}
        # Close calls in flight (fire and forget, kept referenced until done).
        self._closing: set[asyncio.Task[None]] = set()
        # Closes that keep a prompt prefix, by stage endpoint: an open that starts from a kept
        # prefix there waits for them to land (the next turn of a conversation may come at once)
        self._keeping: dict[str, set[asyncio.Task[None]]] = {}
        #: Close calls that raised (closing a dead stage is expected to fail).
        self.close_errors = 0

    # ----------------------------------------------------------------------------------------
    # Public API

    def start(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        session_id: str | None = None,
        stop_tokens: Iterable[int] = (),
        policy: FailurePolicy | None = None,
        sampler: Sampler | None = None,
        identity: ModelIdentity | None = None,
        recipe: Recipe | None = None,
        on_token: Callable[[int], None] | None = None,
        prefill_chunk: int | None = None,
        speculation: Speculation | None = None,
    ) -> SessionHandle:
        """Start a session (needs a running loop); returns at once.

        ``session_id`` must never be reused while workers may still hold (or be closing) an
        earlier session of that id: stages key their state by it. The default is a fresh UUID.
        One that breaks :mod:`dgr_session.identifiers`' rule (1 to 128 characters of
        ``A-Z a-z 0-9 . _ : -``: it travels as gRPC metadata and into every stage's log) is
        refused here with :class:`~dgr_session.identifiers.InvalidIdentifier`, before anything
        is asked of the provider or sent to a stage.

        ``identity``/``recipe`` pin what every route must serve (else the first route pins
        them). ``on_token`` is called with each accepted token; it must not raise.
        ``prefill_chunk`` is the most prompt tokens per forward (default: the smallest
        ``max_rows`` of the first route's stages, else the whole prompt).

        ``speculation`` decodes speculatively (``docs/speculative.md``): with dgr's sampler
        (one that states its :class:`~dgr_session.sampling.Sampling`: :data:`greedy`, or
        ``dgr_engine.engine.sampling.SeededSampler``), whose tokens a pass keeps exactly; any
        other is refused with :class:`~dgr_session.errors.SpeculationNeedsSampling`. A session with
        dgr's sampler hands it to every stage at open and marks its forwards
        (``Forward.sampled``): a transport may then answer the last stage's tokens instead of
        its logits (:attr:`~dgr_session.transport.Logits.sampled`, ``docs/sampling.md``),
        which it takes as they are.

        A transport that declares it (``TransportCapabilities``: it runs ahead, as a ring does,
        or drafts on the route) is told of the session first (``session_starting``), and the
        session speculates with the value it answers (a ring drafts on its last stage and
        hands the session its drafts); the caller's ``speculation`` is never changed.
        """
        sid = check_session_id(session_id) if session_id is not None else uuid.uuid4().hex
        if sid in self._live:
            raise ValueError(f"session {sid!r} is already running")
        chosen = sampler if sampler is not None else self._sampler
        sampling = chosen.sampling
        if speculation is not None and sampling is None:
            raise SpeculationNeedsSampling(
                f"session {sid!r}: a speculative pass keeps the drafts dgr's sampler takes; the "
                f"sampler {chosen!r} states no Sampling (use greedy or a SeededSampler)"
            )
        stop_tokens = tuple(stop_tokens)
        capabilities = self._transport.capabilities
        if capabilities.told_of_sessions:
            start = SessionStart(sid, max_new_tokens, stop_tokens, speculation)
            speculation = self._transport.session_starting(start)
        core = RouteSession(
            sid,
            prompt,
            max_new_tokens=max_new_tokens,
            policy=policy if policy is not None else self._policy,
            stop_tokens=stop_tokens,
            identity=identity,
            recipe=recipe,
            required_evidence=self._required_evidence,
            certification_verifier=self._verifier,
            machine=self._machine,
            prefill_chunk=prefill_chunk,
            speculation=speculation,
            sampling=sampling,
            prefill_frames=capabilities.prefill_frames,
            finds_silent_stages=capabilities.finds_silent_stages,
            prefixes=self._prefixes,
        )
        handle = SessionHandle(core, chosen, on_token)
        self._live[sid] = handle
        handle._task = asyncio.get_running_loop().create_task(
            self._drive(handle), name=f"dgr-session-{sid}"
        )
        return handle

    async def generate(
        self, prompt: Sequence[int], *, max_new_tokens: int, **options: Any
    ) -> tuple[int, ...]:
        """Run a session to its end: the tokens, or the terminal error raised.
        ``options`` are :meth:`start`'s."""
        return await self.start(prompt, max_new_tokens=max_new_tokens, **options).result()

    def get(self, session_id: str) -> SessionHandle | None:
        """The running session with this id, if any."""
        return self._live.get(session_id)

    @property
    def sessions(self) -> tuple[SessionHandle, ...]:
        """Running sessions."""
        return tuple(self._live.values())

    def __len__(self) -> int:
        return len(self._live)

    @property
    def closing(self) -> int:
        """Close calls still in flight."""
        return len(self._closing)

    async def aclose(self, *, grace: float | None = None) -> None:
        """Cancel every running session, wait for them, and give close calls ``grace`` seconds
        (default: the policy's step deadline) before abandoning them."""
        handles = list(self._live.values())
        for handle in handles:
            handle.cancel("manager closed")
        for handle in handles:
            await handle.wait()
        if self._closing:
            timeout = self._policy.step_deadline if grace is None else grace
            _, pending = await asyncio.wait(set(self._closing), timeout=timeout)
            for task in pending:
                task.cancel()

    async def __aenter__(self) -> SessionManager:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ----------------------------------------------------------------------------------------
    # Driver

    async def _drive(self, handle: SessionHandle) -> SessionResult:
        loop = asyncio.get_running_loop()
        core = handle.core
        sid = handle.session_id
        try:
            self._execute(handle, core.handle(Start(sid, loop.time())))
            while not core.finished:
                now = None
                if not handle._inbox:
                    now = await self._wait(handle, core.next_timer())
                # asyncio runs a timer up to one clock resolution early: a timer that fired
                # means its time has come, or the core would see nothing due and we would spin.
                self._execute(handle, core.handle(ClockTick(sid, max(loop.time(), now or 0.0))))
                self._drain(handle)
            self._drain(handle)  # late answers are counted by the finished core
        except GeneratorExit:  # the loop is torn down without running us: nothing can be sent
            if not core.finished:
                core.handle(Cancel(sid, "event loop closed"))
            raise
        except BaseException:  # a driver bug or the task cancelled: still close the stages
            if not core.finished:
                self._execute(handle, core.handle(Cancel(sid, "driver stopped")))
            raise
        finally:
            self._live.pop(sid, None)
            ops, handle._ops = handle._ops, set()
            if not loop.is_closed():
                for task in ops:
                    task.cancel()
        assert core.finish_reason is not None
        return SessionResult(
            session_id=sid,
            state=core.state,
            reason=core.finish_reason,
            tokens=core.tokens,
            error=core.error,
            epoch=core.epoch,
            route_changes=core.route_changes,
            stale_events_dropped=core.stale_events_dropped,
            reports=core.reports,
            usage=handle.usage(),
        )

    def _drain(self, handle: SessionHandle) -> None:
        while handle._inbox:
            events, handle._inbox = handle._inbox, []
            for event in events:
                self._execute(handle, handle.core.handle(event))

    async def _wait(self, handle: SessionHandle, when: float | None) -> float | None:
        """Wait for a posted event or until ``when``; return ``when`` if the timer fired."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[float | None] = loop.create_future()
        handle._waiter = waiter
        timer = loop.call_at(when, _wake, waiter, when) if when is not None else None
        try:
            return await waiter
        finally:
            handle._waiter = None
            if timer is not None:
                timer.cancel()

    def _execute(self, handle: SessionHandle, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Forward):
                self._spawn(handle, self._forward(handle, command))
            elif isinstance(command, OpenStage):
                self._spawn(handle, self._open(handle, command))
            elif isinstance(command, CloseStage):
                task = asyncio.get_running_loop().create_task(self._close(command))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
                if command.keep is not None:
                    self._track_keep(command.stage.endpoint, task)
            elif isinstance(command, RequestRoute):
                self._spawn(handle, self._request_route(handle, command))
            elif isinstance(command, EmitToken):
                if handle._on_token is not None:
                    handle._on_token(command.token)
            elif isinstance(command, Finish):
                pass  # the driver loop sees core.finished and builds the result
            else:  # pragma: no cover - exhaustive over Command
                raise TypeError(f"unknown command {command!r}")

    @staticmethod
    def _spawn(handle: SessionHandle, operation: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(operation)
        handle._ops.add(task)
        task.add_done_callback(handle._ops.discard)

    # ----------------------------------------------------------------------------------------
    # Operations: each posts exactly one event (or none, if cancelled)

    def _track_keep(self, endpoint: str, task: asyncio.Task[None]) -> None:
        keeping = self._keeping.setdefault(endpoint, set())
        keeping.add(task)

        def landed(done: asyncio.Task[None]) -> None:
            keeping.discard(done)
            if not keeping and self._keeping.get(endpoint) is keeping:
                del self._keeping[endpoint]

        task.add_done_callback(landed)

    async def _open(self, handle: SessionHandle, cmd: OpenStage) -> None:
        keeping = self._keeping.get(cmd.stage.endpoint) if cmd.prefix is not None else None
        if keeping:  # bounded: a close gives up after the transport's close timeout
            await asyncio.wait(set(keeping))
        try:
            if cmd.prefix is None:
                held = await self._transport.open(
                    cmd.stage, cmd.session_id, cmd.epoch, cmd.sampling
                )
            else:  # a transport that keeps prefixes (the core asks no other)
                held = await self._transport.open(  # type: ignore[call-arg]
                    cmd.stage, cmd.session_id, cmd.epoch, cmd.sampling, prefix=cmd.prefix
                )
        except Exception as err:  # noqa: BLE001 - every failure becomes a typed fault
            handle._post(
                StageFailed(
                    session_id=cmd.session_id,
                    epoch=cmd.epoch,
                    stage_index=cmd.stage_index,
                    kind=fault_kind(err),
                    detail=repr(err),
                    retry_after=getattr(err, "retry_after", None),
                    error=err,
                )
            )
            return
        handle._post(StageOpened(cmd.session_id, cmd.epoch, cmd.stage_index, held or 0))

    async def _forward(self, handle: SessionHandle, cmd: Forward) -> None:
        sid, epoch, step, index = cmd.session_id, cmd.epoch, cmd.step, cmd.stage_index

        def failed(kind: FaultKind, detail: str, error: BaseException | None = None) -> StageFailed:
            return StageFailed(
                session_id=sid,
                epoch=epoch,
                stage_index=None if isinstance(error, RouteStalled) else index,
                kind=kind,
                detail=detail,
                step=step,
                error=error,
            )

        def output(
            *,
            payload: object = None,
            token: int | None = None,
            tokens: tuple[int, ...] | None = None,
        ) -> StageOutput:
            return StageOutput(
                session_id=sid,
                epoch=epoch,
                step=step,
                stage_index=index,
                payload=payload,
                token=token,
                tokens=tokens,
            )

        try:
            result = await self._transport.forward(cmd)
        except Exception as err:  # noqa: BLE001 - every failure becomes a typed fault
            handle._post(failed(fault_kind(err), repr(err), err))
            return
        handle.ledger().forwarded(
            epoch,
            index,
            cmd.stage.endpoint,
            (cmd.stage.layer_begin, cmd.stage.layer_end),
            cmd.kind,
            len(cmd.positions),
            result.cost,
            cmd.drafts,
            cmd.kept_drafts,
        )
        if cmd.final:
            if not isinstance(result, Logits):
                detail = f"last stage answered {type(result).__name__}, expected Logits"
                handle._post(failed(FaultKind.PROTOCOL, detail))
                return
            if not cmd.wants_logits:  # a prefill chunk or a replayed token: nothing to sample
                handle._post(output())
                return
            chosen = result.sampled if cmd.sampled else None  # the stage took them for us
            if chosen is None:  # logits: the session's sampler takes the tokens here
                try:
                    chosen = _sample_here(handle, cmd, result)
                except Exception as err:  # noqa: BLE001 - unusable logits are the stage's fault
                    detail = f"cannot sample from logits: {err!r}"
                    kind = getattr(err, "fault_kind", FaultKind.PROTOCOL)
                    handle._post(failed(kind, detail, err))
                    return
            if cmd.drafts:  # a verification pass: the session's token of every row
                if len(chosen) != cmd.drafts + 1:
                    detail = f"{len(chosen)} tokens answered for a pass of {cmd.drafts + 1} rows"
                    handle._post(failed(FaultKind.PROTOCOL, detail))
                    return
                handle._post(output(tokens=chosen))
                return
            if not chosen:
                handle._post(failed(FaultKind.PROTOCOL, "no token answered"))
                return
            handle._post(output(token=chosen[-1]))
        elif isinstance(result, Boundary):
            handle._post(output(payload=result.rows))
        else:
            detail = f"middle stage answered {type(result).__name__}, expected Boundary"
            handle._post(failed(FaultKind.PROTOCOL, detail))

    async def _request_route(self, handle: SessionHandle, cmd: RequestRoute) -> None:
        sid, epoch, attempt = cmd.session_id, cmd.epoch, cmd.attempt
        try:
            route = await self._provider.assign(sid, cmd.report)
        except Exception as err:  # noqa: BLE001 - a provider failure means no route this time
            handle._post(RouteUnavailable(sid, epoch, _provider_detail(err), attempt, err))
            return
        if route is None:
            handle._post(RouteUnavailable(sid, epoch, "provider has no route", attempt))
            return
        if isinstance(self._provider, GrantingRouteProvider):
            try:
                route = self._provider.grant_route(sid, epoch, route)
            except Exception as err:  # noqa: BLE001 - a route without grants opens nothing
                handle._post(RouteUnavailable(sid, epoch, _provider_detail(err), attempt, err))
                return
        handle._post(RouteAssigned(sid, epoch, route, attempt))

    async def _close(self, cmd: CloseStage) -> None:
        try:
            if cmd.keep is None:
                await self._transport.close(cmd.stage, cmd.session_id, cmd.epoch)
            else:  # a transport that keeps prefixes (the core asks no other)
                await self._transport.close(  # type: ignore[call-arg]
                    cmd.stage, cmd.session_id, cmd.epoch, keep=cmd.keep
                )
        except Exception:  # noqa: BLE001 - closing a dead stage fails; nothing is left to free
            self.close_errors += 1


def _sample_here(handle: SessionHandle, cmd: Forward, result: Logits) -> tuple[int, ...]:
    """The session's tokens of the logits a last stage answered: for a pass, of every row (row
    ``i`` takes the token at ``positions[i] + 1`` after the tokens before it, the pass's own
    included); else of the last row."""
    core, sampler, start = handle.core, handle._sampler, cmd.positions.start
    before = (core.prompt + core.tokens)[:start]
    if not cmd.drafts:
        return (sampler(result.values, cmd.positions[-1] + 1, before + cmd.token_ids),)
    rows = result.rows if result.rows is not None else (result.values,)
    if len(rows) != cmd.drafts + 1:
        raise ValueError(f"{len(rows)} logits rows answered for {cmd.drafts + 1} rows")
    return tuple(
        sampler(row, start + i + 1, before + cmd.token_ids[: i + 1]) for i, row in enumerate(rows)
    )
