"""The driver's side: interfaces a :class:`~dgr_session.manager.SessionManager` runs over.

* :class:`StageTransport` reaches stages (a gRPC client, or in-process engines in tests).
  A stage keeps per-session state keyed by ``(session_id, epoch)``: opening a newer epoch
  discards the older one (a cache miss), a request for an older epoch is refused
  (:class:`~dgr_session.errors.StaleEpoch`), and positions must continue the epoch's KV
  exactly.
* :class:`RouteProvider` is the tracker's role: given what failed, assign a route or none.

What flows between stages is opaque here: the manager relays what stage k returns into stage
k + 1 untouched.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import attrs

from dgr_session.commands import Forward
from dgr_session.faults import FailureReport
from dgr_session.route import Route, StageSpec
from dgr_session.sampling import Sampling
from dgr_session.speculation import Speculation
from dgr_session.usage import StageCost


@attrs.frozen
class Boundary:
    """A middle stage's answer: boundary rows for the next stage (opaque to dgr_session)."""

    rows: object = attrs.field(repr=False)
    """Rows (e.g. f32 ``n_tokens x width``), relayed untouched to the next stage."""
    cost: StageCost | None = None
    """What the transport measured of this forward (usage records); ``None``: nothing."""


@attrs.frozen
class Logits:
    """The last stage's answer: logits for the last position forwarded (empty when the forward
    wanted none)."""

    values: Any = attrs.field(repr=False)
    """Scores per token id: a sequence of floats or an array with ``argmax``."""
    cost: StageCost | None = None
    """What the transport measured of this forward (usage records); ``None``: nothing."""
    rows: Any = attrs.field(default=None, repr=False)
    """Every logits row the stage returned (a verification pass wants one per row);
    ``None``: only ``values``."""
    sampled: tuple[int, ...] | None = None
    """For a sampled forward (:attr:`~dgr_session.commands.Forward.sampled`): the session's
    token of each row the stage answered, when it answered those instead of the logits
    (``values`` and ``rows`` are then empty); ``None``: it answered logits, from which the
    driver takes them with the session's sampler."""

    @classmethod
    def last_row(cls, rows: Any, cost: StageCost | None = None) -> Logits:
        """The logits of the last of ``rows`` (the logit rows a stage returned), empty when it
        returned none (the forward wanted no logits); ``rows`` are kept as they are."""
        return cls(rows[-1] if len(rows) else (), cost, rows)

    @classmethod
    def sampled_tokens(cls, tokens: tuple[int, ...], cost: StageCost | None = None) -> Logits:
        """A stage's tokens, one per row it answered, in place of their logits."""
        return cls((), cost, None, tokens)


#: What a stage answers to a forward.
StageResult = Boundary | Logits


@attrs.frozen
class TransportCapabilities:
    """What a transport does beyond running each forward as it comes, declared once as a value
    (``StageTransport.capabilities``) that the manager reads as a session starts."""

    prefill_frames: int = attrs.field(default=1)
    """Frames of one prefill the transport keeps in flight (chunks pipelined along a chained
    route); 1: one at a time."""
    runs_ahead: bool = False
    """The route runs ahead of the session on its own (a ring: its last stage sends the next
    step's frame itself), within the limits the session gives it as it starts
    (:meth:`StageTransport.session_starting`)."""
    drafts_on_route: bool = False
    """A speculating session's drafts may be made on the route (a ring's last stage, a last
    stage's MTP block): the transport gives the session the speculation it runs with
    (:meth:`StageTransport.session_starting`)."""

    finds_silent_stages: bool = False
    """The transport watches an epoch's stages itself while a frame is overdue (a chained
    route, whose client hears only its last stage) and fails the epoch naming a stage that
    went silent; a step deadline then names no stage, since the client cannot tell which
    stage held the step (``dgr_session.errors.RouteStalled``)."""

    keeps_prefixes: bool = False
    """The transport's opens may start from a prompt prefix the stages kept
    (:attr:`~dgr_session.commands.OpenStage.prefix`) and its closes may ask them to keep one
    (:attr:`~dgr_session.commands.CloseStage.keep`): ``open`` and ``close`` take ``prefix``
    and ``keep``, and ``open`` answers the positions the stage opened with
    (``docs/prefix-cache.md``)."""

    @prefill_frames.validator
    def _check_frames(self, _attribute: object, value: int) -> None:
        if value < 1:
            raise ValueError(f"prefill_frames must be >= 1, got {value}")

    @property
    def told_of_sessions(self) -> bool:
        """Whether the transport is told of each session as it starts."""
        return self.runs_ahead or self.drafts_on_route


