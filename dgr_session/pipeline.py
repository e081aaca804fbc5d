"""The forwards of one epoch: which stages opened, which chunks are on their way, and where.

A route session (:mod:`dgr_session.core`) makes a new :class:`EpochPipeline` for each route it
is assigned and drops the old one whole, so a new epoch starts empty by construction: no
field is reset by hand. The pipeline knows nothing of tokens, policies or the session's
commands beyond what it is handed: the core says what the next chunk is and turns each send
into a :class:`~dgr_session.commands.Forward`.

The rows from the epoch's first position on are sent in chunks, pipelined: stage k works on
chunk c + 1 while stage k + 1 works on chunk c, each stage takes its chunks in order and one at
a time, and a stage takes its next chunk only once the next stage has taken its output, so at
most 2 chunks per stage are in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from dgr_session.commands import Command, Forward, ForwardKind

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


class EpochPipeline:
    """Opens and forwards in flight of one epoch over a route of ``n_stages`` stages.

    Mutable; owned by one session and touched by one task. Invariants: bit i of ``opened`` is
    set once stage i confirmed the open; every stage holds KV for positions ``[0, kv_pos)``;
    ``flight`` holds the chunks sent to stage 0 whose last stage has not answered, oldest
    first; ``sent`` is where the next chunk starts; ``stage_done[k]`` counts the chunks stage k
    answered, so stage k's current chunk is ``flight[stage_done[k] - stage_done[-1]]``; bit k
    of ``computing`` is set while stage k has a forward in flight; ``slot[k]`` holds the
    boundary rows waiting for stage k.
    """

    __slots__ = (
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

    def __init__(self, n_stages: int) -> None:
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
        """Stage ``index`` confirmed its open; ``False`` when it had already (nothing changes)."""
        bit = 1 << index
        if self.opened & bit:
            return False
        self.opened |= bit
        return True

    @property
    def all_open(self) -> bool:
        """True once every stage confirmed its open."""
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

    def is_computing(self, index: int) -> bool:
        """True while stage ``index`` has a forward in flight."""
        return bool(self.computing & (1 << index))

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

    def pump(
        self,
        index: int,
        now: float,
        out: list[Command],
        *,
        pipelined: bool,
        next_chunk: Callable[[int], Chunk | None],
        forward: Callable[[int, Chunk, object], Forward],
    ) -> None:
        """Stage ``index`` may be free to go on (it answered, or rows came for it, or the next
        stage took its output): feed it, and the stages before it in turn, whatever waits for
        them. A stage takes nothing while its own output waits for the next stage.

        ``next_chunk(sent)`` gives the chunk into stage 0 starting at ``sent`` (``None``: every
        row was sent); ``forward(index, chunk, boundary)`` builds the command, appended to
        ``out``. ``pipelined`` False: one chunk in flight at a time."""
        last = self.n_stages - 1
        slot = self.slot
        while not self.computing & (1 << index):
            if index < last and slot[index + 1] is not _EMPTY:
                return  # its output is still waiting for the next stage
            if index == 0:
                if self.flight and not pipelined:
                    return  # one forward in flight per session
                chunk = next_chunk(self.sent)
                if chunk is not None:
                    self.flight.append(chunk)
                    self.sent = chunk.positions.stop
                    self._send(0, chunk, None, now, out, forward)
                return
            payload = slot[index]
            if payload is _EMPTY:
                return
            slot[index] = _EMPTY
            done = self.stage_done
            chunk = self.flight[done[index] - done[last]]
            self._send(index, chunk, payload, now, out, forward)
            index -= 1  # its output slot is free: the stage before may go on

    def _send(
        self,
        index: int,
        chunk: Chunk,
        payload: object,
        now: float,
        out: list[Command],
        forward: Callable[[int, Chunk, object], Forward],
    ) -> None:
        self.computing |= 1 << index
        self.hop_started[index] = now
        out.append(forward(index, chunk, payload))

    def answered(self, index: int, payload: object, now: float) -> Chunk | None:
        """Stage ``index`` (computing) answered its current chunk at ``now``. A middle stage's
        ``payload`` waits for the next stage (pump it next) and ``None`` is returned; the last
        stage's answer completes the oldest chunk, which is returned (every stage now holds KV
        up to its end)."""
        self.computing ^= 1 << index
        self.hop_seconds[index] = now - self.hop_started[index]
        self.stage_done[index] += 1
        if index < self.n_stages - 1:
            self.slot[index + 1] = payload  # the next stage takes it once it is free
            return None
        chunk = self.flight.pop(0)
        self.kv_pos = chunk.positions.stop
        return chunk
