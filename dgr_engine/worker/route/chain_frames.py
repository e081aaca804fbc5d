"""The frames a stage of a chained route sends on (``docs/chain.md``): the next stage's frame
for a frame it ran, and, on a ring's last stage, the next step's frame for the first stage
(the session's token of the last row it ran, which the session's sampler took there, the
open's: ``docs/sampling.md``; on a drafting ring, the token after the kept drafts of a pass,
with the next pass's drafts: prompt lookup's, or the MTP block's when the frames ask the last
stage for them, ``mtp_draft_max``)."""

from __future__ import annotations

from collections.abc import Sequence

from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.worker.route.chain_downstream import ChainLink
from dgr_engine.worker.route.ring_drafts import RingDrafting


def next_frame(
    request: pb.ForwardRequest, reply: pb.ForwardReply, link: ChainLink, trace: pb.HopTrace
) -> pb.ForwardRequest:
    """The frame for the next stage: the same rows, positions and token ids, this stage's
    output as the boundary, the next stage's expectations and secret."""
    out = pb.ForwardRequest(
        session_id=request.session_id,
        epoch=request.epoch,
        step=request.step,
        expect=link.expect,
        expected_next_pos=request.expected_next_pos,
        positions=request.positions,
        token_ids=request.token_ids,
        boundary=reply.output,
        logit_rows=request.logit_rows,
        timeout_ms=request.timeout_ms,
        no_logits=request.no_logits,
        session_secret=link.secret,
        kind=request.kind,
        chain_hop=request.chain_hop + 1,
        ring_until_step=request.ring_until_step,
        ring_stop=request.ring_stop,
        draft_rows=request.draft_rows,
        ring_draft_max=request.ring_draft_max,
        mtp_draft_max=request.mtp_draft_max,
        sampled_tokens=request.sampled_tokens,
    )
    if request.HasField("kept_drafts"):
        out.kept_drafts = request.kept_drafts
    out.chain_trace.extend(request.chain_trace)
    out.chain_trace.append(trace)
    return out


def ring_frame(
    request: pb.ForwardRequest,
    reply: pb.ForwardReply,
    sampled: Sequence[int] | None,
    link: ChainLink,
    drafting: RingDrafting | None = None,
) -> pb.ForwardRequest | None:
    """A ring's next frame after ``request``: ``sampled`` (the session's token of each of its
    logits rows, as the stage took them) gives the token at the next position, for the next
    step; on a drafting ring (``drafting``), after a pass it sent, the tokens the pass kept
    decide the next token and its position, and the next frame carries the drafts of the next
    pass. ``None`` when the ring stops there (no logits, the
    step limit, a stop token, a pass of the session's own making)."""
    n = len(request.positions)
    if request.ring_until_step <= request.step or request.no_logits or n == 0:
        return None
    if request.draft_rows and drafting is None:  # the session's own pass: it decides
        return None
    if not request.draft_rows and request.logit_rows and request.logit_rows[-1] != n - 1:
        return None
    if not sampled:
        return None
    if drafting is None:
        accepted, kept = [sampled[-1]], None
    else:
        verdict = drafting.next_tokens(request, sampled)
        if verdict is None:
            return None
        accepted, kept = verdict
    if any(token in request.ring_stop for token in accepted):
        return None
    step = int(request.step) + len(accepted)
    if step > request.ring_until_step:
        return None
    position = int(request.positions[0]) + (n if kept is None else 1 + kept)
    token = accepted[-1]
    drafts: tuple[int, ...] = ()
    if drafting is not None:
        room = int(request.ring_until_step) - step
        mtp = None  # a ring drafting with the MTP block: the drafts its last stage just made
        if request.mtp_draft_max:
            same = reply.mtp_draft_pos == position and len(reply.mtp_drafts) > 0
            mtp = tuple(int(t) for t in reply.mtp_drafts) if same else ()
        drafts = drafting.draft(position, token, room, mtp)
    out = pb.ForwardRequest(
        session_id=request.session_id,
        epoch=request.epoch,
        step=step,
        expect=link.expect,
        expected_next_pos=position,
        positions=range(position, position + 1 + len(drafts)),
        token_ids=[token, *drafts],
        timeout_ms=request.timeout_ms,
        session_secret=link.secret,
        kind=pb.ROW_KIND_DECODE,
        chain_hop=0,
        ring_until_step=request.ring_until_step,
        ring_draft_max=request.ring_draft_max,
        mtp_draft_max=request.mtp_draft_max,
        draft_rows=len(drafts),
        sampled_tokens=request.sampled_tokens,
    )
    if drafts:
        out.logit_rows.extend(range(1 + len(drafts)))
    if kept is not None:
        out.kept_drafts = kept
    out.ring_stop.extend(request.ring_stop)
    return out


__all__ = ["next_frame", "ring_frame"]
