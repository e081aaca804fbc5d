"""A drafting ring's last stage (``docs/speculative.md``): it keeps the session's tokens as the
frames bring them, verifies each pass it sent (the longest run of drafts equal to the tokens
its sampler took, and the token after it), and drafts the next pass by prompt lookup over
those tokens, so a pass costs one trip around the ring and never a trip to the client.

What it keeps is per (session, epoch), forgotten with the epoch (``ChainHub``), except what a
pass around the ring costs (its draft length's ``PassTimes``), which the hub keeps per ring for
the next session that drafts over it."""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs

from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_session.drafts import DraftLength, NgramDrafter, PassTimes
from dgr_session.speculation import MAX_DRAFTS, Speculation, kept_drafts


@attrs.define(eq=False)
class RingDrafting:
    """One session's drafting on a ring's last stage."""

    epoch: int
    """The epoch it drafts for."""
    k_max: int
    """Most drafts a pass may carry (the frame's ``ring_draft_max``, at most ``MAX_DRAFTS``)."""
    warm: PassTimes | None = None
    """What an earlier session's passes around the same ring cost (its draft length's
    averages), to draft from the first pass on; ``None``: this session times its own first."""
    tokens: list[int] = attrs.Factory(list)
    """The token of every position the stage ran, in order."""
    length: DraftLength = attrs.field(init=False)
    """How many drafts its next pass carries (timed by the passes this stage sends)."""
    speculation: Speculation = attrs.field(init=False)
    sent: tuple[int, float] | None = None
    """The position of the last frame this stage sent on, and when (``time.monotonic``): the
    time it takes to come back is the pass's, which the draft length learns from."""

    def __attrs_post_init__(self) -> None:
        self.k_max = min(self.k_max, MAX_DRAFTS)
        self.length = DraftLength(k_max=self.k_max, times=self.warm)
        self.speculation = Speculation(NgramDrafter(), self.length, max_drafts=self.k_max)

    def ran(self, start: int, token_ids: Sequence[int]) -> bool:
        """The stage ran rows with ``token_ids`` from position ``start``: what it held from
        ``start`` on (rejected drafts) is replaced. False when ``start`` leaves a gap: the
        tokens before it never came here, so nothing can be drafted from them."""
        if start > len(self.tokens):
            return False
        del self.tokens[start:]
        self.tokens.extend(int(t) for t in token_ids)
        return True

    def next_tokens(
        self, request: pb.ForwardRequest, sampled: Sequence[int]
    ) -> tuple[list[int], int | None] | None:
        """The tokens the frame ``request`` gives (the kept drafts' and the one after them on a
        pass) and how many drafts it kept (``None``: no pass), given the session's token of
        each row its reply answered (``sampled``); ``None`` when those do not cover the rows it
        needs."""
        n = len(request.positions)
        drafts = int(request.draft_rows)
        seconds = None  # a frame this stage sent: the time of its pass around the ring
        if self.sent is not None and self.sent[0] == int(request.positions[0]):
            seconds = time.monotonic() - self.sent[1]
        self.sent = None
        if not drafts:
            if seconds is not None:  # a plain pass of the ring's own
                self.speculation.verified(0, 0, seconds)
            return [int(sampled[-1])], None
        if len(sampled) != n:
            return None
        kept = kept_drafts(list(sampled), request.token_ids[n - drafts :])
        if seconds is not None:  # a pass this stage drafted (one of the session's own: no)
            self.speculation.verified(drafts, kept, seconds)
        return [int(t) for t in sampled[: kept + 1]], kept

    def draft(
        self, position: int, token: int, room: int, mtp: tuple[int, ...] | None = None
    ) -> tuple[int, ...]:
        """Drafts to follow ``token`` at ``position`` (the tokens before it are those the stage
        ran), at most ``room``: by prompt lookup, or the MTP block's ``mtp`` drafts when the
        stage made them (a ring drafting with MTP); as many as the draft length allows."""
        if mtp is not None:
            drafts = mtp[: max(min(room, self.k_max, self.length.k), 0)]
            self.sent = (position, time.monotonic())
            return drafts
        history = [*self.tokens[:position], token]
        drafts = self.speculation.propose(history, (), min(room, self.k_max))
        self.sent = (position, time.monotonic())
        return drafts


__all__ = ["RingDrafting"]