@attrs.frozen
class SessionStart:
    """What a transport is told of a session as it starts (when it declares a capability that
    needs it)."""

    session_id: str
    max_new_tokens: int
    stop_tokens: tuple[int, ...]
    speculation: Speculation | None
    """The caller's speculation, never changed: a transport that drafts on the route answers
    another value in its place (``attrs.evolve``, sharing the tally)."""


class StageTransport(Protocol):
    """Reaches stages. Raise :class:`~dgr_session.errors.StageDead` (or any ``ConnectionError``)
    when a stage is unreachable, :class:`~dgr_session.errors.StaleEpoch` for an old epoch, and
    a :class:`~dgr_session.errors.DgrError` (e.g. the engine's error) for an engine failure.

    A transport declares what it does beyond plain forwards in :attr:`capabilities`; one that
    subclasses this protocol inherits none (and :meth:`session_starting`'s default)."""

    capabilities: TransportCapabilities = TransportCapabilities()
    """What the transport does beyond plain forwards (none, unless it says)."""

    def session_starting(self, start: SessionStart) -> Speculation | None:
        """Told as a session starts, when :attr:`capabilities` says the transport needs it
        (``told_of_sessions``): the speculation the session runs with (``start``'s, or
        another value in its place where the route drafts)."""
        return start.speculation

    async def open(
        self, stage: StageSpec, session_id: str, epoch: int, sampling: Sampling | None = None
    ) -> int | None:
        """Open the session's sequence on ``stage`` for ``epoch``, discarding older epochs;
        ``sampling``: the session's sampler, which the stage applies to its
        :attr:`~dgr_session.commands.Forward.sampled` forwards (``None``: greedy). A transport
        that declares ``keeps_prefixes`` also takes ``prefix`` (a
        :class:`~dgr_session.prefixes.PrefixRef`, by keyword) and answers the positions the
        stage opened with; any other answers ``None`` (none)."""
        ...

    async def forward(self, call: Forward) -> StageResult:
        """Run one :class:`~dgr_session.commands.Forward`, the core's command, as it is.

        What the transport reads of it: ``stage`` (where), ``session_id``, ``epoch`` and ``step``
        (which session, epoch and step the answer belongs to), ``positions`` and ``token_ids``
        (the tokens, at KV positions that continue the epoch exactly), ``boundary`` (the previous
        stage's rows, relayed untouched; ``None`` for stage 0), ``wants_logits`` (``False``:
        nobody reads the last stage's logits this time, a prefill chunk or a replayed token; a
        transport may skip computing and shipping them, and its :class:`Logits` may then be
        empty) and ``kind`` (a :class:`~dgr_session.commands.ForwardKind`: ``prefill``,
        ``decode`` or ``replay``, for the stage's metrics and usage records; rows compute alike),
        ``drafts`` (a verification pass: ask the last stage for the logits of every row, return
        them all in :attr:`Logits.rows`, and tell every stage of the drafts) and
        ``kept_drafts`` (tell every stage how many of the last pass's drafts were kept) and
        ``sampled`` (the stages know the session's sampler: the transport may ask the last
        stage for the session's token of each row instead of its logits and answer them in
        :attr:`Logits.sampled`).
        ``stage_index`` and ``final`` are the driver's.

        Return :class:`Boundary` from a middle stage, :class:`Logits` from the last. A field the
        core adds to ``Forward`` reaches every transport without a signature changing."""
        ...

    async def close(self, stage: StageSpec, session_id: str, epoch: int) -> None:
        """Release the session's ``epoch`` on ``stage``; a no-op if not held. A transport that
        declares ``keeps_prefixes`` also takes ``keep`` (by keyword): what the stage keeps of
        it first."""
        ...


class RouteProvider(Protocol):
    """Assigns routes (the tracker's role; routing policy stays there)."""

    async def assign(self, session_id: str, report: FailureReport | None) -> Route | None:
        """A route for the session, or ``None`` if there is none. ``report`` says what failed
        (``None`` for the first route)."""
        ...


@runtime_checkable
class GrantingRouteProvider(Protocol):
    """A route provider whose stages need the tracker's route grants: after each assignment the
    manager asks it to grant the route for the session and the epoch it will run under. The
    grants are opaque bytes here (``StageSpec.grant``); dgr_session never sees a key."""

    def grant_route(self, session_id: str, epoch: int, route: Route) -> Route:
        """``route`` with every stage's grant for ``(session_id, epoch)``."""
        ...
