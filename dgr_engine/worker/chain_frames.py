"""The frames a stage of a chained route sends on (``docs/chain.md``): the next stage's frame
for a frame it ran, and, on a ring's last stage, the next step's frame for the first stage
(the greedy token of the last logits row)."""

from __future__ import annotations

import numpy as np

from dgr_engine.wire import frames
from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.worker.chain_downstream import ChainLink


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
    )
    if request.HasField("kept_drafts"):
        out.kept_drafts = request.kept_drafts
    out.chain_trace.extend(request.chain_trace)
    out.chain_trace.append(trace)
    return out


def ring_frame(
    request: pb.ForwardRequest, reply: pb.ForwardReply, link: ChainLink
) -> pb.ForwardRequest | None:
    """A ring's next frame after ``request``: the greedy token of its last logits row at the
    next position, for the next step; ``None`` when the ring stops there (no logits, the
    step limit, a stop token)."""
    n = len(request.positions)
    if request.ring_until_step <= request.step or request.no_logits or n == 0:
        return None
    if request.draft_rows:  # a verification pass: the session decides what comes next
        return None
    if request.logit_rows and request.logit_rows[-1] != n - 1:
        return None
    rows = frames.output_from_reply(reply)
    if rows.shape[0] == 0:
        return None
    token = int(np.argmax(rows[-1]))  # dgr_session.sampling.greedy's choice
    if token in request.ring_stop:
        return None
    position = int(request.positions[-1]) + 1
    out = pb.ForwardRequest(
        session_id=request.session_id,
        epoch=request.epoch,
        step=request.step + 1,
        expect=link.expect,
        expected_next_pos=position,
        positions=[position],
        token_ids=[token],
        timeout_ms=request.timeout_ms,
        session_secret=link.secret,
        kind=pb.ROW_KIND_DECODE,
        chain_hop=0,
        ring_until_step=request.ring_until_step,
    )
    out.ring_stop.extend(request.ring_stop)
    return out


__all__ = ["next_frame", "ring_frame"]
