"""Draft sources of speculative decoding, and the adaptive draft length.

A *drafter* guesses the tokens greedy decoding will produce next; one pass along the route then
verifies the last accepted token plus the drafts and keeps the longest prefix greedy decoding
would have produced (``docs/speculative.md``). A wrong draft costs rows, never tokens: exactness
is the verifier's job, a drafter only has to be cheap and often right.

* :class:`Drafter`: the one small interface every draft source implements (``propose``,
  ``close``, a ``name``).
* :class:`NgramDrafter`: prompt-lookup decoding from the session's own tokens, for every
  architecture and with no model.
* :class:`DraftLength`: how many tokens to draft on the next pass, adapted to what was accepted
  so that speculation never makes a session slower than plain decoding.

The draft model (a GGUF with the target's vocabulary) lives in the data plane,
``dgr_engine.speculative``. Everything here is pure, deterministic and free of I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from dgr_session.errors import DgrError

__all__ = [
    "DraftConfigError",
    "DraftContextFull",
    "MIN_NGRAM",
    "REPROBE",
    "REPROBE_MAX",
    "DraftLength",
    "Drafter",
    "NgramDrafter",
    "PassTimes",
    "check_draft_k",
]


class DraftConfigError(DgrError, ValueError):
    """A drafter or a draft length was set up (or asked) with values that cannot work: a
    negative draft length, n-gram bounds out of order, a draft model whose vocabulary is not the
    target's. Nothing was drafted and nothing changed; the session lives on (without this
    draft source, if its configuration is what is wrong)."""


class DraftContextFull(DgrError):
    """The history handed to a drafter is longer than the drafter's own context (a draft
    model's KV). Nothing was drafted; the drafter's state is unchanged. The session lives on:
    it decodes without this drafter's drafts."""


def check_draft_k(k: int) -> None:
    """Refuses a draft length below 0 (:class:`DraftConfigError`)."""
    if k < 0:
        raise DraftConfigError(f"draft length k must be >= 0, got {k}")


@runtime_checkable
class Drafter(Protocol):
    """A draft source.

    ``propose(history, k)`` returns at most ``k`` tokens that would follow ``history`` (the
    prompt plus every accepted token so far), possibly fewer or none; ``k`` below 0 is a
    :class:`DraftConfigError`. The history a session passes grows append-only between calls;
    a drafter must still answer correctly (though it may be slower) when it shrinks or
    diverges, as after a re-prefill or when one drafter serves another history. ``close()``
    frees what the drafter holds; it is idempotent.
    """

    name: str
    """What the source is: ``"ngram"``, ``"draft-model"``, ..."""

    def propose(self, history: Sequence[int], k: int) -> tuple[int, ...]: ...

    def close(self) -> None: ...


MIN_NGRAM = 2
"""The shortest suffix :class:`NgramDrafter` looks up by default. A one-token match proposes
drafts after almost any token that occurred before, and on free text few of those are kept:
measured on SmolLM2-135M-Instruct's greedy answers (128 tokens, the chat and rewrite prompts of
``benchmarks.speculative``) at 4 drafts a pass, one-token matches drafted on 49 passes of 103
and 13 % of their drafts were kept on free chat; from two tokens on, 15 passes and 34 %, while
the rewrite's passes rose only from 72 to 78. On a CPU every draft row costs compute whether it
is kept or not (``docs/speculative.md``), so fewer, better drafts are what pays."""


