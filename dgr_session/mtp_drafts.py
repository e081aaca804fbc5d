"""DeepSeek V4's MTP block as a session's draft source (``docs/speculative.md``): the route's
last stage owns the block and returns its drafts with every reply that asks for them
(``ForwardRequest.mtp_draft_max``), so the drafts cost the client nothing and no extra trip.

* :class:`MtpDraftRequest`: what a caller puts in its ``Speculation``; the transport
  (``session_starting``) answers a speculation with the session's :class:`MtpDrafts` in its
  place and asks the last stage for drafts on the session's frames. A transport that cannot
  is told by ``propose``, which refuses.
* :class:`MtpDrafts`: proposes the drafts the last stage returned with its last reply, for the
  position they follow.

Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from dgr_session.drafts import DraftConfigError, check_draft_k

__all__ = ["MtpDraftRequest", "MtpDrafts", "MtpUnavailable"]


class MtpUnavailable(DraftConfigError):
    """MTP drafts asked of a transport that does not set them up (one without
    ``session_starting``, or a route whose last stage did not load the MTP block)."""


class MtpDraftRequest:
    """A marker drafter: "draft with the route's MTP block". ``k_max`` caps a pass's drafts
    (the frames' ``mtp_draft_max``)."""

    name = "mtp"

    def __init__(self, k_max: int = 4) -> None:
        if k_max < 1:
            raise DraftConfigError(f"k_max must be at least 1, got {k_max}")
        self.k_max = k_max

    def propose(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        raise MtpUnavailable(
            "MTP drafts need a transport that asks the route's last stage for them "
            "(GrpcStageTransport, ChainStageTransport): this one did not set them up"
        )

    def close(self) -> None:
        pass


class MtpDrafts:
    """One session's MTP drafts, as the last stage returned them: :meth:`offer` with each
    reply's (position of the token they follow, drafts); :meth:`propose` gives them for a
    history whose newest token is at that position, nothing otherwise."""

    name = "mtp"

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self._held: tuple[int, tuple[int, ...]] | None = None
        self.offered = 0
        """Drafts the last stage returned."""

    def offer(self, position: int, drafts: Sequence[int]) -> None:
        """The last stage's drafts to follow the token at ``position``."""
        self._held = (int(position), tuple(int(t) for t in drafts))
        self.offered += len(drafts)

    def propose(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        check_draft_k(k)
        held, self._held = self._held, None
        if held is None or held[0] != len(history) - 1:
            return ()
        return held[1][:k]

    def close(self) -> None:
        self._held = None
