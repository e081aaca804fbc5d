"""Speculative decoding for greedy sessions: what a :class:`~dgr_session.core.RouteSession`
asks for drafts, and what it tells back after each verification pass (``docs/speculative.md``).

A pass sends the newest token and up to :data:`MAX_DRAFTS` draft tokens through the route in
one forward; the last stage answers the logits of every row; the session keeps the longest run
of drafts equal to what greedy decoding picks, and the token after it. The tokens are those of
plain greedy decoding, whatever the drafts were: a wrong draft costs compute, never a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from dgr_session.drafts import Drafter, DraftLength

MAX_DRAFTS = 16
"""Most drafts of one pass: with the newest token 17 rows, under the 32 rows from which the
pinned llama.cpp's sgemm (patch 0010) takes a matmul, so every row keeps the bits it has when
decoded alone (the wire's own limit, ``dgr_engine.wire.frames.MAX_DRAFT_ROWS``, is the same)."""


REPACKED_TYPES = {
    "x86": frozenset({"Q4_0", "Q4_K", "Q2_K", "IQ4_NL", "MXFP4"}),
    "arm": frozenset({"Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "MXFP4", "Q8_0", "Q1_0"}),
}
"""Weight types the pinned llama.cpp's CPU backend repacks for its own matmul kernels
(``ggml/src/ggml-cpu/repack.cpp``, ``ggml_repack_get_optimal_repack_type``), by CPU family (the
union of what each family's extensions select; ``Q2_K`` needs AVX-512 on x86). Those kernels
take a matmul's rows four at a time (``gemm``) and the rest one by one (``gemv``), which sum in
other orders: a row of a pass of 4 rows or more does not keep the bits it has when decoded
alone."""

REPACKED_PASS_ROWS = 3
"""Most rows of a verification pass where weights are repacked: all of them in ``gemv``."""


def verify_rows(quant_types: Sequence[str], hardware: str = "") -> int:
    """The most rows a verification pass may carry, the newest token's included, so that every
    row keeps the bits plain one-row decoding gives on stages of ``hardware`` (a lane's
    hardware class, e.g. ``x86_64``) serving weights of ``quant_types``: 3 where a type is one
    the CPU backend repacks (:data:`REPACKED_TYPES`; an unknown family counts as any), else
    ``MAX_DRAFTS + 1`` (under the 32 rows from which sgemm takes a matmul, patch 0010)."""
    hw = hardware.lower()
    if hw.startswith(("x86", "amd64", "i686")):
        repacked = REPACKED_TYPES["x86"]
    elif hw.startswith(("arm", "aarch64")):
        repacked = REPACKED_TYPES["arm"]
    else:
        repacked = REPACKED_TYPES["x86"] | REPACKED_TYPES["arm"]
    if any(t.upper() in repacked for t in quant_types):
        return REPACKED_PASS_ROWS
    return MAX_DRAFTS + 1


def kept_drafts(greedy: Sequence[int], drafts: Sequence[int]) -> int:
    """How many of a pass's ``drafts`` greedy decoding keeps: the longest run of them equal to
    the greedy tokens of the rows before each (``greedy[i]`` is row ``i``'s, row 0 the newest
    token's). The one rule every side of a pass applies: the session, a ring's last stage, an
    MTP stage and a ring's client."""
    kept = 0
    while kept < len(drafts) and int(greedy[kept]) == int(drafts[kept]):
        kept += 1
    return kept


@attrs.define(eq=False)
class SpeculationTally:
    """What a session's speculation achieved, pass by pass."""

    passes: int = 0
    """Verification passes answered."""
    drafted: int = 0
    """Draft tokens verified."""
    accepted: int = 0
    """Of those, the drafts kept."""


@attrs.define(eq=False)
class Speculation:
    """One session's speculation: its draft source, its adaptive draft length and what it
    achieved (its :class:`SpeculationTally`). Owned by one session. A route that drafts on its
    own (a ring's last stage, a last stage's MTP block) gives the session another value in its
    place (``attrs.evolve``, ``StageTransport.session_starting``), never changing the caller's:
    the two share the tally, so the caller reads what the session achieved."""

    drafter: Drafter
    """Proposes the drafts (``dgr_session.drafts``)."""
    length: DraftLength | AnyLength
    """How many drafts the next pass may carry; told how many each pass kept."""
    max_drafts: int = attrs.field(default=MAX_DRAFTS)
    """An upper bound over the length's own (at most :data:`MAX_DRAFTS`)."""
    tally: SpeculationTally = attrs.field(factory=SpeculationTally)
    """What it achieved; shared with the values made from it."""

    @property
    def passes(self) -> int:
        """Verification passes answered."""
        return self.tally.passes

    @property
    def drafted(self) -> int:
        """Draft tokens verified."""
        return self.tally.drafted

    @property
    def accepted(self) -> int:
        """Of those, the drafts kept."""
        return self.tally.accepted

    @max_drafts.validator
    def _check_max(self, _attribute: object, value: int) -> None:
        if not 0 <= value <= MAX_DRAFTS:
            raise ValueError(f"max_drafts must be in [0, {MAX_DRAFTS}], got {value}")

    def propose(self, prompt: Sequence[int], accepted: Sequence[int], room: int) -> tuple[int, ...]:
        """Drafts to follow ``prompt + accepted`` (at most ``room``: tokens the session may
        still produce after the next one, and rows the route takes); none while the length
        says to pause."""
        k = min(self.length.k, self.max_drafts, room)
        if k <= 0:
            return ()
        drafts = tuple(int(t) for t in self.drafter.propose((*prompt, *accepted), k))
        return drafts[:k]

    def verified(self, drafts: int, kept: int, seconds: float | None = None) -> None:
        """A decode pass of ``drafts`` drafts (0: a plain one) kept ``kept`` of them, in
        ``seconds`` from the first stage's forward to the last stage's answer (``None`` or 0:
        not timed); the length learns from both."""
        if drafts:
            self.tally.passes += 1
            self.tally.drafted += drafts
            self.tally.accepted += kept
        self.length.record(drafts, kept, seconds)

    @property
    def acceptance(self) -> float:
        """Drafts kept per draft verified (0 before any pass)."""
        return self.accepted / self.drafted if self.drafted else 0.0


class AnyLength:
    """A draft length that never limits (``k`` is :data:`MAX_DRAFTS`) and learns nothing: for
    a drafter that already decided its drafts, such as a ring's last stage."""

    k = MAX_DRAFTS

    def record(self, proposed: int, accepted: int, seconds: float | None = None) -> None:
        """Nothing to learn."""


__all__ = [
    "MAX_DRAFTS",
    "REPACKED_PASS_ROWS",
    "REPACKED_TYPES",
    "AnyLength",
    "Speculation",
    "SpeculationTally",
    "kept_drafts",
    "verify_rows",
]
