"""A tiny DeepSeek V4 made the way ``transformers`` users get one: a ``DeepseekV4ForCausalLM``
from a config and a seed, saved by ``save_pretrained`` with a tokenizer.

Bit-reproducible: every parameter and persistent buffer is drawn with numpy's PCG64 from the
seed, in sorted name order. The draws follow :mod:`dgr_engine.fixtures.deepseek4`'s rules, with
logits spread as real ones are (as :mod:`dgr_engine.baseline.tiny_hf` does for Llama):

* a linear ``[out, in]``: N(0, 1/in); one writing back into the residual streams (attention
  output ``o_b_proj``, the experts' ``down_proj``, the shared expert's) further / sqrt(2 layers);
* the embedding N(0, 1); the output head N(0, 2.5^2/hidden);
* RMSNorm weights 1 + N(0, 0.1^2); hyper-connection scales 0.5 + N(0, 0.05^2); hyper-connection
  bases, attention sinks, compressor position biases and the routers' score-correction biases
  N(0, 0.05^2);
* the hash-routing table ``tid2eid``: for each token, ``num_experts_per_tok`` distinct experts;
* the routed experts' weights rounded onto the MXFP4 grid (:func:`mxfp4.to_grid`, blocks of 32
  along each row's input), the form the release ships them in: llama.cpp's converter takes routed
  experts only as MXFP4, and on the grid that quantization loses nothing, so the GGUF's experts
  are the very weights ``transformers`` runs.

The tokenizer is GPT-2's byte-level BPE, rebuilt from the ``models/ggml-vocab-gpt-2.gguf`` that
the pinned llama.cpp tree ships (vocabulary and merges; ``ByteLevel`` pre-tokenizer): the
converter recognises a BPE tokenizer only by the hash of the token ids it gives for a fixed
text, which only a real tokenizer's vocabulary reproduces (``docs/v4-from-transformers.md``).
Hence the vocabulary of 50257.

Needs the ``dgr[baseline]`` extra (torch, transformers), imported when used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Final

import numpy as np

from dgr_engine.baseline import mxfp4
from dgr_engine.baseline.tiny_hf import LOGIT_STD, TinyHfSpec, require_extras

NORM_NOISE: Final = 0.1
SMALL_STD: Final = 0.05
HC_SCALE: Final = 0.5

GPT2_VOCAB_SIZE: Final = 50257
GPT2_ENDOFTEXT: Final = 50256
"""``<|endoftext|>``: GPT-2's only special token (its BOS and EOS)."""
GPT2_VOCAB_GGUF: Final = "models/ggml-vocab-gpt-2.gguf"
"""The vocabulary's path inside the pinned llama.cpp tree."""

_V4: Final = {
    "vocab_size": GPT2_VOCAB_SIZE,
    "hidden_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "compress_ratios": [0, 4, 128, 4, 0],
    "num_hash_layers": 2,
    "sliding_window": 16,
    "index_n_heads": 16,
    "index_head_dim": 64,
    "index_topk": 4,
    "hc_mult": 4,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 0,
    "bos_token_id": GPT2_ENDOFTEXT,
    "eos_token_id": GPT2_ENDOFTEXT,
}

V4_SPEC: Final = TinyHfSpec(
    "hf-deepseek-v4",
    "DeepseekV4ForCausalLM",
    _V4,
    seed=4404,
    description="5-layer DeepSeek V4: ratios 0/4/128/4/0, 2 hash layers, 4 experts top-2",
)
"""The tiny V4 of the converter-made fixtures (widths are multiples of 32 for MXFP4, hc 4 and
an indexer head dim of 64 because llama.cpp requires them). 16 indexer heads: a compressed
block's index score is a sum over heads of ``w_h * ReLU(q_h . k)``, exactly 0 when every head's
dot product is negative; with 4 heads, random weights made several such zeros tie at the top-k
boundary, where torch and ggml break ties differently (logit jumps of 0.4 at those positions,
5e-6 elsewhere). With 16 heads an all-negative block is rare and the measured gap is float32
noise."""

_RESIDUAL_OUT: Final = ("o_b_proj.weight", "shared_experts.down_proj.weight", "experts.down_proj")
_SMALL: Final = ("hc.base", "hc_base", "sinks", "position_bias", "e_score_correction_bias")
_HC_SCALE: Final = ("hc.scale", "hc_scale")


