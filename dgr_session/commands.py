"""Commands: what a route session asks its driver to do (:meth:`RouteSession.handle` returns them).

The driver executes them in order and feeds back what happened as events. Commands carry the
``(session_id, epoch, step)`` the answers must repeat.
"""

from __future__ import annotations

import enum

import attrs

from dgr_session.errors import DgrError
from dgr_session.faults import FailureReport
from dgr_session.prefixes import PrefixRef
from dgr_session.route import StageSpec
from dgr_session.sampling import Sampling


def _short_ids(ids: tuple[int, ...]) -> str:
    if len(ids) <= 8:
        return repr(ids)
    return f"({', '.join(map(str, ids[:4]))}, ... {len(ids)} ids)"


def _stage(stage: StageSpec) -> str:
    return f"<{stage.endpoint} [{stage.layer_begin}, {stage.layer_end})>"


class FinishReason(enum.StrEnum):
    """Why a session finished."""

    #: ``max_new_tokens`` were produced (state ``done``).
    LENGTH = "length"
    #: A stop token was produced (state ``done``).
    STOP = "stop"
    #: The failure budget or the session deadline ran out (state ``failed``).
    FAILED = "failed"
    #: The caller cancelled (state ``cancelled``).
    CANCELLED = "cancelled"


class ForwardKind(enum.StrEnum):
    """What the rows of a :class:`Forward` are, for metrics and usage (a stage computes them
    alike). A ``str``: ``ForwardKind.PREFILL == "prefill"``."""

    #: The prompt, in the session's first epoch.
    PREFILL = "prefill"
    #: The newest accepted token.
    DECODE = "decode"
    #: A re-prefill of prompt and accepted tokens after a route change.
    REPLAY = "replay"


@attrs.frozen
class OpenStage:
    """Open the session's sequence on a stage for a (fresh) epoch; answer with
    :class:`~dgr_session.events.StageOpened` or :class:`~dgr_session.events.StageFailed`.

    The stage discards any older epoch's state of this session: a route change is a cache miss.
    """

    session_id: str
    """Session."""
    epoch: int
    """Epoch to open."""
    stage_index: int
    """Stage's index in the route."""
    stage: StageSpec = attrs.field(repr=_stage)
    """Stage to open."""
    sampling: Sampling | None = None
    """The session's sampler, for the stage to apply (``None``: the session samples itself)."""
    prefix: PrefixRef | None = None
    """Start from this kept prefix (``docs/prefix-cache.md``): the stage answers the positions
    it opened with (:attr:`~dgr_session.events.StageOpened.next_pos`); length 0: exactly
    empty. ``None``: a plain open."""


@attrs.frozen(kw_only=True)
class Forward:
    """Run ``token_ids`` at ``positions`` through one stage; answer with
    :class:`~dgr_session.events.StageOutput` or :class:`~dgr_session.events.StageFailed`.

    Positions continue the stage's KV for this epoch exactly; after a route change the first
    forward of the new epoch starts at position 0 and replays the prompt and every accepted token.
    """

    session_id: str
    """Session."""
    epoch: int
    """Epoch."""
    step: int
    """Step (number of accepted tokens) this forward produces the next token for."""
    stage_index: int
    """Stage's index in the route."""
    stage: StageSpec = attrs.field(repr=_stage)
    """Stage to run."""
    positions: range
    """KV positions of the tokens, contiguous."""
    token_ids: tuple[int, ...] = attrs.field(repr=_short_ids)
    """Token ids at ``positions`` (stage 0's input; a sideband for later stages that need it)."""
    boundary: object = attrs.field(repr=False)
    """Previous stage's output rows, relayed untouched; ``None`` for stage 0."""
    final: bool
    """True for the last stage: its answer is logits, from which the driver picks a token."""
    wants_logits: bool = True
    """False when nobody reads this forward's logits: a prefill chunk before the prompt's last,
    or an accepted token replayed after a route change. The last stage is then asked for no
    logits (no output head, nothing shipped) and its answer carries no token."""
    kind: ForwardKind = ForwardKind.DECODE
    """What the rows are, for metrics and usage (the stage computes them alike): ``prefill``
    (the prompt, first epoch), ``decode`` (the newest token) or ``replay`` (a re-prefill of
    prompt and accepted tokens after a route change); see :class:`ForwardKind`."""
    drafts: int = 0
    """A verification pass (speculative decoding, ``docs/speculative.md``): the last
    ``drafts`` of ``token_ids`` are draft tokens, and the last stage answers the logits of every
    row (the driver picks a token from each)."""
    kept_drafts: int | None = None
    """The forward after a verification pass: how many of its drafts the session kept; every
    stage drops the positions of the others before it runs these rows (``None``: the previous
    forward was no verification pass)."""
    frame_rows: int = 0
    """A prefill forward of several pinned chunks (the core sends so to a transport that takes
    them: ``prefill_frames``): the transport must run the rows as frames of exactly this many
    (the last one: the rest), in order, sent back to back so that the route's stages work on
    them at once (stage k on frame f + 1 while stage k + 1 is on frame f); only the last frame
    may want logits. Each stage computes the same calls as with one chunk per forward, so the
    bits are the same. 0: one frame."""
    sampled: bool = False
    """The stages know the session's sampler (it states its
    :class:`~dgr_session.sampling.Sampling`, which the open carried): a transport may ask the
    last stage for the token of every logits row the session reads instead of the logits
    (``ForwardRequest.sampled_tokens``) and answer them in
    :attr:`~dgr_session.transport.Logits.sampled`. ``False``: the session needs the logits."""


@attrs.frozen
class CloseStage:
    """Release the session's state for ``epoch`` on a stage. Fire and forget: no answer needed;
    closing something not open (or already gone) must be a no-op."""

    session_id: str
    """Session."""
    epoch: int
    """Epoch to close."""
    stage_index: int
    """Stage's index in the route."""
    stage: StageSpec = attrs.field(repr=_stage)
    """Stage to close."""
    keep: PrefixRef | None = None
    """Keep the epoch's first positions under this name for the client's later sessions
    (``docs/prefix-cache.md``); ``None``: keep nothing."""


@attrs.frozen
class RequestRoute:
    """Ask the route provider for a route; answer with
    :class:`~dgr_session.events.RouteAssigned` or :class:`~dgr_session.events.RouteUnavailable`
    naming ``epoch`` and ``attempt``."""

    session_id: str
    """Session."""
    epoch: int
    """Epoch the assigned route will run under."""
    report: FailureReport | None
    """The fault that made the route necessary (``None`` for the first route)."""
    attempt: int = 1
    """Which request for ``epoch`` this is (1, 2, ...): the answer names it, so that a late
    answer to a request that timed out is not taken for the answer to its retry."""


@attrs.frozen
class EmitToken:
    """A token was accepted. It is final: it will never be resampled, only replayed."""

    session_id: str
    """Session."""
    epoch: int
    """Epoch that produced it."""
    step: int
    """Its index among the generated tokens."""
    token: int
    """Token id."""


@attrs.frozen
class Finish:
    """The session reached a terminal state. Always the last command of a session."""

    session_id: str
    """Session."""
    epoch: int
    """Epoch in force at the end."""
    reason: FinishReason
    """Why it finished."""
    tokens: tuple[int, ...] = attrs.field(repr=_short_ids)
    """Every accepted token."""
    error: DgrError | None = None
    """The terminal error for ``failed`` and ``cancelled``; ``None`` for ``done``."""


#: Every command type the core emits.
Command = OpenStage | Forward | CloseStage | RequestRoute | EmitToken | Finish
