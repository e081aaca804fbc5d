"""Tiny models made the way real users get them: a ``transformers`` model from a config and a
seed, saved as safetensors with a tokenizer, for llama.cpp's converter to convert.

Bit-reproducible: weights are drawn with numpy's PCG64 from the seed, parameter by parameter in
sorted name order (tied parameters once), and the tokenizer is a SentencePiece model built
piece by piece (no training), serialized deterministically. Weights are scaled so logits have a
realistic spread (std ~2.5, top-1/top-2 margins mostly > 0.5) instead of the near-flat logits
of the default 0.02 initialisation:

* a linear ``[out, in]``: N(0, 1/in), query and key projections x1.5 (sharper attention);
* the embedding: N(0, 1) when untied; the output head (or a tied embedding): N(0, 2.5^2/hidden);
* RMSNorm weights: 1 + N(0, 0.1^2), so the norms are exercised (N(0, 0.1^2) for Gemma, whose
  norms scale by 1 + weight);
* a bias (Qwen 2's q/k/v): N(0, 0.5^2), so it shows in the attention.

The families beside Llama (Qwen 2 and 3, Phi-3, Gemma 3) are in
:mod:`dgr_engine.baseline.tiny_families`.

Needs the ``dgr[baseline]`` extra (torch, transformers, sentencepiece), imported when used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np

from dgr_engine.baseline.errors import ExtrasMissing

LOGIT_STD: Final = 2.5
QK_GAIN: Final = 1.5
NORM_NOISE: Final = 0.1
BIAS_STD: Final = 0.5

_WORDS: Final = (
    "▁the", "▁a", "▁of", "▁and", "▁to", "▁in", "▁is", "▁it", "▁that", "▁on", "▁cat", "▁dog",
    "▁sat", "▁mat", "▁run", "▁red", "▁big", "▁one", "▁two", "er", "ing", "ed", "es", "th",
)  # fmt: skip
_CHARS: Final = ("▁", *(chr(c) for c in range(ord("a"), ord("z") + 1)), *"0123456789")
VOCAB_SIZE: Final = 3 + 256 + len(_WORDS) + len(_CHARS)
"""``<unk>``, ``<s>``, ``</s>``, 256 byte pieces, words and characters: 320."""


@attrs.frozen
class TinyHfSpec:
    """A tiny HF model: its class, its config and the seed of its weights."""

    name: str
    model_class: str
    """The ``transformers`` class, e.g. ``"LlamaForCausalLM"``."""
    config: Mapping[str, Any] = attrs.field(converter=lambda m: dict(sorted(m.items())))
    seed: int
    description: str = ""
    scaled_init: bool = True
    """Draw the weights by the rules above (else: ``transformers``' own initialisation, seeded
    with ``torch.manual_seed``)."""


_LLAMA: Final = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rope_theta": 10000.0,
}

SPECS: Final[Mapping[str, TinyHfSpec]] = {
    s.name: s
    for s in (
        TinyHfSpec(
            "hf-llama-gqa",
            "LlamaForCausalLM",
            {**_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
            seed=1234,
            description="3-layer Llama, grouped-query attention 4/2, untied head",
        ),
        TinyHfSpec(
            "hf-llama-mqa-tied",
            "LlamaForCausalLM",
            {
                **_LLAMA,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "head_dim": 16,
                "tie_word_embeddings": True,
            },
            seed=1234,
            description="3-layer Llama, multi-query attention 4/1, head tied to the embedding",
        ),
        TinyHfSpec(
            "hf-llama-headdim",
            "LlamaForCausalLM",
            {**_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32},
            seed=1234,
            description="3-layer Llama, head_dim 32 with hidden 64 / 4 heads (not hidden/heads)",
        ),
    )
}
"""The converter-made fixture family's HF models by name."""


def require_extras() -> tuple[Any, Any]:
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ExtrasMissing(
            f"{exc.name} is not installed: pip install 'dgr[baseline]' (torch, transformers)"
        ) from None
    return torch, transformers


