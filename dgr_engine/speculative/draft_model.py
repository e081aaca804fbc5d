"""A draft model: a small GGUF with the target's vocabulary, run whole in this process, that
drafts greedily (``docs/speculative.md``, draft sources).

The drafter keeps the KV of the tokens it last saw. Each :meth:`ModelDrafter.propose` finds
the longest common prefix of that and the session's history, truncates its KV to it (the rest
were drafts the route rejected, or another history), forwards the history's missing tokens (in
chunks of at most ``n_batch`` rows), then drafts one token per row by argmax. The last draft is
never forwarded: if the route accepts it, it is the first missing token of the next call. A
model that is its own draft proposes exactly its greedy continuation: the mechanism's ceiling
(acceptance 1.0).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dgr_engine.engine import ShardEngine
from dgr_engine.numerics import Numerics
from dgr_engine.options import EngineOptions
from dgr_session.drafts import DraftConfigError, DraftContextFull, check_draft_k

__all__ = ["DraftVocabMismatch", "ModelDrafter"]

_DEFAULTS = EngineOptions()
_SESSION = (0, 0)  # the drafter's one engine session: (session_id, epoch)


class DraftVocabMismatch(DraftConfigError):
    """The draft model's vocabulary size is not the target's: its token ids would mean other
    tokens. Raised at construction; no drafter exists (the engine was freed). The session lives
    on without this draft source."""

    def __init__(self, draft: int, target: int, model: str) -> None:
        super().__init__(
            f"draft model {model} has a vocabulary of {draft} tokens, the target's has {target}: "
            "a draft model needs the target's vocabulary"
        )
        #: Vocabulary size of the draft model.
        self.draft_n_vocab = draft
        #: Vocabulary size of the target model.
        self.target_n_vocab = target


class ModelDrafter:
    """Greedy drafts from a draft GGUF run whole (every layer) in one
    :class:`~dgr_engine.engine.ShardEngine` session.

    ``target_n_vocab`` is the target model's vocabulary size (:class:`DraftVocabMismatch` if
    the draft's differs). ``n_ctx`` bounds the history plus the drafts the KV holds: a longer
    history is :class:`~dgr_session.drafts.DraftContextFull` (nothing drafted, state kept),
    and drafts are cut short where they would not fit. A failed engine call propagates its
    typed :class:`~dgr_engine.errors.EngineError`; the drafter then starts its KV over on the
    next call. Use it as a context manager or call :meth:`close`. Not thread-safe: one session
    drafts with it.
    """

    name = "draft-model"

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        target_n_vocab: int,
        n_threads: int = _DEFAULTS.n_threads,
        n_ctx: int = _DEFAULTS.n_ctx_per_session,
        n_batch: int = _DEFAULTS.n_batch,
        numerics: Numerics | None = None,
    ) -> None:
        if n_ctx < 1 or n_batch < 1:
            raise DraftConfigError(
                f"a draft model needs n_ctx >= 1 and n_batch >= 1, got "
                f"n_ctx={n_ctx}, n_batch={n_batch}"
            )
        self.engine = ShardEngine(
            Path(model_path),
            max_sessions=1,
            n_ctx_per_session=n_ctx,
            n_threads=n_threads,
            n_batch=n_batch,
            n_ubatch=n_batch,
            numerics=numerics,
        )
        n_vocab = self.engine.info.n_vocab
        if n_vocab != target_n_vocab:
            self.engine.close()
            raise DraftVocabMismatch(n_vocab, target_n_vocab, self.engine.model_path.name)
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.engine.open_session(*_SESSION)
        # invariant: the engine's KV holds exactly the tokens of _held at positions 0..len - 1,
        # and _next is the argmax of the logits after _held[-1] (None when not known); _held is
        # None after a failed engine call (the KV is then unknown and is dropped on next use)
        self._held: list[int] | None = []
        self._next: int | None = None

    def propose(self, history: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` greedy draft tokens after ``history`` (``()`` for an empty history or
        ``k == 0``)."""
        check_draft_k(k)
        n = len(history)
        if n > self.n_ctx:
            raise DraftContextFull(
                f"history of {n} tokens is longer than the draft model's context of {self.n_ctx}"
            )
        # drafting k tokens forwards the history and the first k - 1 drafts
        k = min(k, self.n_ctx - n + 1)
        if n == 0 or k == 0:
            return ()
        tokens = [int(t) for t in history]
        try:
            drafts = [self._sync(tokens)]
            while len(drafts) < k:
                drafts.append(self._forward([drafts[-1]]))
        except BaseException:
            self._held = None
            raise
        return tuple(drafts)

    def close(self) -> None:
        """Frees the engine and its KV. Idempotent."""
        self.engine.close()

    def __enter__(self) -> ModelDrafter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        held = "?" if self._held is None else len(self._held)
        return f"<ModelDrafter {self.engine.model_path.name} held={held} n_ctx={self.n_ctx}>"

    # -- internals -------------------------------------------------------------------------

    def _sync(self, tokens: list[int]) -> int:
        """Brings the KV to ``tokens`` (non-empty) and returns the greedy token after them."""
        held = self._held
        if held is None:  # a call failed: the KV is unknown
            self.engine.truncate(*_SESSION, 0)
            held = self._held = []
            self._next = None
        if held == tokens and self._next is not None:
            return self._next
        common = _common_prefix(held, tokens)
        # at least the last token is forwarded, for the logits after it
        keep = min(common, len(tokens) - 1)
        if keep < len(held):
            self.engine.truncate(*_SESSION, keep)
            del held[keep:]
            self._next = None
        return self._forward(tokens[keep:])

    def _forward(self, tokens: list[int]) -> int:
        """Forwards ``tokens`` after the held ones (chunks of at most ``n_batch`` rows); returns
        the argmax of the last row's logits."""
        held = self._held
        assert held is not None and tokens
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            positions = np.arange(len(held), len(held) + len(chunk), dtype=np.int32)
            logits = self.engine.forward(*_SESSION, positions, tokens=chunk)
            held.extend(chunk)
            self._next = int(np.argmax(logits[-1]))
        assert self._next is not None
        return self._next


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (an append-only history), compared in C
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
