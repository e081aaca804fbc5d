"""What one chained frame's outcome is (:class:`ChainTicket`, relayed by the route session from
stage to stage in place of boundary rows), what chained frames cost (:class:`ChainRecord`,
:class:`ChainStats`), and the ring's one refusal of its own (:class:`RingMismatch`)."""

from __future__ import annotations

import asyncio

import attrs

from dgr_engine.errors import ShardRpcError
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_session.faults import FaultKind

__all__ = ["ChainRecord", "ChainStats", "ChainTicket", "RingMismatch"]


class RingMismatch(ShardRpcError):
    """The session's token differs from the token a ring already ran (its last stage took
    another): the stages' state is no longer the session's. Nothing is wrong with them, so it
    is filed as ``state_lost``: the epoch ends, the session re-prefills, nobody is blamed."""

    fault_kind = FaultKind.STATE_LOST


@attrs.define(eq=False)
class ChainTicket:
    """One chained frame's outcome, relayed by the route session from stage to stage in place of
    boundary rows: the last stage's reply and every stage's trace, or the stage that failed."""

    step: int
    """The frame's step."""
    rows: int
    """The frame's rows."""
    done: asyncio.Future[None] = attrs.field(repr=False)
    """Resolved once the outcome is known."""
    reply: pb.ChainOutputReply | None = attrs.field(default=None, repr=False)
    """The last stage's output and every stage's trace (success)."""
    failed_hop: int | None = None
    """The index of the stage that refused or was lost (failure)."""
    error: Exception | None = None
    """Its typed error (failure)."""

    def succeed(self, reply: pb.ChainOutputReply) -> None:
        if not self.done.done():
            self.reply = reply
            self.done.set_result(None)

    def fail(self, hop: int, error: Exception) -> None:
        if not self.done.done():
            self.failed_hop, self.error = hop, error
            self.done.set_result(None)


@attrs.frozen
class ChainRecord:
    """One chained frame that came back (handed to ``chain_observer``)."""

    session_id: str
    epoch: int
    step: int
    rows: int
    """Rows of the frame."""
    rtt_us: int
    """Client time from sending the frame to the first stage to its output's arrival."""
    handler_us: tuple[int, ...]
    """Each stage's handler time (checks, engine, the frame to the next stage built)."""
    compute_us: tuple[int, ...]
    """Each stage's engine time."""
    native_us: tuple[int, ...] = ()
    """Of each stage's engine time, the part inside llama.cpp (0 from a worker that does not
    say: ``Timings.native_us``)."""


@attrs.define
class ChainStats:
    """What chained frames cost, summed over the transport's lifetime (successful frames)."""

    frames: int = 0
    """Chained frames that came back."""
    sent: int = 0
    """Frames the client sent to the first stage (on a ring, the rest the last stage sent)."""
    rtt_us: int = 0
    """Client time from sending each frame to the first stage to its output's arrival."""
    handler_us: int = 0
    """Time the stages spent in their handlers (checks, engine, reply), summed over stages."""
    compute_us: int = 0
    """Engine time, summed over stages."""
    native_us: int = 0
    """Of the engine time, the part inside llama.cpp, summed over stages."""
    frame_link_epochs: int = 0
    """Epochs whose frames took frame links (the rest took gRPC or native links)."""
    native_epochs: int = 0
    """Epochs whose frames took native links (``docs/native-path.md``)."""
    native_fallbacks: int = 0
    """Epochs that took the next path because a stage took no native link (its port refused
    or unreachable, or full), with ``data_path="auto"``."""

    @property
    def transit_us(self) -> int:
        """The rest: every hop's gRPC transit (network included) and the client's own code."""
        return self.rtt_us - self.handler_us
