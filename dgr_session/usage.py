"""Usage records: what one session cost on each stage of each epoch, as the client saw it.

A tracker bills from these (and reconciles them with the workers' own records, which a worker
serves by session id). Rows are counted by kind: ``prefill`` (the prompt, first epoch),
``decode`` (one new token per forward) and ``replay`` (the re-prefill after a route change; the
record names the fault that made it necessary). Bytes and engine time are what the transport
reported (``StageCost``); a transport that reports none leaves them 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from dgr_session.faults import FaultKind
from dgr_session.sampling import Sampling


@attrs.frozen
class StageCost:
    """What a transport measured of one forward on one stage."""

    bytes_in: int = 0
    """Bytes sent to the stage (tokens, positions, boundary rows)."""
    bytes_out: int = 0
    """Bytes the stage answered with (boundary rows or logits)."""
    engine_seconds: float = 0.0
    """The stage's engine time for the forward, as it reported."""


@attrs.frozen
class UsageRecord:
    """One session's use of one stage in one epoch (successful forwards only)."""

    session_id: str
    epoch: int
    stage_index: int
    endpoint: str
    layers: tuple[int, int]
    forwards: int
    rows_prefill: int
    rows_decode: int
    rows_replay: int
    bytes_in: int
    bytes_out: int
    engine_seconds: float
    replay_cause: FaultKind | None
    """The fault that ended the previous epoch, when this one replayed (else ``None``)."""
    rows_draft: int = 0
    """Draft rows verified (speculative decoding; counted in ``rows_decode`` too)."""
    rows_rejected: int = 0
    """Of those, the rows the session did not keep: compute it pays for, no token."""
    sampling: Sampling | None = None
    """The session's sampler as the stage held it (a worker's record: its open's, which the
    last stage applied; billed alike whatever it is); ``None`` in the client's own ledger."""

    @property
    def rows(self) -> int:
        return self.rows_prefill + self.rows_decode + self.rows_replay


@attrs.define
class RowCounts:
    """Running totals of one (session, epoch) on one stage: what a usage record is made of
    (the client's ledger here, a worker's usage book there)."""

    forwards: int = 0
    prefill: int = 0
    decode: int = 0
    replay: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    engine_seconds: float = 0.0
    draft: int = 0
    """Draft rows verified (speculative decoding); counted in ``decode`` too."""
    rejected: int = 0
    """Of the draft rows, those the session did not keep: compute someone pays for."""
    pending_drafts: int = 0
    """Drafts of the last verification pass, until the next frame says how many were kept."""

    def verified(self, drafts: int, kept: int | None) -> None:
        """A forward's speculative part: the ``drafts`` rows it verified, and ``kept`` (not
        ``None``: it followed a verification pass) of the previous pass's drafts kept."""
        if kept is not None:
            self.rejected += max(self.pending_drafts - kept, 0)
        self.pending_drafts = drafts
        self.draft += drafts

    def add(self, kind: str, rows: int, cost: StageCost | None, *, forwards: int = 1) -> None:
        """One successful forward of ``rows`` rows of ``kind`` (else counted as decode); or
        ``forwards`` of them together (a native link's frames, counted from its totals)."""
        self.forwards += forwards
        if kind == "prefill":
            self.prefill += rows
        elif kind == "replay":
            self.replay += rows
        else:
            self.decode += rows
        if cost is not None:
            self.bytes_in += cost.bytes_in
            self.bytes_out += cost.bytes_out
            self.engine_seconds += cost.engine_seconds


@attrs.define
class _Tally(RowCounts):
    endpoint: str = ""
    layers: tuple[int, int] = (0, 0)


class UsageLedger:
    """Counts one session's forwards by (epoch, stage) as they succeed."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._tallies: dict[tuple[int, int], _Tally] = {}
        self._causes: dict[int, FaultKind] = {}

    def forwarded(
        self,
        epoch: int,
        stage_index: int,
        endpoint: str,
        layers: tuple[int, int],
        kind: str,
        rows: int,
        cost: StageCost | None,
        drafts: int = 0,
        kept_drafts: int | None = None,
    ) -> None:
        key = (epoch, stage_index)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = _Tally(endpoint=endpoint, layers=layers)
        tally.add(kind, rows, cost)
        if drafts or kept_drafts is not None:
            tally.verified(drafts, kept_drafts)

    def epoch_ended(self, epoch: int, fault: FaultKind) -> None:
        """``epoch`` ended with ``fault``: the next epoch's replay is its cost."""
        self._causes[epoch + 1] = fault

    def records(self) -> tuple[UsageRecord, ...]:
        return tuple(self._record(key, tally) for key, tally in sorted(self._tallies.items()))

    def _record(self, key: tuple[int, int], tally: _Tally) -> UsageRecord:
        epoch, stage_index = key
        replayed = tally.replay > 0
        cause = self._causes.get(epoch) if replayed else None
        if replayed and cause is None:  # epochs refused before any forward: the last cause
            cause = next(
                (self._causes[e] for e in sorted(self._causes, reverse=True) if e <= epoch), None
            )
        return UsageRecord(
            session_id=self.session_id,
            epoch=epoch,
            stage_index=stage_index,
            endpoint=tally.endpoint,
            layers=tally.layers,
            forwards=tally.forwards,
            rows_prefill=tally.prefill,
            rows_decode=tally.decode,
            rows_replay=tally.replay,
            bytes_in=tally.bytes_in,
            bytes_out=tally.bytes_out,
            engine_seconds=tally.engine_seconds,
            replay_cause=cause,
            rows_draft=tally.draft,
            rows_rejected=tally.rejected,
        )


def layer_rows(records: Iterable[UsageRecord]) -> int:
    """Layer-rows are what compute costs: rows times the layers of each stage."""
    return sum(r.rows * (r.layers[1] - r.layers[0]) for r in records)