def write_tokenizer(path: Path) -> None:
    """A unigram SentencePiece model with byte fallback, built piece by piece."""
    try:
        from sentencepiece import sentencepiece_model_pb2

        sp: Any = sentencepiece_model_pb2
    except ImportError:
        raise ExtrasMissing("sentencepiece is not installed: pip install 'dgr[baseline]'") from None
    model = sp.ModelProto()
    trainer = model.trainer_spec
    trainer.model_type = sp.TrainerSpec.UNIGRAM
    trainer.vocab_size = VOCAB_SIZE
    trainer.byte_fallback = True
    trainer.unk_id, trainer.bos_id, trainer.eos_id, trainer.pad_id = 0, 1, 2, -1
    trainer.unk_piece, trainer.bos_piece, trainer.eos_piece = "<unk>", "<s>", "</s>"
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = True
    model.normalizer_spec.remove_extra_whitespaces = False
    model.normalizer_spec.escape_whitespaces = True
    kind = sp.ModelProto.SentencePiece
    pieces = [("<unk>", 0.0, kind.UNKNOWN), ("<s>", 0.0, kind.CONTROL), ("</s>", 0.0, kind.CONTROL)]
    pieces += [(f"<0x{b:02X}>", 0.0, kind.BYTE) for b in range(256)]
    pieces += [(p, -1.0 - 0.05 * i, kind.NORMAL) for i, p in enumerate(_WORDS + _CHARS)]
    for text, score, piece_type in pieces:
        piece = model.pieces.add()
        piece.piece, piece.score, piece.type = text, score, piece_type
    path.write_bytes(model.SerializeToString(deterministic=True))


_CONFIG_CLASSES: Final = {"Gemma3ForCausalLM": "Gemma3TextConfig"}
"""The config class of a model class whose name does not follow ``XForCausalLM``/``XConfig``."""
_OFFSET_NORMS: Final = ("Gemma3ForCausalLM",)
"""Model classes whose RMSNorm scales by ``1 + weight`` (their norm weights are drawn near 0)."""
_TOKENIZER_CLASSES: Final = {"Phi3ForCausalLM": "LlamaTokenizer"}
"""``tokenizer_class`` for the model classes whose conversion reads it."""


def _weights(
    model: Any, seed: int, hidden: int, tied: bool, *, norm_centre: float = 1.0
) -> dict[str, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(seed))
    out: dict[str, np.ndarray] = {}
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        shape = tuple(param.shape)
        z = rng.standard_normal(size=shape)
        if name.endswith("norm.weight"):
            w = norm_centre + NORM_NOISE * z
        elif name.endswith(".bias"):
            w = BIAS_STD * z
        elif name.endswith("embed_tokens.weight"):
            w = z * (LOGIT_STD / np.sqrt(hidden) if tied else 1.0)
        elif name.endswith("lm_head.weight"):
            w = z * (LOGIT_STD / np.sqrt(hidden))
        elif param.ndim == 2:
            gain = QK_GAIN if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
            w = z * (gain / np.sqrt(shape[1]))
        else:
            raise ValueError(f"no initialisation rule for parameter {name} {shape}")
        out[name] = w.astype(np.float32)
    return out


def build_model(spec: TinyHfSpec) -> Any:
    """The ``transformers`` model of ``spec`` with its seeded weights, float32, eval mode."""
    torch, transformers = require_extras()
    config_name = _CONFIG_CLASSES.get(
        spec.model_class, spec.model_class.replace("ForCausalLM", "Config")
    )
    config_class = getattr(transformers, config_name)
    config = dict(spec.config)
    rope_theta = config.pop("rope_theta", None)
    cfg = config_class(**config)
    if rope_theta is not None:
        if isinstance(getattr(cfg, "rope_parameters", None), dict):
            cfg.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
        else:
            cfg.rope_theta = rope_theta
    cfg.architectures = [spec.model_class]
    cfg._attn_implementation = "eager"
    torch.manual_seed(spec.seed)
    model = getattr(transformers, spec.model_class)(cfg).float().eval()
    if not spec.scaled_init:
        return model
    tied = bool(spec.config.get("tie_word_embeddings", False))
    centre = 0.0 if spec.model_class in _OFFSET_NORMS else 1.0
    weights = _weights(model, spec.seed, int(spec.config["hidden_size"]), tied, norm_centre=centre)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(weights[name]))
    return model


CHAT_TEMPLATE: Final = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A ChatML template (llama.cpp recognises it by ``<|im_start|>``): the converter copies it
into the GGUF's ``tokenizer.chat_template``, so ``--chat`` has something to apply."""
TOKENIZER_CONFIG: Final = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "add_eos_token": False,
    "chat_template": CHAT_TEMPLATE,
}


def write_hf_model(spec: TinyHfSpec, directory: str | os.PathLike[str]) -> Path:
    """Writes ``spec``'s model (config, safetensors, tokenizer) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = build_model(spec)
    require_extras()[1].utils.logging.disable_progress_bar()
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory / "tokenizer.model")
    tokenizer_config = dict(TOKENIZER_CONFIG)
    if spec.model_class in _TOKENIZER_CLASSES:
        tokenizer_config["tokenizer_class"] = _TOKENIZER_CLASSES[spec.model_class]
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    return directory
