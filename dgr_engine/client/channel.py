"""The one interface every data path of a chained route implements, on the client's side
(``docs/data-paths.md``): frames go into the route's first stage (:class:`FrameSink`), the last
stage's outcomes come back (:class:`OutcomeSource`), and a call that fails ends with the typed
error of the stage that failed (:class:`StageFailure`), whatever carried it.

Implementations: ``client/grpc_channel.py`` (gRPC: its error model stays there),
``client/frame_link_channel.py`` (the frame link) and ``client/native_channel.py`` (native
links, whose failures are C statuses: ``dgr_engine.status``). ``client/chained/`` speaks only
this.
"""

from __future__ import annotations

from typing import Protocol

from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_session.errors import ShardError

__all__ = ["ChainChannel", "ChannelOver", "FrameSink", "Metadata", "OutcomeSource", "StageFailure"]

Metadata = tuple[tuple[str, str], ...]
"""A call's metadata (the session's ids, for the worker's logs)."""


class StageFailure(Exception):
    """A chained call ended with a stage's failure: ``hop``, the index in the route of the
    stage that failed (the stage that refused a frame, was lost, or sent a malformed one), and
    its typed ``error``."""

    def __init__(self, hop: int, error: ShardError) -> None:
        super().__init__(hop, error)
        self.hop, self.error = hop, error


class ChannelOver(Exception):
    """A frame could not be sent: the stream is over (its end, :meth:`FrameSink.end`, says
    why and where)."""


class FrameSink(Protocol):
    """One epoch's frames into the route's first stage."""

    async def send(self, request: pb.ForwardRequest) -> None:
        """Sends one frame; :class:`ChannelOver` once the stream is over; a
        :class:`~dgr_session.errors.DgrError` when it failed in this client (nothing sent)."""
        ...

    async def finish(self) -> None:
        """Ends the stream cleanly (every stage passes the end on); never raises."""
        ...

    async def end(self) -> None:
        """Waits for the stream's end: returns when it ended cleanly, raises
        :class:`StageFailure` when a stage ended it."""
        ...

    def cancel(self) -> None:
        """Drops the stream at once."""
        ...


class OutcomeSource(Protocol):
    """The last stage's outcomes of one epoch's frames."""

    async def next(self) -> pb.ChainOutputReply | None:
        """The next outcome (the first: the empty reply that says the stream is registered);
        ``None`` once the stream ended cleanly; :class:`StageFailure` when a stage ended it."""
        ...

    def cancel(self) -> None:
        """Drops the stream at once."""
        ...


class ChainChannel(Protocol):
    """One data path to a stage's chained calls."""

    endpoint: str

    def frames(self, metadata: Metadata) -> FrameSink:
        """A stream of frames into this stage (the route's first); a
        :class:`~dgr_session.errors.DgrError` when it failed in this client."""
        ...

    def outcomes(
        self, request: pb.ChainOutputRequest, metadata: Metadata, hop: int
    ) -> OutcomeSource:
        """This stage's (the route's last, of index ``hop``) outcome stream; a
        :class:`~dgr_session.errors.DgrError` when it failed in this client."""
        ...
