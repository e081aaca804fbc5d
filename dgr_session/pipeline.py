"""The forwards of one epoch: which stages opened, which chunks are on their way, and where.

A route session (:mod:`dgr_session.core`) makes a new :class:`EpochPipeline` for each route it
is assigned and drops the old one whole, so a new epoch starts empty by construction: no
field is reset by hand. The pipeline schedules the epoch's forwards and builds their
:class:`~dgr_session.commands.Forward` commands; it knows nothing of tokens or faults: the core
says what the next chunk into stage 0 is, and what to do with each answer.

The rows from the epoch's first position on are sent in chunks, pipelined: stage k works on
chunk c + 1 while stage k + 1 works on chunk c, each stage takes its chunks in order and one at
a time, and a stage takes its next chunk only once the next stage has taken its output, so at
most 2 chunks per stage are in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from dgr_session.commands import Command, Forward, ForwardKind
from dgr_session.route import StageSpec

_EMPTY = object()
"""An empty input slot of a stage (no boundary rows waiting for it)."""


class Chunk(NamedTuple):
    """The rows of one forward, sent through every stage of the route in turn."""

    positions: range
    """KV positions of the rows, contiguous."""
    token_ids: tuple[int, ...]
    """Token ids at ``positions``."""
    kind: ForwardKind
    """What the rows are (prefill, decode or replay)."""
    wants_logits: bool
    """Whether the last stage's logits pick the next token (the chunk ends at the newest
    position); ``False`` for a prefill chunk before the prompt's last, or replayed rows."""
    drafts: int = 0
    """A verification pass: its last ``drafts`` tokens are drafts (speculative decoding)."""
    kept_drafts: int | None = None
    """The chunk after a verification pass: the pass's drafts the session kept."""
    frame_rows: int = 0
    """Several pinned prefill chunks in one forward: each frame's rows (the pinned chunk; the
    transport sends the rows as frames of that many, back to back, pipelined along the route:
    ``Forward.frame_rows``); 0: one frame."""


