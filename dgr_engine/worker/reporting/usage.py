"""A worker's own usage records: per (session, epoch), the successful forwards' rows by kind,
bytes and engine time; served by session id (``Usage`` RPC) so a tracker can reconcile the
client's records with the provider's. Bounded: the records of the oldest sessions go first.

A session's records are served only to whoever shows a secret an open of that session
answered here (any epoch's: its client, after the close too), or to the tracker (its grant,
checked by the servicer). A session this worker never opened, or has forgotten, has no records
for anyone: that answer tells nothing but that the id is unknown here."""

from __future__ import annotations

import hmac
from collections import OrderedDict

import attrs

from dgr_engine.errors import GrantUnauthenticated
from dgr_engine.wire.frames import sampling_to_proto
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_session.sampling import GREEDY, Sampling
from dgr_session.usage import RowCounts, StageCost

MAX_SESSIONS_KEPT = 4096
MAX_SECRETS_KEPT = 64
"""Secrets kept per session (one per epoch opened here; the newest)."""


@attrs.define
class _Session:
    epochs: dict[int, RowCounts] = attrs.Factory(dict)
    secrets: list[bytes] = attrs.Factory(list)
    """The secrets its opens here answered, oldest first (at most ``MAX_SECRETS_KEPT``)."""
    samplers: dict[int, Sampling] = attrs.Factory(dict)
    """The sampler each epoch's open carried (``docs/sampling.md``): this session's own."""


class UsageBook:
    """Counts by session and epoch; keeps the last ``limit`` sessions."""

    def __init__(self, layers: tuple[int, int], limit: int = MAX_SESSIONS_KEPT) -> None:
        self.layers = layers
        self.limit = limit
        self._sessions: OrderedDict[str, _Session] = OrderedDict()

    def _entry(self, session_id: str) -> _Session:
        entry = self._sessions.get(session_id)
        if entry is None:
            entry = self._sessions[session_id] = _Session()
            while len(self._sessions) > self.limit:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session_id)
        return entry

    def opened(self, session_id: str, epoch: int, secret: bytes, sampling: Sampling) -> None:
        """An open of ``session_id`` at ``epoch`` with ``sampling`` answered ``secret``: it
        may read the session's usage, whose record of that epoch states the sampler."""
        entry = self._entry(session_id)
        entry.secrets.append(bytes(secret))
        del entry.secrets[:-MAX_SECRETS_KEPT]
        entry.samplers[epoch] = sampling
        while len(entry.samplers) > MAX_SECRETS_KEPT:
            del entry.samplers[min(entry.samplers)]

    def check(self, session_id: str, secret: bytes) -> None:
        """Before a ``Usage`` without the tracker's credential: ``GrantUnauthenticated``
        unless ``secret`` is one an open of this (known) session answered."""
        entry = self._sessions.get(session_id)
        if entry is None:
            return  # unknown or forgotten: no records to show
        given = bytes(secret)
        if not any([hmac.compare_digest(held, given) for held in entry.secrets]):
            raise GrantUnauthenticated(
                f"DGR_E_UNAUTHENTICATED: usage of session {session_id!r}: no or the wrong "
                "session secret"
            )

    def forwarded(
        self,
        session_id: str,
        epoch: int,
        kind: str,
        rows: int,
        bytes_in: int,
        bytes_out: int,
        engine_seconds: float,
        drafts: int = 0,
        kept_drafts: int | None = None,
        *,
        forwards: int = 1,
    ) -> None:
        epochs = self._entry(session_id).epochs
        counts = epochs.get(epoch)
        if counts is None:
            counts = epochs[epoch] = RowCounts()
        cost = StageCost(bytes_in, bytes_out, engine_seconds)
        counts.add(kind, rows, cost, forwards=forwards)
        if drafts or kept_drafts is not None:
            counts.verified(drafts, kept_drafts)

    def reply(self, session_id: str) -> pb.UsageReply:
        """The records of ``session_id`` (none when unknown or forgotten); authorised by
        :meth:`check` or the tracker's credential first."""
        begin, end = self.layers
        out = pb.UsageReply()
        entry = self._sessions.get(session_id)
        for epoch, c in sorted(entry.epochs.items() if entry is not None else ()):
            sampling = entry.samplers.get(epoch, GREEDY) if entry is not None else GREEDY
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
                    rows_draft=c.draft,
                    rows_rejected=c.rejected,
                    sampling=sampling_to_proto(sampling),
                )
            )
        return out
