"""Speculative decoding's data-plane parts: the draft sources that run a model.

* :class:`ModelDrafter` (``draft_model``): a draft GGUF with the target's vocabulary, run
  whole by the client through a :class:`~dgr_engine.engine.ShardEngine`.

The interface every draft source implements, the model-free n-gram drafter and the adaptive
draft length are in the control plane, :mod:`dgr_session.drafts` (``docs/speculative.md``).
"""

from __future__ import annotations

from dgr_engine.speculative.draft_model import DraftVocabMismatch, ModelDrafter

__all__ = ["DraftVocabMismatch", "ModelDrafter"]