class EpochPipeline:
    """Opens and forwards in flight of one session's epoch over ``stages``.

    ``pipelined`` False: one chunk in flight at a time (``FailurePolicy.pipelined``); ``sampled``:
    the stages know the session's sampler (``Forward.sampled``). Mutable;
    owned by one session and touched by one task. Invariants: bit i of ``opened`` is
    set once stage i confirmed the open; every stage holds KV for positions ``[0, kv_pos)``;
    ``flight`` holds the chunks sent to stage 0 whose last stage has not answered, oldest
    first; ``sent`` is where the next chunk starts; ``stage_done[k]`` counts the chunks stage k
    answered, so stage k's current chunk is ``flight[stage_done[k] - stage_done[-1]]``; bit k
    of ``computing`` is set while stage k has a forward in flight; ``slot[k]`` holds the
    boundary rows waiting for stage k.
    """

    __slots__ = (
        "session_id",
        "epoch",
        "stages",
        "pipelined",
        "sampled",
        "n_stages",
        "opened",
        "kv_pos",
        "sent",
        "flight",
        "stage_done",
        "computing",
        "slot",
        "hop_started",
        "hop_seconds",
    )

    def __init__(
        self,
        session_id: str,
        epoch: int,
        stages: Sequence[StageSpec],
        pipelined: bool,
        sampled: bool = False,
    ) -> None:
        n_stages = len(stages)
        #: Session the forwards are for.
        self.session_id = session_id
        #: Epoch the forwards run under.
        self.epoch = epoch
        #: Stages of the epoch's route, in order.
        self.stages = stages
        #: Whether chunks known ahead are pipelined across the stages.
        self.pipelined = pipelined
        #: Whether the stages know the session's sampler (every forward says so:
        #: ``Forward.sampled``).
        self.sampled = sampled
        #: Stages of the route.
        self.n_stages = n_stages
        #: Bit i set once stage i confirmed its open.
        self.opened = 0
        #: Positions every stage holds KV for.
        self.kv_pos = 0
        #: Where the next chunk into stage 0 starts.
        self.sent = 0
        #: Chunks sent to stage 0 whose last stage has not answered, oldest first.
        self.flight: list[Chunk] = []
        #: Chunks each stage answered.
        self.stage_done = [0] * n_stages
        #: Bit k set while stage k has a forward in flight.
        self.computing = 0
        #: Boundary rows waiting for each stage (``_EMPTY``: none).
        self.slot: list[object] = [_EMPTY] * n_stages
        #: Clock time each stage's current forward was sent.
        self.hop_started = [0.0] * n_stages
        #: Seconds each stage took for its last answered forward (``None``: none yet).
        self.hop_seconds: list[float | None] = [None] * n_stages

    # ----------------------------------------------------------------------------------------
    # Opening

    def confirm_open(self, index: int) -> bool:
        """Stage ``index`` confirmed its open (bit ``index`` of ``opened`` was clear); True once
        every stage has."""
        self.opened |= 1 << index
        return self.opened == (1 << self.n_stages) - 1

    def opened_stages(self) -> tuple[int, ...]:
        """Stages that confirmed their open, in route order."""
        return tuple(i for i in range(self.n_stages) if self.opened >> i & 1)

    def first_unopened(self) -> int | None:
        """The first stage whose open is unconfirmed (``None``: every stage opened)."""
        for index in range(self.n_stages):
            if not self.opened & (1 << index):
                return index
        return None

    # ----------------------------------------------------------------------------------------
    # Forwarding

    def computing_stages(self) -> list[int]:
        """Stages with a forward in flight, in route order."""
        return [k for k in range(self.n_stages) if self.computing & (1 << k)]

    def furthest_computing(self) -> int:
        """The furthest stage with a forward in flight (it holds the oldest chunk); 0 if none."""
        computing = self.computing
        return computing.bit_length() - 1 if computing else 0

    def hop_times(self) -> tuple[float | None, ...]:
        """Seconds each stage took for its last answered forward (``None``: none yet)."""
        return tuple(self.hop_seconds)

    def pump(self, index: int, step: int, now: float, out: list[Command]) -> bool:
        """Stage ``index`` may be free to go on (it answered, or rows came for it, or the next
        stage took its output): feed it, and the stages before it in turn, whatever waits for
        them, appending the forwards (of ``step``) to ``out``. A stage takes nothing while its
        own output waits for the next stage. Returns True when stage 0 is free to take a new
        chunk: the caller then gives it one with :meth:`send`, if any rows are left."""
        last = self.n_stages - 1
        slot = self.slot
        while not self.computing & (1 << index):
            if index < last and slot[index + 1] is not _EMPTY:
                return False  # its output is still waiting for the next stage
            if index == 0:
                return self.pipelined or not self.flight  # else one forward in flight
            payload = slot[index]
            if payload is _EMPTY:
                return False
            slot[index] = _EMPTY
            done = self.stage_done
            self.send(index, self.flight[done[index] - done[last]], payload, step, now, out)
            index -= 1  # its output slot is free: the stage before may go on
        return False

    def send(
        self, index: int, chunk: Chunk, payload: object, step: int, now: float, out: list[Command]
    ) -> None:
        """Appends the forward of ``chunk`` through stage ``index`` (free) to ``out``. Into
        stage 0 (``payload`` ``None``), ``chunk`` starts at ``sent`` and joins the flight;
        :meth:`pump` sends the later stages theirs."""
        positions, token_ids, kind, wants_logits, drafts, kept, frame_rows = (
            chunk  # (one unpacking)
        )
        if index == 0:
            self.flight.append(chunk)
            self.sent = positions.stop
        self.computing |= 1 << index
        self.hop_started[index] = now
        out.append(
            Forward(
                session_id=self.session_id,
                epoch=self.epoch,
                step=step,
                stage_index=index,
                stage=self.stages[index],
                positions=positions,
                token_ids=token_ids,
                boundary=payload,
                final=index == self.n_stages - 1,
                wants_logits=wants_logits,
                kind=kind,
                drafts=drafts,
                kept_drafts=kept,
                sampled=self.sampled,
                frame_rows=frame_rows,
            )
        )

    def relay(self, index: int, payload: object, step: int, now: float, out: list[Command]) -> bool:
        """Middle stage ``index`` (computing) answered its current chunk at ``now`` with
        ``payload``, which waits for the next stage; pumps that stage (:meth:`pump`, whose
        answer it returns)."""
        self.computing ^= 1 << index
        self.hop_seconds[index] = now - self.hop_started[index]
        done = self.stage_done
        done[index] += 1
        slot = self.slot
        slot[index + 1] = payload  # the next stage takes it once it is free
        # pump(index + 1, ...), inlined: this runs for every middle stage's answer
        last = self.n_stages - 1
        index += 1
        while not self.computing & (1 << index):
            if index < last and slot[index + 1] is not _EMPTY:
                return False
            if index == 0:
                return self.pipelined or not self.flight
            rows = slot[index]
            if rows is _EMPTY:
                return False
            slot[index] = _EMPTY
            self.send(index, self.flight[done[index] - done[last]], rows, step, now, out)
            index -= 1
        return False

    def complete(self, now: float) -> Chunk:
        """The last stage (computing) answered at ``now``: the oldest chunk went through the
        whole route, and every stage holds KV up to its end. Returns it."""
        index = self.n_stages - 1
        self.computing ^= 1 << index
        self.hop_seconds[index] = now - self.hop_started[index]
        self.stage_done[index] += 1
        chunk = self.flight.pop(0)
        self.kv_pos = chunk.positions.stop
        return chunk
