"""Tiny ``transformers`` models of the families beside Llama, each with what sets it apart
switched on, for the converter-made fixtures (:mod:`dgr_engine.fixtures.converted`).

Built and written by :mod:`dgr_engine.baseline.tiny_hf` (same seeded weights, same
SentencePiece vocabulary of 320 pieces, float32):

* ``hf-qwen2-bias``: Qwen 2, q/k/v biases, grouped-query attention 4/2, untied head;
* ``hf-qwen3-qknorm-tied``: Qwen 3, per-head q/k RMS norms, head_dim 32 with hidden 64 / 4 heads,
  head tied to the embedding;
* ``hf-phi-longrope``: Phi-3, fused QKV and gate-up, LongRoPE scaling (per-dimension short and
  long factors, attention factor of a 4x context extension), untied head. The short factors
  apply: llama.cpp takes the long ones only for a context per sequence above the original 4096
  positions, ``transformers`` only past position 4096. Its name avoids "phi3": llama.cpp gives a
  GGUF whose name says phi3 the special tokens of Phi-3's own vocabulary, which this one lacks;
* ``hf-gemma3-swa``: Gemma 3, 7 layers of sliding-window attention (window 8, shorter than the
  test prompts) with layer 5 global (Gemma's pattern of 6), q/k norms, sandwich norms, GeGLU,
  the embedding scaled by sqrt(hidden), final logit soft-capping at 10, head tied to the
  embedding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from dgr_engine.baseline.tiny_hf import VOCAB_SIZE, TinyHfSpec

_DENSE: Final = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "num_attention_heads": 4,
}

PHI3_ORIGINAL_CONTEXT: Final = 4096
"""Phi-3's ``original_max_position_embeddings``: beyond it the long factors apply."""
_PHI3_ROPE: Final = {
    "rope_type": "longrope",
    "factor": 4.0,
    "rope_theta": 10000.0,
    "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
    "short_factor": [1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 4.5],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 14.0, 20.0],
}
_GEMMA3_ROPE: Final = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
}

GEMMA3_SLIDING_WINDOW: Final = 8
"""The tiny Gemma 3's sliding window: shorter than every parity prompt."""

SPECS: Final[Mapping[str, TinyHfSpec]] = {
    s.name: s
    for s in (
        TinyHfSpec(
            "hf-qwen2-bias",
            "Qwen2ForCausalLM",
            {**_DENSE, "num_key_value_heads": 2, "rope_theta": 1000000.0},
            seed=1234,
            description="3-layer Qwen 2, q/k/v biases, grouped-query attention 4/2, untied head",
        ),
        TinyHfSpec(
            "hf-qwen3-qknorm-tied",
            "Qwen3ForCausalLM",
            {
                **_DENSE,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "rope_theta": 1000000.0,
                "tie_word_embeddings": True,
            },
            seed=1234,
            description="3-layer Qwen 3, q/k norms, head_dim 32 (not hidden/heads), tied head",
        ),
        TinyHfSpec(
            "hf-phi-longrope",
            "Phi3ForCausalLM",
            {
                **_DENSE,
                "num_key_value_heads": 2,
                "max_position_embeddings": 4 * PHI3_ORIGINAL_CONTEXT,
                "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
                "rope_parameters": _PHI3_ROPE,
                "pad_token_id": 0,
                "hidden_act": "silu",
            },
            seed=1234,
            description="3-layer Phi-3, fused QKV and gate-up, LongRoPE (4x), untied head",
        ),
        TinyHfSpec(
            "hf-gemma3-swa",
            "Gemma3ForCausalLM",
            {
                **_DENSE,
                "num_hidden_layers": 7,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "query_pre_attn_scalar": 32,
                "sliding_window": GEMMA3_SLIDING_WINDOW,
                "rope_parameters": _GEMMA3_ROPE,
                "final_logit_softcapping": 10.0,
                "hidden_activation": "gelu_pytorch_tanh",
                "pad_token_id": 0,
                "tie_word_embeddings": True,
            },
            seed=1234,
            description=(
                "7-layer Gemma 3, sliding window 8 with layer 5 global, q/k norms, "
                "soft-capped logits, tied head"
            ),
        ),
    )
}
"""The families' HF models by name."""
