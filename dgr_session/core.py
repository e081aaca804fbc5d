"""The sans-I/O route session: events in, commands out.

:class:`RouteSession` never touches a network, a clock or a random generator. Time comes from
:class:`~dgr_session.events.Start` and :class:`~dgr_session.events.ClockTick`; stage answers
come as events; tokens are chosen by the driver. The state table lives in
:mod:`dgr_session.machine`; this module decides which trigger an event amounts to and which
commands go with it. Its parts: the current epoch's opens and forwards in flight, one
:class:`~dgr_session.pipeline.EpochPipeline` made new on each route assignment (a new epoch
starts empty by construction), and what the session spent of its
:class:`~dgr_session.policy.FailurePolicy`, one :class:`~dgr_session.budget.FailureBudget`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Never, NoReturn

from loguru import logger

from dgr_session.budget import FailureBudget
from dgr_session.commands import (
    CloseStage,
    Command,
    EmitToken,
    Finish,
    FinishReason,
    ForwardKind,
    OpenStage,
    RequestRoute,
)
from dgr_session.errors import (
    AdmissionTimeout,
    ClientFailure,
    DgrError,
    FailureBudgetExhausted,
    InvalidTransition,
    NoRouteAvailable,
    RequestRefused,
    RouteInvalid,
    RouteRefused,
    SessionCancelled,
    SessionDeadlineExceeded,
    SessionFailed,
    StepDeadlineExceeded,
)
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
from dgr_session.faults import FailureReport, FaultKind, last_stage_fault
from dgr_session.identifiers import check_session_id
from dgr_session.identity import EvidenceClass, ModelIdentity, Recipe
from dgr_session.machine import (
    HOLDING_STATES,
    NEXT_STATE,
    TERMINAL_STATES,
    SessionMachine,
    SessionState,
    shared_machine,
)
from dgr_session.pipeline import Chunk, EpochPipeline
from dgr_session.policy import FailurePolicy, ReplayMode
from dgr_session.prefixes import PrefixBook, PrefixRef, route_key
from dgr_session.route import CertificationVerifier, Route, validate_route
from dgr_session.sampling import Sampling
from dgr_session.speculation import Speculation, kept_drafts, verify_rows

_S = SessionState
_TERMINAL = frozenset(state.value for state in TERMINAL_STATES)
_HOLDING = frozenset(state.value for state in HOLDING_STATES)
_FORWARDING = frozenset({_S.PREFILLING.value, _S.DECODING.value})
_PREFILL, _DECODE, _REPLAY = ForwardKind.PREFILL, ForwardKind.DECODE, ForwardKind.REPLAY
_BATCHED = ReplayMode.BATCHED
_new_tuple = tuple.__new__
_EVENT_TYPES = frozenset(
    {
        Start,
        ClockTick,
        RouteAssigned,
        RouteUnavailable,
        StageOpened,
        StageOutput,
        StageFailed,
        Cancel,
    }
)


def _not_an_event(event: Never) -> NoReturn:
    """Refuses what :meth:`RouteSession.handle` was given; typed ``Never`` so that mypy checks
    that the ``match`` over the event classes leaves none out."""
    raise TypeError(f"not a session event: {event!r}")


class RouteSession:
    """One route session's control logic, fed by a driver.

    Call :meth:`handle` with each event; execute the commands it returns, in order. The session
    starts in ``new``; feed :class:`~dgr_session.events.Start` first. A ``session_id`` that
    breaks :mod:`dgr_session.identifiers`' rule is refused at construction
    (:class:`~dgr_session.identifiers.InvalidIdentifier`). Every method either
    succeeds or raises :class:`~dgr_session.errors.InvalidTransition` without changing anything
    (a driver bug); remote faults never raise, they become state.
    """

    __slots__ = (
        "session_id",
        "prompt",
        "max_new_tokens",
        "stop_tokens",
        "required_evidence",
        "certification_verifier",
        "sampling",
        "_machine",
        "_state",
        "_identity",
        "_recipe",
        "_epoch",
        "_live",
        "_route",
        "_pipe",
        "_budget",
        "_accepted",
        "_chunk",
        "_replay_rows",
        "_high_water",
        "_now",
        "_started_at",
        "_ended_at",
        "_awaiting_route",
        "_route_attempt",
        "_reports",
        "_refused",
        "_stale",
        "_error",
        "_reason",
        "_spec",
        "_kept",
        "_frames",
        "_finds_silent_stages",
        "_pass_rows",
        "_prefixes",
        "_reuse",
        "_opened_at",
        "_reused_at",
        "__weakref__",
    )

    def __init__(
        self,
        session_id: str,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        policy: FailurePolicy | None = None,
        stop_tokens: Iterable[int] = (),
        identity: ModelIdentity | None = None,
        recipe: Recipe | None = None,
        required_evidence: EvidenceClass = EvidenceClass.REAL_HARDWARE,
        machine: SessionMachine | None = None,
        prefill_chunk: int | None = None,
        certification_verifier: CertificationVerifier | None = None,
        speculation: Speculation | None = None,
        sampling: Sampling | None = None,
        prefill_frames: int = 1,
        finds_silent_stages: bool = False,
        prefixes: PrefixBook | None = None,
    ) -> None:
        check_session_id(session_id)  # it names the session in every command and log line
        if not prompt:
            raise ValueError("the prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if prefill_frames < 1:
            raise ValueError(f"prefill_frames must be >= 1, got {prefill_frames}")
        #: Session id; every event must name it.
        self.session_id = session_id
        #: Prompt token ids.
        self.prompt: tuple[int, ...] = tuple(prompt)
        #: Tokens to generate at most.
        self.max_new_tokens = max_new_tokens
        # What the session spent of its failure policy, and the clocks the policy bounds.
        self._budget = FailureBudget(policy if policy is not None else FailurePolicy())
        #: Token ids that end the session (state ``done``, reason ``stop``) once accepted.
        self.stop_tokens = frozenset(stop_tokens)
        #: Evidence class every stage's lane must be certified at (dark lanes never route).
        self.required_evidence = required_evidence
        #: Checks each stage's certification against the client's own trust (``None``: the
        #: worker's word is taken; ``dgr_engine.certification.verify.LockVerifier`` checks it).
        self.certification_verifier = certification_verifier
        #: The session's sampler, which every stage is told of at open and the last stage
        #: applies: its forwards say so (:attr:`~dgr_session.commands.Forward.sampled`), and a
        #: transport may ask the last stage for the tokens instead of the logits. ``None``: the
        #: session samples the logits itself (a sampler only its caller knows).
        self.sampling = sampling
        self._machine = machine if machine is not None else shared_machine()
        self._state: str = _S.NEW.value  # set by the machine (its model attribute)
        # Pinned by the first accepted route when not given: every later route must match.
        self._identity = identity
        self._recipe = recipe
        # Prompt tokens per prefill forward: given, or the smallest max_rows of the first route
        # (the whole prompt when no stage says). Pinned, so a re-prefill feeds the prompt in the
        # first run's chunks and every shard rebuilds its KV bit for bit.
        self._chunk = prefill_chunk
        self._frames = prefill_frames
        """Pinned prompt chunks per prefill forward, when the transport sends them as that many
        frames back to back, pipelined along the route (``Forward.frame_rows``)."""
        self._finds_silent_stages = finds_silent_stages
        """The transport names a silent stage itself (``TransportCapabilities``): a step
        deadline then names none, as the client cannot tell which stage held the step."""
        self._replay_rows = 1
        """Rows per forward of a batched replay: the smallest ``max_rows`` of the route."""
        self._high_water = 0
        """Positions below this were computed in some epoch: recomputing them is a replay."""
        # Route and epoch. Invariant: _live is True only while the stages of _route hold (or are
        # opening) the session under _epoch, i.e. in opening/prefilling/decoding.
        self._epoch = 0
        self._live = False
        self._route: Route | None = None
        # The opens and forwards of the current epoch, made new (empty) by each route
        # assignment: dgr_session.pipeline. Invariant: its stages hold KV for positions
        # [0, kv_pos) of prompt + accepted, and kv_pos <= len(prompt) + len(_accepted). Before
        # the first route, one of no stages, never fed (made here, not shared: then the first
        # assignment frees what it replaces, and a burst of them starts no extra passes of the
        # cyclic garbage collector; the control-plane benchmark's route_assigned p99 shows it).
        self._pipe = EpochPipeline(
            session_id, 0, (), self._budget.policy.pipelined, sampling is not None
        )
        # Tokens.
        self._accepted: list[int] = []
        # Time, all from events (the deadlines and the backoff are the budget's).
        self._now = 0.0
        self._started_at: float | None = None
        self._ended_at: float | None = None
        # Invariant: True exactly while a RequestRoute for epoch _epoch + 1 is unanswered.
        self._awaiting_route = False
        # Route requests issued for epoch _epoch + 1 (0 once a route is in use): only an answer
        # naming the newest is applied; one to a request that timed out is late, hence stale.
        self._route_attempt = 0
        self._reports: list[FailureReport] = []
        # What validation refused of the last route offered, as (class, stage, layers, reason);
        # None once a route passes. The same refusal again ends the session (RouteRefused).
        self._refused: tuple[type[RouteInvalid], int | None, object, str] | None = None
        self._stale = 0
        self._error: DgrError | None = None
        self._reason: FinishReason | None = None
        #: Speculative decoding: where drafts come from, how many per pass.
        self._spec = speculation
        # After a verification pass: how many of its drafts the next forward tells the stages
        # to keep (None: the last forward was no verification pass, or a new epoch began).
        self._kept: int | None = None
        self._pass_rows = 1  # set by each route: the rows of a pass that keep their bits
        # Prompt prefixes kept on the stages across sessions (docs/prefix-cache.md): the
        # client's book (None: none kept or reused), the kept prefix this epoch's opens start
        # from (None: plain opens), and the positions each stage answered it opened with.
        self._prefixes = prefixes if sampling is None or not sampling.penalized else None
        self._reuse: PrefixRef | None = None
        self._opened_at: dict[int, int] = {}
        self._reused_at = 0
        self._machine.add_model(self)

    def __repr__(self) -> str:
        return (
            f"<RouteSession {self.session_id!r} {self._state} epoch={self._epoch}"
            f" step={len(self._accepted)}>"
        )

    # ----------------------------------------------------------------------------------------
    # Read-only view

    @property
    def policy(self) -> FailurePolicy:
        """The failure budget."""
        return self._budget.policy

    @property
    def state(self) -> SessionState:
        """Current state."""
        return SessionState(self._state)

    @property
    def finished(self) -> bool:
        """True in a terminal state (``done``, ``failed``, ``cancelled``)."""
        return self._state in _TERMINAL

    @property
    def epoch(self) -> int:
        """Current epoch: 0 before the first route, +1 per route assignment. Never decreases."""
        return self._epoch

    @property
    def route_attempt(self) -> int:
        """Route requests issued for the next epoch so far (an answer must name the newest)."""
        return self._route_attempt

    @property
    def live_epoch(self) -> bool:
        """True while the stages of the current epoch hold (or are opening) the session."""
        return self._live

    @property
    def step(self) -> int:
        """Number of accepted tokens (the index of the token being worked on)."""
        return len(self._accepted)

    @property
    def tokens(self) -> tuple[int, ...]:
        """Accepted tokens, in order."""
        return tuple(self._accepted)

    @property
    def speculation(self) -> Speculation | None:
        """The speculation the session runs with: the caller's, or the value its transport
        answered in its place (``StageTransport.session_starting``), sharing its tally."""
        return self._spec

    @property
    def route(self) -> Route | None:
        """Route of the current epoch (``None`` before the first)."""
        return self._route

    @property
    def opened_stages(self) -> tuple[int, ...]:
        """Stages of the live epoch that confirmed their open (empty when no epoch is live)."""
        if not self._live:
            return ()
        return self._pipe.opened_stages()

    @property
    def kv_positions(self) -> int:
        """Positions the live epoch's stages hold KV for."""
        return self._pipe.kv_pos if self._live else 0

    @property
    def route_changes(self) -> int:
        """Route assignments after the first."""
        return self._budget.route_changes

    @property
    def reused_positions(self) -> int:
        """Prompt positions the session's stages started from, kept by an earlier session
        (``docs/prefix-cache.md``): rows no stage computed for it; 0: none."""
        return self._reused_at

    @property
    def attempts(self) -> int:
        """Attempts at the current step so far (1 + faults at this step)."""
        return self._budget.attempts

    @property
    def reports(self) -> tuple[FailureReport, ...]:
        """Every failure report, oldest first."""
        return tuple(self._reports)

    @property
    def stale_events_dropped(self) -> int:
        """Events dropped because their epoch was no longer live (late answers)."""
        return self._stale

    @property
    def error(self) -> DgrError | None:
        """The terminal error (``failed``: a :class:`SessionFailed`; ``cancelled``:
        :class:`SessionCancelled`), else ``None``."""
        return self._error

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why the session finished; ``None`` while it runs."""
        return self._reason

    @property
    def started_at(self) -> float | None:
        """Clock time of :class:`~dgr_session.events.Start`."""
        return self._started_at

    @property
    def ended_at(self) -> float | None:
        """Clock time the session reached a terminal state."""
        return self._ended_at

    def next_timer(self) -> float | None:
        """Clock time at which a :class:`~dgr_session.events.ClockTick` may change something
        (deadline or end of backoff); ``None`` when finished or not started."""
        if self._state in _TERMINAL or self._started_at is None:
            return None
        return self._budget.next_timer(backing_off=self._state == _S.ROUTE_LOST.value)

    # ----------------------------------------------------------------------------------------
    # Events

    def handle(self, event: Event) -> list[Command]:
        """Apply one event; return the commands to execute, in order."""
        try:
            session_id = event.session_id
        except AttributeError:
            raise TypeError(f"not a session event: {event!r}") from None
        if session_id != self.session_id:
            if type(event) not in _EVENT_TYPES:
                raise TypeError(f"not a session event: {event!r}")
            raise InvalidTransition(
                f"event for session {event.session_id!r} fed to session {self.session_id!r}",
                state=self._state,
                event=type(event).__name__,
            )
        out: list[Command] = []
        match event:  # the most frequent first
            case StageOutput():
                self._on_output(event, out)
            case StageOpened():
                self._on_opened(event, out)
            case RouteAssigned():
                self._on_route_assigned(event, out)
            case Start():
                self._on_start(event, out)
            case ClockTick():  # timers only
                self._on_tick(event, out)
            case StageFailed():
                self._on_failed(event, out)
            case RouteUnavailable():
                self._on_route_unavailable(event, out)
            case Cancel():
                self._on_cancel(event, out)
            case _:  # an object with this session_id that is no event (mypy: none is left)
                _not_an_event(event)
        return out

    def _on_start(self, event: Start, out: list[Command]) -> None:
        if self._started_at is not None or self._state != _S.NEW.value:
            raise InvalidTransition(
                f"session {self.session_id!r} already started", state=self._state, event="Start"
            )
        self._now = event.now
        self._started_at = event.now
        self._budget.start(event.now)
        self._ask_route(None, out)

    def _on_tick(self, event: ClockTick, out: list[Command]) -> None:
        if event.now > self._now:
            self._now = event.now
        if self._state in _TERMINAL or self._started_at is None:
            return
        now = self._now
        budget = self._budget
        if budget.session_over(now):
            self._fail_session_deadline(out)
        elif self._state == _S.ROUTE_LOST.value:
            if budget.backoff_over(now):
                self._fire("backoff_elapsed")
                self._ask_route(self._reports[-1] if self._reports else None, out)
        elif budget.wait_over(now):
            deadline = budget.policy.step_deadline
            detail = f"no answer within the step deadline of {deadline}s"
            stage_index = self._awaited_stage()
            if self._finds_silent_stages and self._state in _HOLDING:
                stage_index = None  # the transport found no silent stage: none is named
                detail += ", and no stage of the route was found silent"
            cause = StepDeadlineExceeded(detail, stage_index=stage_index, deadline=deadline)
            self._fault(stage_index, FaultKind.DEADLINE, detail, out, cause=cause)

    def _on_route_assigned(self, event: RouteAssigned, out: list[Command]) -> None:
        if not self._route_answer_applies(event.epoch, event.attempt):
            return
        self._awaiting_route = False
        route = event.route
        limits = [stage.max_rows for stage in route.stages if stage.max_rows > 0]
        chunk = self._chunk
        if chunk is None:
            chunk = min([len(self.prompt), *limits])
        try:
            validate_route(
                route,
                identity=self._identity,
                recipe=self._recipe,
                min_context=len(self.prompt) + self.max_new_tokens - 1,
                min_rows=min(chunk, len(self.prompt)),
                required_evidence=self.required_evidence,
                verify_certification=self.certification_verifier,
            )
        except RouteInvalid as err:
            refusal = (type(err), err.stage_index, err.layers, err.reason)
            if refusal == self._refused:  # deterministic: asking again would change nothing
                self._route_refused(err, out)
                return
            self._refused = refusal
            self._fault(
                err.stage_index,
                FaultKind.ROUTE_INVALID,
                str(err),
                out,
                endpoint=err.endpoint,
                cause=err,
            )
            return
        self._refused = None
        self._budget.route_assigned(first=self._route is None)
        if self._identity is None:
            self._identity = route.identity
        if self._recipe is None:
            self._recipe = route.recipe
        self._chunk = chunk
        self._replay_rows = min(limits, default=len(self.prompt) + self.max_new_tokens)
        hardware = {stage.lane.hardware for stage in route.stages}
        self._pass_rows = min(  # the most rows a verification pass keeps every row's bits in
            verify_rows(route.recipe.quant_types, hw) for hw in hardware or {""}
        )
        self._epoch = event.epoch
        self._route_attempt = 0
        self._route = route
        self._live = True
        self._pipe = EpochPipeline(  # a new epoch starts empty
            self.session_id,
            self._epoch,
            route.stages,
            self._budget.policy.pipelined,
            self.sampling is not None,
        )
        self._kept = None  # its stages hold no verification pass
        self._fire("route_assigned")
        self._budget.begin_wait(self._now)
        self._reuse, self._opened_at = None, {}
        if self._prefixes is not None and self._high_water == 0:  # nothing computed yet
            self._reuse = self._prefixes.find(route_key(route), self.prompt, chunk)
        for index, stage in enumerate(route.stages):
            out.append(
                OpenStage(self.session_id, self._epoch, index, stage, self.sampling, self._reuse)
            )

    def _on_route_unavailable(self, event: RouteUnavailable, out: list[Command]) -> None:
        if not self._route_answer_applies(event.epoch, event.attempt):
            return
        self._awaiting_route = False
        detail = event.detail or "no route available"
        self._fault(None, FaultKind.NO_ROUTE, detail, out, cause=event.error)

    def _on_opened(self, event: StageOpened, out: list[Command]) -> None:
        index = event.stage_index
        pipe = self._pipe
        applies = event.epoch == self._epoch and self._live and 0 <= index < pipe.n_stages
        if not applies and not self._stage_answer_applies(event.epoch, index):
            return  # (the check inlined for the common case: an answer of the live epoch)
        if self._state != _S.OPENING.value or pipe.opened >> index & 1:
            detail = f"unexpected StageOpened in state {self._state}"
            self._fault(index, FaultKind.PROTOCOL, detail, out)
            return
        asked = 0 if self._reuse is None else self._reuse.length
        if event.next_pos not in (0, asked):
            detail = f"opened with {event.next_pos} positions, {asked} asked for"
            self._fault(index, FaultKind.PROTOCOL, detail, out)
            return
        if self._reuse is not None:  # else every stage opened empty (checked above)
            self._opened_at[index] = event.next_pos
        if pipe.confirm_open(index) and (self._reuse is None or self._reused(out)):
            self._budget.admitted()
            self._fire("stages_opened")
            self._start_forward(out)

    def _reused(self, out: list[Command]) -> bool:
        """Every stage opened from the kept prefix asked for: True when they hold the same
        positions (the prefix's, or none), where the epoch's rows now start. Else the stages
        that started from it are opened again empty (False: the epoch goes on once they
        answer)."""
        held = set(self._opened_at.values())
        if len(held) == 1:
            self._pipe.kv_pos = self._pipe.sent = self._reused_at = held.pop()
            return True
        assert self._reuse is not None and self._route is not None
        self._reuse = empty = PrefixRef(self._reuse.digest, 0)
        for index, positions in self._opened_at.items():
            if positions:
                self._pipe.opened &= ~(1 << index)
                stage = self._route.stages[index]
                out.append(
                    OpenStage(self.session_id, self._epoch, index, stage, self.sampling, empty)
                )
        return False

    def _on_output(self, event: StageOutput, out: list[Command]) -> None:
        index = event.stage_index
        pipe = self._pipe
        applies = event.epoch == self._epoch and self._live and 0 <= index < pipe.n_stages
        if not applies and not self._stage_answer_applies(event.epoch, index):
            return  # (the check inlined for the common case: an answer of the live epoch)
        step = len(self._accepted)
        if self._state not in _FORWARDING:
            detail = f"unexpected StageOutput in state {self._state}"
            self._fault(index, FaultKind.PROTOCOL, detail, out)
            return
        if not pipe.computing >> index & 1 or event.step != step:
            detail = (
                f"output of stage {index} step {event.step}, awaited stages"
                f" {pipe.computing_stages()} step {step}"
            )
            self._fault(index, FaultKind.PROTOCOL, detail, out)
            return
        if index < pipe.n_stages - 1:  # a middle stage: the next takes its rows once free
            if pipe.relay(index, event.payload, step, self._now, out):  # stage 0 is free
                chunk = self._next_chunk(pipe.sent)
                if chunk is not None:
                    pipe.send(0, chunk, None, step, self._now, out)
            return
        high_water = self._high_water
        chunk = pipe.complete(self._now)
        stop = chunk.positions.stop
        if stop > high_water:
            self._high_water = stop
        if chunk.drafts:
            self._verified(chunk, event.tokens, high_water, out)
            return
        if self._spec is not None and chunk.kind is _DECODE and chunk.wants_logits:
            self._spec.verified(0, 0, self._now - pipe.hop_started[0])  # a plain pass, timed
        if not chunk.wants_logits:  # a prefill chunk or replayed rows: no token to take
            self._budget.begin_wait(self._now)
            self._pump(index, out)
            if not pipe.flight:  # the route is empty: stage 0 goes on (not pipelined)
                self._pump(0, out)
            return
        token = event.token
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            self._fault(index, FaultKind.PROTOCOL, f"last stage gave no token: {token!r}", out)
            return
        self._accept(token, out)

    def _on_failed(self, event: StageFailed, out: list[Command]) -> None:
        if not self._stage_answer_applies(event.epoch, event.stage_index):
            return
        if event.stage_index is None:  # the route failed at a stage nobody can tell
            self._fault(None, event.kind, event.detail, out, cause=event.error)
            return
        if event.kind is FaultKind.BUSY and self._state == _S.OPENING.value:
            self._busy(event.stage_index, event.detail, event.retry_after, out)
            return
        if event.kind is FaultKind.CLIENT:
            self._client_failed(event.stage_index, event.detail, out, event.error)
            return
        if event.kind is FaultKind.BAD_REQUEST:
            self._request_refused(event.stage_index, event.detail, out, event.error)
            return
        self._fault(event.stage_index, event.kind, event.detail, out, cause=event.error)

    def _on_cancel(self, event: Cancel, out: list[Command]) -> None:
        if self._state in _TERMINAL:
            return  # idempotent: a finished session has nothing left to cancel
        # its prompt's whole chunks are kept too (a stop string, a client gone): a stage that
        # holds fewer positions (cancelled before they were computed) keeps nothing
        self._close_epoch(out, self._keep())
        self._fire("cancel")
        reason = f": {event.reason}" if event.reason else ""
        self._end(
            FinishReason.CANCELLED,
            SessionCancelled(f"session {self.session_id!r} cancelled{reason}"),
            out,
        )

    # ----------------------------------------------------------------------------------------
    # Helpers

    def _route_answer_applies(self, epoch: int, attempt: int) -> bool:
        nxt = self._epoch + 1
        if self._awaiting_route and epoch == nxt and attempt == self._route_attempt:
            return True
        if epoch < nxt or (epoch == nxt and attempt <= self._route_attempt):
            self._stale += 1  # an answer to a request that timed out or was superseded
            return False
        raise InvalidTransition(
            f"route answer for epoch {epoch} attempt {attempt}; session is at epoch "
            f"{self._epoch}, {self._route_attempt} request(s) issued for the next",
            state=self._state,
            event="route answer",
        )

    def _stage_answer_applies(self, epoch: int, stage_index: int | None) -> bool:
        """``stage_index`` ``None``: a failure of the route that names no stage."""
        if epoch == self._epoch and self._live:
            n_stages = self._pipe.n_stages
            if stage_index is not None and not 0 <= stage_index < n_stages:
                raise InvalidTransition(
                    f"stage index {stage_index} outside a route of {n_stages} stages",
                    state=self._state,
                    event="stage answer",
                )
            return True
        if epoch <= self._epoch:
            self._stale += 1  # late answer of an epoch that is closed
            return False
        raise InvalidTransition(
            f"stage answer for epoch {epoch}; session is at epoch {self._epoch}",
            state=self._state,
            event="stage answer",
        )

    def _fire(self, trigger: str, stage: int | None = None) -> None:
        source = self._state
        dest = NEXT_STATE.get((source, trigger))
        if dest is None:
            raise InvalidTransition(
                f"{trigger!r} is not allowed in state {source!r}", state=source, event=trigger
            )
        self._machine.fire(self, trigger)
        if source != dest:
            logger.info(  # keywords land in the record's extra, as bind() would put them
                "{} -> {} on {} (step {})",
                source,
                dest.value,
                trigger,
                len(self._accepted),
                session=self.session_id,
                epoch=self._epoch,
                stage=stage,
            )

    def _ask_route(self, report: FailureReport | None, out: list[Command]) -> None:
        self._awaiting_route = True
        self._route_attempt += 1
        self._budget.begin_wait(self._now)
        out.append(RequestRoute(self.session_id, self._epoch + 1, report, self._route_attempt))

    def _awaited_stage(self) -> int | None:
        if self._state == _S.OPENING.value:
            index = self._pipe.first_unopened()
            if index is not None:
                return index
        if self._state in _HOLDING:
            return self._pipe.furthest_computing()  # it holds the oldest chunk
        return None

    def _start_forward(self, out: list[Command]) -> None:
        """Starts forwarding the rows from ``kv_pos`` to the newest position (every stage is
        idle): a prefill or re-prefill after the stages opened, one token after each accept."""
        now = self._now
        self._budget.begin_wait(now)
        pipe = self._pipe
        assert not pipe.computing and not pipe.flight  # so stage 0 is free (no pump needed)
        chunk = self._next_chunk(pipe.sent)
        if chunk is not None:
            pipe.send(0, chunk, None, len(self._accepted), now, out)

    def _next_chunk(self, pos: int) -> Chunk | None:
        """The rows of the next forward into stage 0, starting at ``pos``, or None when every
        row has been sent.

        A prefill sends the prompt in pinned chunks; decoding sends the newest accepted token.
        A re-prefill after a route change (accepted tokens to replay) sends, with replay
        "batched", prompt + accepted tokens in forwards of the route's max_rows; with "exact",
        what the first run sent (the prompt in its chunks, then each accepted token in a call
        of its own), which rebuilds a shard's KV bit for bit: a batched call rounds
        differently in the last bits and could flip a greedy near-tie. Either way the chunks
        are pipelined across the stages (each stage computes the same calls, in the same
        order, as when they are not)."""
        n_prompt = len(self.prompt)
        end = n_prompt + len(self._accepted)
        if pos >= end:
            return None
        frame_rows = 0
        if pos + 1 < end and self._accepted and self._budget.policy.replay is _BATCHED:
            history = (*self.prompt, *self._accepted)  # a replay: prompt and accepted join
            tokens = history[pos : pos + self._replay_rows]
        elif pos < n_prompt:
            assert self._chunk is not None  # pinned by the first route
            tokens = self.prompt[pos : pos + self._chunk * self._frames]
            if len(tokens) > self._chunk:  # pinned chunks as frames, pipelined by the transport
                frame_rows = self._chunk
        else:  # one accepted token: no copy of the whole history per decoded token
            tokens = (self._accepted[pos - n_prompt],)
        kept, self._kept = self._kept, None  # told to the stages with this chunk
        stop = pos + len(tokens)
        if pos < self._high_water:  # rows an earlier epoch computed: a re-prefill
            kind = _REPLAY
        else:
            kind = _PREFILL if pos < n_prompt else _DECODE
        drafts = 0
        if self._spec is not None and stop == end and pos >= n_prompt and len(tokens) == 1:
            rows = min(self._replay_rows, self._pass_rows)
            room = min(self.max_new_tokens - len(self._accepted) - 1, rows - 1)
            proposed = self._spec.propose(self.prompt, self._accepted, room)
            if proposed:
                drafts = len(proposed)
                tokens = (*tokens, *proposed)
                return _new_tuple(
                    Chunk, (range(pos, stop + drafts), tokens, kind, True, drafts, kept, 0)
                )
        # Chunk(positions, token_ids, kind, wants_logits, drafts, kept_drafts, frame_rows), without
        # NamedTuple's slower __new__
        return _new_tuple(Chunk, (range(pos, stop), tokens, kind, stop == end, 0, kept, frame_rows))

    def _pump(self, index: int, out: list[Command]) -> None:
        """Stage ``index`` may be free to go on: the pipeline feeds it, and the stages before
        it, whatever waits for them (:meth:`EpochPipeline.pump`); stage 0 takes the next
        chunk, if any rows are left."""
        pipe = self._pipe
        step = len(self._accepted)
        if pipe.pump(index, step, self._now, out):  # stage 0 is free: the next chunk, if any
            chunk = self._next_chunk(pipe.sent)
            if chunk is not None:
                pipe.send(0, chunk, None, step, self._now, out)

    def _accept(self, token: int, out: list[Command]) -> None:
        if not self._take(token, out):
            self._fire("token_accepted")
            self._start_forward(out)

    def _take(self, token: int, out: list[Command]) -> bool:
        """Accepts ``token`` (emits it); True when that ended the session (a stop token, or
        the last token it may produce)."""
        step = len(self._accepted)
        self._accepted.append(token)
        self._budget.token_accepted()
        out.append(EmitToken(self.session_id, self._epoch, step, token))
        if token in self.stop_tokens:
            self._finish(FinishReason.STOP, out)
            return True
        if len(self._accepted) >= self.max_new_tokens:
            self._finish(FinishReason.LENGTH, out)
            return True
        return False

    def _verified(self, chunk: Chunk, tokens: object, high_water: int, out: list[Command]) -> None:
        """The last stage answered a verification pass (the newest token and ``chunk.drafts``
        drafts) with ``tokens``, the session's token of every row (``docs/sampling.md``). The
        longest run of drafts equal to the tokens plain decoding would have taken is kept, with
        the token after it: the same tokens, one pass instead of several. Every stage holds the
        pass's rows; the next forward tells them how many drafts to keep
        (:attr:`Forward.kept_drafts`)."""
        drafts = chunk.drafts
        if (
            not isinstance(tokens, tuple)
            or len(tokens) != drafts + 1
            or not all(type(t) is int and t >= 0 for t in tokens)
        ):
            detail = f"a verification pass of {drafts + 1} rows answered tokens {tokens!r}"
            self._fault(self._pipe.n_stages - 1, FaultKind.PROTOCOL, detail, out)
            return
        kept = kept_drafts(tokens, chunk.token_ids[1:])
        resume = chunk.positions.start + 1 + kept  # the rows of the drafts not kept are dropped
        pipe = self._pipe
        pipe.kv_pos = pipe.sent = resume
        self._high_water = max(high_water, resume)
        self._kept = kept
        assert self._spec is not None  # only a speculating session sends drafts
        self._spec.verified(drafts, kept, self._now - pipe.hop_started[0])
        for token in tokens[: kept + 1]:
            if self._take(token, out):
                return
        self._fire("token_accepted")
        self._start_forward(out)

    def _finish(self, reason: FinishReason, out: list[Command]) -> None:
        self._fire("finished")
        self._close_epoch(out, self._keep())
        self._end(reason, None, out)

    def _keep(self) -> PrefixRef | None:
        """What a session that ends (done or cancelled) asks its stages to keep of its prompt:
        its whole chunks, when its first route computed them (a re-prefill's batched replay
        may chunk them otherwise) and the client keeps a book."""
        book, route, chunk = self._prefixes, self._route, self._chunk
        if book is None or route is None or chunk is None or self._budget.route_changes:
            return None
        keep = book.to_keep(self.prompt, chunk)
        if keep is not None:
            book.kept(route_key(route), self.prompt, chunk, keep)
        return keep

    def _fault(
        self,
        stage_index: int | None,
        kind: FaultKind,
        detail: str,
        out: list[Command],
        *,
        endpoint: str | None = None,
        cause: BaseException | None = None,
    ) -> None:
        """Account one fault; then retry (route_lost) or fail (budget spent)."""
        now = self._now
        if endpoint is None and stage_index is not None and self._live and self._route:
            endpoint = self._route.stages[stage_index].endpoint
        holding = self._state in _HOLDING
        budget = self._budget
        attempt = budget.fault()
        report = self._report(stage_index, endpoint, kind, detail, attempt)
        self._close_epoch(out)
        budget.end_wait()
        self._awaiting_route = False
        spent = budget.spent(routed=self._route is not None)
        if spent is None:
            self._fire("stage_lost" if holding else "route_refused", stage_index)
            if budget.back_off(now, len(self._reports)):
                self._fire("backoff_elapsed")
                self._ask_route(report, out)
            return
        where = f"stage {stage_index} ({endpoint})" if stage_index is not None else "route request"
        error_type = FailureBudgetExhausted if holding else NoRouteAvailable
        lost = last_stage_fault(self._reports) if not holding else None
        since = ""
        if lost is not None and lost is not report:  # the stage whose loss left no route
            since = (
                f"; the route was lost at stage {lost.stage_index} ({lost.endpoint}), epoch"
                f" {lost.epoch}: {lost.fault.value} ({lost.detail})"
            )
        error = self._failure(
            error_type,
            f"session {self.session_id!r}: {where} failed with {kind.value} ({detail});"
            f" budget spent: {spent} {len(self._accepted)}{since}",
            stage_index=stage_index,
            endpoint=endpoint,
            fault=kind,
        )
        error.__cause__ = cause
        self._fire("exhausted", stage_index)
        self._end(FinishReason.FAILED, error, out)

    def _report(
        self,
        stage_index: int | None,
        endpoint: str | None,
        kind: FaultKind,
        detail: str,
        attempt: int,
    ) -> FailureReport:
        """Files a failure report of the current wait (call before the epoch is closed)."""
        now = self._now
        report = FailureReport(
            session_id=self.session_id,
            epoch=self._epoch,
            step=len(self._accepted),
            stage_index=stage_index,
            endpoint=endpoint,
            fault=kind,
            detail=detail,
            attempt=attempt,
            route_changes=self._budget.route_changes,
            at=now,
            waited=self._budget.waited(now),
            hop_seconds=self._pipe.hop_times() if self._state in _HOLDING else (),
        )
        self._reports.append(report)
        return report

    def _route_refused(self, refusal: RouteInvalid, out: list[Command]) -> None:
        """The provider offered a route refused as the last one was: validation is
        deterministic, so end the session rather than spend attempts asking again."""
        attempt = self._budget.fault()
        index, endpoint = refusal.stage_index, refusal.endpoint
        self._report(index, endpoint, FaultKind.ROUTE_INVALID, str(refusal), attempt)
        self._budget.end_wait()
        error = self._failure(
            RouteRefused,
            f"session {self.session_id!r}: the route was refused, {refusal}; the provider"
            " offered a route refused the same way again: not retried",
            stage_index=index,
            endpoint=endpoint,
            fault=FaultKind.ROUTE_INVALID,
        )
        error.__cause__ = refusal
        self._fire("exhausted", index)
        self._end(FinishReason.FAILED, error, out)

    def _request_refused(
        self, stage_index: int, detail: str, out: list[Command], cause: BaseException | None
    ) -> None:
        """A stage refused the request itself as invalid: any route would refuse it the same
        way. Close the epoch and end the session, naming the stage without blaming it."""
        assert self._route is not None  # a live epoch
        endpoint = self._route.stages[stage_index].endpoint
        attempts = self._budget.attempts
        self._report(stage_index, endpoint, FaultKind.BAD_REQUEST, detail, attempts)
        self._close_epoch(out)
        self._budget.end_wait()
        error = self._failure(
            RequestRefused,
            f"session {self.session_id!r}: stage {stage_index} ({endpoint}) refused the request"
            f" as invalid ({detail}); any route would refuse it the same way: not retried",
            stage_index=stage_index,
            endpoint=endpoint,
            fault=FaultKind.BAD_REQUEST,
            attempts=attempts,
        )
        error.__cause__ = cause
        self._fire("exhausted", stage_index)
        self._end(FinishReason.FAILED, error, out)

    def _client_failed(
        self,
        stage_index: int,
        detail: str,
        out: list[Command],
        cause: BaseException | None = None,
    ) -> None:
        """A call for stage ``stage_index`` failed in the client itself: no stage is to blame
        and any route would fail the same way. Close the epoch and end the session, filing a
        report that names no stage (so no provider ever excludes a worker for it)."""
        assert self._route is not None  # a live epoch
        endpoint = self._route.stages[stage_index].endpoint
        what = f"a call for stage {stage_index} ({endpoint}) failed in this client: {detail}"
        attempts = self._budget.attempts
        self._report(None, None, FaultKind.CLIENT, what, attempts)
        self._close_epoch(out)
        self._budget.end_wait()
        error = self._failure(
            ClientFailure,
            f"session {self.session_id!r}: {what}; no stage is blamed",
            stage_index=None,
            endpoint=None,
            fault=FaultKind.CLIENT,
            attempts=attempts,
        )
        error.__cause__ = cause
        self._fire("exhausted", stage_index)
        self._end(FinishReason.FAILED, error, out)

    def _busy(
        self, stage_index: int, detail: str, retry_after: float | None, out: list[Command]
    ) -> None:
        """A stage had no free slot for the opening epoch: load, not a fault. Close the epoch
        (releasing the slots its other stages hold), wait the worker's hint and ask the
        provider again; fail only when the admission budget is spent."""
        assert self._route is not None  # opening: a live epoch
        now = self._now
        endpoint = self._route.stages[stage_index].endpoint
        budget = self._budget
        waited = budget.busy(now)
        report = self._report(stage_index, endpoint, FaultKind.BUSY, detail, budget.attempts)
        self._close_epoch(out)
        budget.end_wait()
        if budget.admission_spent(waited):
            error = self._failure(
                functools.partial(AdmissionTimeout, retry_after=retry_after),
                f"session {self.session_id!r}: stage {stage_index} ({endpoint}) still busy after"
                f" {waited:.1f}s of waiting for a session slot"
                f" (admission budget {budget.policy.admission_budget}s)",
                stage_index=stage_index,
                endpoint=endpoint,
                fault=FaultKind.BUSY,
            )
            self._fire("exhausted", stage_index)
            self._end(FinishReason.FAILED, error, out)
            return
        self._fire("stage_lost", stage_index)
        if budget.busy_back_off(now, retry_after, waited):
            self._fire("backoff_elapsed")
            self._ask_route(report, out)

    def _fail_session_deadline(self, out: list[Command]) -> None:
        stage_index = self._awaited_stage()
        endpoint = None
        if stage_index is not None and self._route is not None:
            endpoint = self._route.stages[stage_index].endpoint
        assert self._started_at is not None
        error = self._failure(
            SessionDeadlineExceeded,
            f"session {self.session_id!r} ran past its {self.policy.session_deadline}s deadline"
            f" in state {self._state} at step {len(self._accepted)}",
            stage_index=stage_index,
            endpoint=endpoint,
            fault=None,
        )
        self._close_epoch(out)
        self._fire("exhausted")
        self._end(FinishReason.FAILED, error, out)

    def _failure(
        self,
        error_type: Callable[..., SessionFailed],
        message: str,
        *,
        stage_index: int | None,
        endpoint: str | None,
        fault: FaultKind | None,
        attempts: int | None = None,
    ) -> SessionFailed:
        faults = self._budget.faults_at_step
        if attempts is None:
            attempts = faults if fault is not None else faults + 1
        return error_type(
            message,
            session_id=self.session_id,
            epoch=self._epoch,
            step=len(self._accepted),
            stage_index=stage_index,
            endpoint=endpoint,
            fault=fault,
            attempts=attempts,
            route_changes=self._budget.route_changes,
            reports=self._reports,
        )

    def _close_epoch(self, out: list[Command], keep: PrefixRef | None = None) -> None:
        """Close every stage of the live epoch (opened or not: an open may be in flight),
        each keeping ``keep`` of it."""
        if self._live and self._route is not None:
            for index, stage in enumerate(self._route.stages):
                out.append(CloseStage(self.session_id, self._epoch, index, stage, keep))
        self._live = False

    def _end(self, reason: FinishReason, error: DgrError | None, out: list[Command]) -> None:
        self._error = error
        self._reason = reason
        self._ended_at = self._now
        self._budget.end_wait()
        self._awaiting_route = False
        self._machine.remove_model(self)
        out.append(Finish(self.session_id, self._epoch, reason, tuple(self._accepted), error))