def _draw(name: str, shape: tuple[int, ...], z: np.ndarray, hidden: int, layers: int) -> Any:
    if name.endswith("norm.weight"):
        return 1.0 + NORM_NOISE * z
    if name.endswith(_HC_SCALE):
        return HC_SCALE + SMALL_STD * z
    if name.endswith(_SMALL):
        return SMALL_STD * z
    if name.endswith("embed_tokens.weight"):
        return z
    if name.endswith("lm_head.weight"):
        return z * (LOGIT_STD / np.sqrt(hidden))
    if len(shape) in (2, 3):  # linears [out, in], experts [experts, out, in], hc fn [mix, in]
        std = 1.0 / np.sqrt(shape[-1])
        if name.endswith(_RESIDUAL_OUT):
            std /= np.sqrt(2 * layers)
        w = (z * std).astype(np.float32)
        return mxfp4.to_grid(w) if ".experts." in name else w
    raise ValueError(f"no initialisation rule for {name} {shape}")


def _state(model: Any, spec: TinyHfSpec) -> dict[str, np.ndarray]:
    """Every parameter and persistent buffer's values, drawn in sorted name order."""
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    hidden, layers = int(spec.config["hidden_size"]), int(spec.config["num_hidden_layers"])
    n_expert, top_k = int(spec.config["n_routed_experts"]), int(spec.config["num_experts_per_tok"])
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if not n.endswith("inv_freq"))
    out: dict[str, np.ndarray] = {}
    for name in sorted(tensors):
        shape = tuple(tensors[name].shape)
        if name.endswith("tid2eid"):
            table = np.argsort(rng.random((shape[0], n_expert)), axis=1)[:, :top_k]
            out[name] = table.astype(np.int64)
        else:
            z = rng.standard_normal(size=shape)
            out[name] = np.asarray(_draw(name, shape, z, hidden, layers), dtype=np.float32)
    return out


def build_model(spec: TinyHfSpec = V4_SPEC) -> Any:
    """The ``transformers`` V4 of ``spec`` with its seeded weights, float32, eval mode."""
    torch, transformers = require_extras()
    cfg = transformers.DeepseekV4Config(**spec.config)
    cfg.architectures = [spec.model_class]
    cfg._attn_implementation = "eager"
    torch.manual_seed(spec.seed)
    model = transformers.DeepseekV4ForCausalLM(cfg).float().eval()
    values = _state(model, spec)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name in values:
                tensor.copy_(torch.from_numpy(values[name]))
    return model


def gpt2_tokenizer(vocab_gguf: Path) -> Any:
    """GPT-2's tokenizer (``transformers``' fast tokenizer) rebuilt from a llama.cpp vocabulary
    GGUF: its tokens in id order, its merges, byte-level pre-tokenization and decoding."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    transformers = require_extras()[1]
    fields = GGUFReader(vocab_gguf).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    if len(tokens) != GPT2_VOCAB_SIZE:
        raise ValueError(f"{vocab_gguf}: {len(tokens)} tokens, GPT-2 has {GPT2_VOCAB_SIZE}")
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = tokens[GPT2_ENDOFTEXT]
    bpe.add_special_tokens([AddedToken(special, special=True, normalized=False)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=special, eos_token=special, unk_token=special
    )


def write_hf_model(
    spec: TinyHfSpec, directory: str | os.PathLike[str], *, vocab_gguf: Path
) -> Path:
    """Writes ``spec``'s model (``save_pretrained``: config, safetensors) and the GPT-2
    tokenizer rebuilt from ``vocab_gguf`` into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = build_model(spec)
    require_extras()[1].utils.logging.disable_progress_bar()
    model.save_pretrained(directory, safe_serialization=True)
    gpt2_tokenizer(vocab_gguf).save_pretrained(directory)
    return directory


PARITY_PROMPT_LENGTHS: Final = (260, 140)
"""Prompt lengths for parity runs: 260 tokens pass the sliding window (16), 65 CSA blocks (ratio
4, of which the indexer keeps 4) and two HCA blocks (ratio 128); 140 tokens one HCA block."""


def parity_prompts(seed: int = 33) -> tuple[tuple[int, ...], ...]:
    """Seeded token ids over GPT-2's vocabulary (never ``<|endoftext|>``), one prompt per
    :data:`PARITY_PROMPT_LENGTHS`."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return tuple(
        tuple(int(t) for t in rng.integers(0, GPT2_ENDOFTEXT, n)) for n in PARITY_PROMPT_LENGTHS
    )
