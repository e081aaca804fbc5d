"""A worker's own usage records: per (session, epoch), the successful forwards' rows by kind,
bytes and engine time; served by session id (``Usage`` RPC) so a tracker can reconcile the
client's records with the provider's. Bounded: the records of the oldest sessions go first."""

from __future__ import annotations

from collections import OrderedDict

from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_session.usage import RowCounts, StageCost

MAX_SESSIONS_KEPT = 4096


class UsageBook:
    """Counts by session and epoch; keeps the last ``limit`` sessions."""

    def __init__(self, layers: tuple[int, int], limit: int = MAX_SESSIONS_KEPT) -> None:
        self.layers = layers
        self.limit = limit
        self._sessions: OrderedDict[str, dict[int, RowCounts]] = OrderedDict()

    def forwarded(
        self,
        session_id: str,
        epoch: int,
        kind: str,
        rows: int,
        bytes_in: int,
        bytes_out: int,
        engine_seconds: float,
    ) -> None:
        epochs = self._sessions.get(session_id)
        if epochs is None:
            epochs = self._sessions[session_id] = {}
            while len(self._sessions) > self.limit:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session_id)
        counts = epochs.get(epoch)
        if counts is None:
            counts = epochs[epoch] = RowCounts()
        counts.add(kind, rows, StageCost(bytes_in, bytes_out, engine_seconds))

    def reply(self, session_id: str) -> pb.UsageReply:
        """The records of ``session_id`` (none when unknown or forgotten)."""
        begin, end = self.layers
        out = pb.UsageReply()
        for epoch, c in sorted(self._sessions.get(session_id, {}).items()):
            out.records.append(
                pb.UsageRecord(
                    session_id=session_id,
                    epoch=epoch,
                    layer_begin=begin,
                    layer_end=end,
                    forwards=c.forwards,
                    rows_prefill=c.prefill,
                    rows_decode=c.decode,
                    rows_replay=c.replay,
                    bytes_in=c.bytes_in,
                    bytes_out=c.bytes_out,
                    engine_seconds=c.engine_seconds,
                )
            )
        return out