class NgramDrafter:
    """Prompt-lookup (n-gram) drafts: the tokens that followed the most recent earlier
    occurrence of the history's last ``n`` tokens.

    For ``n`` from ``max_ngram`` down to ``min_ngram``: if the last ``n`` tokens of the
    history occurred earlier (an occurrence ending before the history's end, so never the
    suffix itself), the proposal is the up to ``k`` tokens that followed the most recent such
    occurrence; the first ``n`` that matches wins. No match: ``()``.

    An index ``n-gram -> end of its most recent occurrence`` is kept across calls and extended
    by the tokens the history gained, so a call costs the new tokens plus one comparison of the
    history with what was indexed (in C, over the list), not a search of the history. When the
    history shrank or diverged from what was indexed, the index is rebuilt from scratch.
    Deterministic: the proposal depends on the history and ``k`` only.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = MIN_NGRAM) -> None:
        if min_ngram < 1 or max_ngram < min_ngram:
            raise DraftConfigError(
                f"n-gram bounds need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
                f"max_ngram={max_ngram}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        # invariant: _last[g] is the largest e <= len(_tokens) - 1 with _tokens[e-len(g):e] == g,
        # for every n-gram g of a length in [min_ngram, max_ngram] occurring in that range
        self._tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}

    def propose(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        check_draft_k(k)
        tokens = self._sync(history)
        length = len(tokens)
        if k == 0:
            return ()
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            end = self._last.get(tuple(tokens[length - n :]))
            if end is not None:
                return tuple(tokens[end : end + k])
        return ()

    def close(self) -> None:
        self._tokens = []
        self._last = {}

    def _sync(self, history: Sequence[int]) -> list[int]:
        """Brings the index up to ``history`` (n-grams ending before its last token) and
        returns the history as the indexed list."""
        held = len(self._tokens)
        prefix = history[:held]
        if not isinstance(prefix, list):
            prefix = list(prefix)
        if prefix != self._tokens:  # shorter, or diverged: rebuild
            self.close()
            held = 0
        tokens = self._tokens
        tokens.extend(int(t) for t in history[held:])
        # the last call indexed the n-grams ending at 1 .. held - 1; this one adds those ending
        # at held .. len - 1 (the one ending at len is the suffix itself, never a match)
        last = self._last
        for end in range(max(held, 1), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                last[tuple(tokens[end - n : end])] = end
        return tokens

    def __repr__(self) -> str:
        return f"<NgramDrafter n={self.min_ngram}..{self.max_ngram} indexed={len(self._tokens)}>"


REPLAIN = 64
"""A timed :class:`DraftLength` times a plain pass again after this many passes with drafts."""

REPROBE = 16
"""While no draft length pays, a timed :class:`DraftLength` drafts one token after this many
plain passes, to see whether drafts are kept more often now; after a probe that keeps nothing
it waits twice as long for the next (up to :data:`REPROBE_MAX`), after one that keeps its draft
:data:`REPROBE` again."""

REPROBE_MAX = 128
"""The longest wait of a timed :class:`DraftLength` between two probes."""

PAYS = 1.05
"""How much faster than plain decoding a timed :class:`DraftLength`'s model must expect drafts to
be before it drafts: a margin for what the model gets wrong (timings are noisy, acceptance is
an average). 5 %, not more: a draft row costs about two thirds of a token on a CPU, and with a
wider margin a session whose first two drafts were kept (``alpha`` 0.83 under the prior) waited
a probe's 16 passes before drafting again (seen on a 2-stage ring at loopback)."""

PLAIN_FIRST = 2
"""Plain passes a timed :class:`DraftLength` times before it drafts by its model: their mean is
what a draft row's time is measured against, so one noisy pass does not decide it."""

_DECAY = 0.9
"""Weight of the past in the kept-draft counts (recent passes count most)."""

_WARM_ROWS = 4
"""Draft rows a warm :class:`DraftLength`'s row average counts as, against its own passes'."""

_WEIGHT = 0.2
"""Weight of a new timing in the averages."""


def _average(old: float | None, new: float, weight: float = _WEIGHT) -> float:
    return new if old is None else old + weight * (new - old)


@attrs.frozen
class PassTimes:
    """What a timed :class:`DraftLength` learned of a route's passes: the average seconds of
    a pass without drafts (``plain``) and of the time each draft row adds (``row``). A route's,
    not a session's: a next session over the same route starts from them."""

    plain: float = attrs.field(validator=attrs.validators.gt(0.0))
    row: float = attrs.field(validator=attrs.validators.ge(0.0))


