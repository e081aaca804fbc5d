"""A drafting ring's last stage keeps what a pass around each ring cost (``ChainHub``,
``RingDrafting``): a next session over the same ring drafts from its first pass on, a session
over another ring times its own, and what a session kept of its drafts never carries over."""

from __future__ import annotations

from dgr_engine.wire.proto import shard_pb2 as pb
from dgr_engine.worker.lifecycle.closes import CloseCause, SessionClosed
from dgr_engine.worker.route.chain_hub import PASS_TIMES_KEPT, ChainHub
from dgr_engine.worker.route.ring_drafts import RingDrafting
from dgr_session.drafts import DraftLength, PassTimes

FIRST = "127.0.0.1:7001"
"""The ring's first stage: where the last stage sends each pass."""


def frame(prompt: list[int]) -> pb.ForwardRequest:
    """A session's first frame on the ring, asking its last stage to draft."""
    return pb.ForwardRequest(
        expected_next_pos=0, positions=range(len(prompt)), token_ids=prompt, ring_draft_max=8
    )


def drafting(hub: ChainHub, sid: str, first: str = FIRST) -> RingDrafting:
    hub.link(sid, 1, pb.ChainHop(endpoint=first), ring=True)
    held = hub.ring_drafting(sid, 1, frame([5, 6, 7, 5, 6, 7, 5, 6]))
    assert held is not None
    return held


def timed(held: RingDrafting, plain: float, row: float) -> None:
    """Passes around the ring, timed: plain ones, then passes of two drafts, all kept."""
    for _ in range(3):
        held.speculation.verified(0, 0, plain)
    for _ in range(3):
        held.speculation.verified(2, 2, plain + 2 * row)


def first_passes(held: RingDrafting, plain: float, row: float) -> list[int]:
    """The drafts of a session's first four passes (each kept whole, timed as ``plain`` and
    ``row`` say)."""
    sizes = []
    for _ in range(4):
        drafts = held.draft(len(held.tokens), 7, room=20)
        held.speculation.verified(len(drafts), len(drafts), plain + row * len(drafts))
        sizes.append(len(drafts))
    return sizes


def test_a_next_session_over_the_same_ring_drafts_from_its_first_pass() -> None:
    hub = ChainHub(None)
    cold = drafting(hub, "one")
    assert cold.warm is None
    assert first_passes(cold, 0.080, 0.004)[:3] == [2, 0, 0]  # two drafts, then plain passes
    timed(cold, 0.080, 0.004)
    learned = cold.length.times
    assert learned is not None and learned.plain == 0.080
    hub.session_closed(SessionClosed("one", 1, CloseCause.CLIENT))
    warm = drafting(hub, "two")
    assert warm.warm == learned
    # only the times: what the first session kept is not the second's
    assert warm.speculation.length.k == DraftLength(k_max=8, times=learned).k
    assert all(first_passes(warm, 0.080, 0.004))  # drafts on every pass from the first
    other = drafting(hub, "three", first="127.0.0.1:7002")  # another ring times its own
    assert other.warm is None and first_passes(other, 0.080, 0.004)[:3] == [2, 0, 0]


def test_a_session_that_never_timed_a_pass_leaves_nothing_and_the_kept_rings_are_bounded() -> None:
    hub = ChainHub(None)
    drafting(hub, "untimed")
    hub.session_closed(SessionClosed("untimed", 1, CloseCause.CLIENT))
    assert drafting(hub, "next").warm is None
    for n in range(PASS_TIMES_KEPT + 3):
        held = drafting(hub, f"s{n}", first=f"127.0.0.1:{8000 + n}")
        timed(held, 0.05 + n / 1000, 0.002)
        hub.session_closed(SessionClosed(f"s{n}", 1, CloseCause.CLIENT))
    assert drafting(hub, "oldest", first="127.0.0.1:8000").warm is None  # forgotten
    newest = drafting(hub, "newest", first=f"127.0.0.1:{8000 + PASS_TIMES_KEPT + 2}")
    assert newest.warm is not None and isinstance(newest.warm, PassTimes)