class DraftLength:
    """How many tokens to draft on the next pass: adaptive, so that speculation never makes
    a session slower than plain decoding.

    The policy, after each verification pass (:meth:`record` with the drafts proposed and the
    drafts accepted):

    * every draft accepted (``accepted == proposed > 0``): ``k`` grows by one, up to
      ``k_max``;
    * some but not all accepted: ``k`` stays (the pass gained tokens);
    * none accepted (``proposed > 0``): ``k`` halves (rounded down, at least 1); at ``k == 1``,
      after ``patience`` such passes in a row, drafting pauses (``k`` reads 0) for a back-off
      number of passes: ``backoff_start`` the first time, doubling on each pause in a row up
      to ``backoff_max``;
    * nothing proposed (``proposed == 0``): during a pause the pass counts the pause down, and
      when it ends ``k`` reads 1 again (a probe); outside a pause it changes nothing (the
      drafter had nothing to offer, which says nothing about the drafts).

    A probe that accepts nothing pauses again at once, for the doubled back-off; any pass that
    accepts a draft resets the back-off to ``backoff_start``. So a session whose drafts are
    never accepted spends at most one probe row per ``backoff_max`` passes on them.

    **Timed** (``record`` given the pass's ``seconds``, more than 0): what a draft row costs
    decides, since on a CPU every row of a pass is computed on its own (patch 0010) and a
    draft that is not kept costs as much as one that is. The length keeps an average of a
    pass without drafts (``plain``), of the extra time per draft row (``row``), and, per
    depth ``i``, of the chance that draft ``i`` is kept given the ones before it were
    (``alpha_i``, from every pass's kept drafts: a run of ``a`` kept and, if ``a < k``, one
    miss at depth ``a + 1``; a depth with few trials leans on the one before it, the first on
    1/2). Per depth, because drafts are not kept independently: a copied passage, once its
    first draft is kept, is kept far into it (SmolLM2's sampled rewrite at 8 drafts a pass:
    after a first kept draft 90 % of the rest, against 60 % of all). It drafts the ``k``
    that gives the most tokens a second, ``(1 + a1 + a1*a2 + ... + a1*...*ak) / (plain + k *
    row)``, or none when no ``k`` beats a plain pass by :data:`PAYS`. It times a plain pass
    first (``k`` reads 0 until one was recorded), a pass with drafts next (the acceptance
    policy's ``k``), refreshes ``plain`` every :data:`REPLAIN` passes, and, while no ``k``
    pays, probes one draft after :data:`REPROBE` plain passes to see whether the drafts are
    kept more often now, waiting twice as long after each probe that kept nothing (up to
    :data:`REPROBE_MAX`), and it times :data:`PLAIN_FIRST` plain passes before its model
    decides. ``k_start`` is 2 by default: a session's first drafts, sent before anything is
    known of them, cost few rows, and yet say what a row costs better than one would.

    **Warm** (``times``: :class:`PassTimes` another session measured over the same route):
    timed from the start, with those averages in place of the first plain passes, so the
    first pass drafts what they say pays (at the prior acceptance); its own passes then move
    the averages as any others would. Only timings carry over, never what was kept: that is
    the session's own. Without timings (0 or ``None``, as under a virtual clock) the
    acceptance policy above decides alone. Pure and deterministic: the same records give the
    same ``k``.
    """

    def __init__(
        self,
        k_max: int = 8,
        k_start: int = 2,
        *,
        patience: int = 2,
        backoff_start: int = 4,
        backoff_max: int = 64,
        times: PassTimes | None = None,
    ) -> None:
        if k_max < 1 or not 1 <= k_start <= k_max:
            raise DraftConfigError(
                f"draft length needs 1 <= k_start <= k_max, got k_start={k_start}, k_max={k_max}"
            )
        if patience < 1 or backoff_start < 1 or backoff_max < backoff_start:
            raise DraftConfigError(
                f"draft back-off needs patience >= 1 and 1 <= backoff_start <= backoff_max, got "
                f"patience={patience}, backoff_start={backoff_start}, backoff_max={backoff_max}"
            )
        self.k_max = k_max
        self.patience = patience
        self.backoff_start = backoff_start
        self.backoff_max = backoff_max
        self._k = k_start  # the length when not paused: 1..k_max
        self._pause = 0  # passes left in the current pause; k reads 0 while > 0
        self._zero_run = 0  # passes in a row with nothing accepted at k == 1
        self._backoff = backoff_start  # length of the next pause
        # timed: averages of a plain pass, of a draft row's extra time, and of drafts kept
        self._timed = False
        self._plain: float | None = None
        self._plains = 0  # plain passes timed
        self._row: float | None = None
        self._extra = 0.0  # decayed sums of the time drafts added and of the drafts: row's
        self._drafts = 0.0
        self._first: tuple[int, float] | None = None  # a timed pass with drafts before plain
        # per depth i (index i - 1): decayed counts of drafts kept there and of drafts tried
        self._kept = [0.0] * k_max
        self._tried = [0.0] * k_max
        self._best = 0  # the k that pays most (timed, once plain and row are known)
        self._since_plain = 0  # timed passes with drafts since the last plain one
        self._since_probe = 0  # passes without drafts while none pays
        self._probe_every = REPROBE  # plain passes between two probes while none pays
        if times is not None:  # warm: another session's averages stand for the first passes
            self._timed = True
            self._plain, self._plains = times.plain, PLAIN_FIRST
            self._extra, self._drafts = times.row * _WARM_ROWS, float(_WARM_ROWS)
            self._row = times.row
            self._best = self._paying_k(times.plain, times.row)

    @property
    def times(self) -> PassTimes | None:
        """The averages of a plain pass and of a draft row, once both were timed (what a next
        session over the same route may start from); ``None`` before."""
        if self._plain is None or self._row is None:
            return None
        return PassTimes(plain=self._plain, row=self._row)

    @property
    def k(self) -> int:
        """Tokens to draft on the next pass, in ``[0, k_max]``; 0: do not draft this pass."""
        if self._timed:
            if self._plain is None:
                return 0  # time a plain pass first
            if self._row is None:
                return self._k  # then a pass with drafts
            if self._plains < PLAIN_FIRST:
                return 0
            if self._since_plain >= REPLAIN:
                return 0
            if self._best == 0:
                return 1 if self._since_probe >= self._probe_every else 0
            return self._best
        return 0 if self._pause > 0 else self._k

    @property
    def paused(self) -> bool:
        """Drafting is paused (``k`` reads 0)."""
        return self._pause > 0

    def record(self, proposed: int, accepted: int, seconds: float | None = None) -> None:
        """Records one decode pass: ``proposed`` drafts sent (at most :attr:`k`; 0: a plain
        pass), of which ``accepted`` were accepted, and the pass's ``seconds`` if timed.
        Refuses ``accepted`` outside ``[0, proposed]`` and ``proposed`` outside ``[0, k]``
        (``ValueError``), changing nothing."""
        if not 0 <= proposed <= self.k:
            raise ValueError(f"proposed {proposed} drafts; the draft length allows 0..{self.k}")
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted {accepted} of {proposed} drafts: must be 0..{proposed}")
        if proposed:
            self._count(proposed, accepted)
        if seconds is not None and seconds > 0:
            self._timed = True
            self._time(proposed, accepted, seconds)
        self._heuristic(proposed, accepted)

    def _time(self, proposed: int, accepted: int, seconds: float) -> None:
        if proposed == 0:
            self._plains += 1  # the first ones averaged alike, then the recent ones most
            self._plain = _average(self._plain, seconds, max(_WEIGHT, 1 / self._plains))
            self._since_plain = 0
            self._since_probe += 1
            if self._first is not None:  # the pass with drafts timed before plain was
                drafts, took = self._first
                self._first = None
                self._row = self._row_cost(took - self._plain, drafts)
        elif self._plain is None:
            self._first = (proposed, seconds)
        else:
            if self._best == 0 and self._row is not None:  # a probe: back off if it missed
                missed = accepted == 0
                self._probe_every = min(2 * self._probe_every, REPROBE_MAX) if missed else REPROBE
            self._row = self._row_cost(seconds - self._plain, proposed)
            self._since_plain += 1
            self._since_probe = 0
        if self._plain is not None and self._row is not None:
            self._best = self._paying_k(self._plain, self._row)

    def _count(self, proposed: int, accepted: int) -> None:
        """Adds a pass's trials to the per-depth counts: drafts 1..accepted kept, and the
        one after them (if proposed) missed. A depth's counts age only as it is tried again
        (a depth no pass reaches keeps what it last showed)."""
        kept, tried = self._kept, self._tried
        for i in range(min(accepted + 1, proposed)):
            kept[i] = kept[i] * _DECAY + (i < accepted)
            tried[i] = tried[i] * _DECAY + 1.0

    def _row_cost(self, extra: float, drafts: int) -> float:
        """The time a draft row adds, from a pass whose ``drafts`` rows added ``extra``
        seconds over a plain pass: the ratio of decayed sums, so that a pass of many drafts
        (whose timing says more of a row) weighs more than a pass of one."""
        self._extra = self._extra * (1 - _WEIGHT) + max(extra, 0.0)
        self._drafts = self._drafts * (1 - _WEIGHT) + drafts
        return self._extra / self._drafts

    def _paying_k(self, plain: float, row: float) -> int:
        """The draft length that gives the most tokens a second (0: none beats plain)."""
        best, best_rate = 0, PAYS / plain  # drafts must beat plain decoding by a margin
        expected, reach, alpha = 1.0, 1.0, 0.5  # the prior of the first depth: 1/2
        for k in range(1, self.k_max + 1):
            alpha = (self._kept[k - 1] + alpha) / (self._tried[k - 1] + 1.0)
            reach *= alpha  # the chance drafts 1..k are all kept
            expected += reach
            rate = expected / (plain + k * row)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _heuristic(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            if self._pause > 0:
                self._pause -= 1
                if self._pause == 0:  # probe with one draft; one more miss pauses again
                    self._k = 1
                    self._zero_run = self.patience - 1
            return
        if accepted > 0:
            self._zero_run = 0
            self._backoff = self.backoff_start
            if accepted == proposed:
                self._k = min(self.k_max, self._k + 1)
            return
        if self._k > 1:
            self._k = max(1, self._k // 2)
            return
        self._zero_run += 1
        if self._zero_run >= self.patience:
            self._pause = self._backoff
            self._backoff = min(self.backoff_max, self._backoff * 2)
            self._zero_run = 0

    def __repr__(self) -> str:
        state = f"paused {self._pause}" if self._pause else f"k={self.k}"
        return f"<DraftLength {state} k_max={self.k_max}>"
