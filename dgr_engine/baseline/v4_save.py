"""The pre-conversion step for a DeepSeek V4 saved by ``transformers``: its save rewritten in the
release layout that llama.cpp's converter (``convert_hf_to_gguf.py`` at the pinned commit) reads.

The bare converter refuses what ``DeepseekV4ForCausalLM.save_pretrained`` writes, for four
reasons (found by issue 13; ``tests/models/test_v4_save.py`` keeps the first as a test). This
step answers each, and changes no weight value a model on the MXFP4 grid has:

1. **Config.** ``transformers`` folds the release's ``compress_ratios`` and ``num_hash_layers``
   into ``layer_types`` and ``mlp_layer_types``; the converter reads the release keys. They are
   restored from the model's own config object (``AutoConfig``), see :func:`restored_keys`.
2. **Tensor names.** The save keeps the ``model.`` prefix and calls the attention's KV norm
   ``attn.norm``; the converter matches the release's names (``embed.weight``,
   ``layers.N.attn.kv_norm.weight``, ``hc_head_fn``...). Every tensor is renamed by
   :func:`release_name`; one it does not know is refused.
3. **Routed experts.** The converter takes them only as MXFP4 in the release layout (a packed
   ``weight`` and an E8M0 ``scale`` per expert matrix) and only repacks those bits. This step
   quantizes the saved float experts to MXFP4 (:mod:`dgr_engine.baseline.mxfp4`): exact for
   weights on the MXFP4 grid (the release's own experts, and the converter-made fixture's), a
   rounding otherwise, whose size :attr:`V4Prepared.expert_rounding` reports.
4. **Tokenizer.** The converter recognises a BPE tokenizer's pre-tokenizer by the SHA-256 of the
   token ids it gives for one fixed text, and refuses any other. Those ids depend on the
   vocabulary and merges as much as on the pre-tokenizer, so no edit of a tiny vocabulary's
   pre-tokenizer makes it known; the step copies the tokenizer unchanged and checks, before
   writing anything, that its hash is one the pinned converter knows
   (:func:`converter_pre_tokenizer`). Copied unchanged, it gives the same ids it gave before.

Output is written into a temporary directory beside ``out`` renamed into place: a refusal or a
failure leaves nothing. Needs ``dgr[baseline]`` (torch, transformers, safetensors).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np

from dgr_engine.baseline import converter, mxfp4
from dgr_engine.baseline.errors import TokenizerUnknownToConverter, V4SaveUnmappable
from dgr_engine.baseline.tiny_hf import require_extras

MODEL_TYPE: Final = "deepseek_v4"
COMPRESS_RATIOS_LLAMA_CPP: Final = (0, 4, 128)
"""The compression ratios llama.cpp's ``deepseek4`` graph builds (sliding window, CSA, HCA)."""
SLIDING: Final = "sliding_attention"
HASH_MOE: Final = "hash_moe"

READ_KEYS: Final = (
    "num_hidden_layers",
    "layer_types",
    "compress_rates",
    "mlp_layer_types",
    "head_dim",
    "partial_rotary_factor",
    "rope_parameters",
    "scoring_func",
    "hc_mult",
)
"""``config.json`` keys the mapping reads. Each must be in the saved file: ``transformers``
would fill a missing one with its class default, which need not be the model's."""

_ROOT: Final[Mapping[str, str]] = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "head.weight",
    "head.weight": "head.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
_LAYER_RENAMES: Final[Mapping[str, str]] = {"attn.norm.weight": "attn.kv_norm.weight"}
_LAYER_NAMES: Final = frozenset(
    {
        *(f"hc_{part}_{x}" for part in ("attn", "ffn") for x in ("fn", "base", "scale")),
        "attn_norm.weight",
        "ffn_norm.weight",
        "attn.attn_sink",
        "attn.q_norm.weight",
        "attn.kv_norm.weight",
        *(f"attn.{w}.weight" for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")),
        *(
            f"attn.{c}.{x}"
            for c in ("compressor", "indexer.compressor")
            for x in ("ape", "wkv.weight", "wgate.weight", "norm.weight")
        ),
        "attn.indexer.wq_b.weight",
        "attn.indexer.weights_proj.weight",
        "ffn.gate.weight",
        "ffn.gate.bias",
        "ffn.gate.tid2eid",
        *(f"ffn.shared_experts.w{i}.weight" for i in (1, 2, 3)),
    }
)
"""The per-layer names (after ``layers.N.``) the converter maps for the main layers."""
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight")

_TOKENIZER_FILES_SKIPPED: Final = ("config.json", "model.safetensors.index.json")


@attrs.frozen
class V4Prepared:
    """What the step wrote."""

    directory: Path
    """The directory for the converter: config, safetensors, tokenizer."""
    restored: Mapping[str, Any]
    """The release keys added to ``config.json``, with their values."""
    tensors: int
    """Tensors written (each routed expert matrix counts once, as its weight and scale)."""
    experts: int
    """Routed expert matrices quantized to MXFP4."""
    expert_rounding: float
    """Largest |saved value - MXFP4 value| over the routed experts: 0 when they were on the
    grid (the quantization then lost nothing)."""
    pre_tokenizer: str
    """The converter's name for the tokenizer's pre-tokenizer (``tokenizer.ggml.pre``)."""


def restored_keys(config: Any, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The release keys the converter reads and ``save_pretrained`` folded away, from the config
    object ``config`` (``raw``: the saved ``config.json``, to tell a missing key from a default):

    * ``compress_ratios``: per layer, 0 for ``layer_types[i] == "sliding_attention"``, else
      ``compress_rates[layer_types[i]]`` (``transformers`` built ``layer_types`` from the ratios
      and keeps the rate of each compressed type in ``compress_rates``);
    * ``num_hash_layers``: the number of leading ``"hash_moe"`` entries of ``mlp_layer_types``
      (llama.cpp routes by hash exactly the layers below that count);
    * ``qk_rope_head_dim``: ``config.qk_rope_head_dim``, which ``transformers`` derives as
      ``int(head_dim * partial_rotary_factor)`` (the roped tail of each head).

    :class:`V4SaveUnmappable` names the first key missing or value llama.cpp cannot take."""
    missing = [key for key in READ_KEYS if key not in raw]
    if missing:
        raise V4SaveUnmappable(f"config.json lacks {', '.join(missing)}, which the step reads")
    n_layer = int(config.num_hidden_layers)
    layer_types, mlp_types = list(config.layer_types), list(config.mlp_layer_types)
    rates = {SLIDING: 0, **dict(config.compress_rates)}
    for name, types in (("layer_types", layer_types), ("mlp_layer_types", mlp_types)):
        if len(types) != n_layer:
            raise V4SaveUnmappable(f"{name} has {len(types)} entries for {n_layer} layers")
    unknown = sorted({t for t in layer_types if t not in rates})
    if unknown:
        raise V4SaveUnmappable(f"layer_types {unknown} have no rate in compress_rates")
    ratios = [int(rates[t]) for t in layer_types]
    if not set(ratios) <= set(COMPRESS_RATIOS_LLAMA_CPP):
        raise V4SaveUnmappable(
            f"compress ratios {sorted(set(ratios))}: llama.cpp builds only "
            f"{', '.join(map(str, COMPRESS_RATIOS_LLAMA_CPP))}"
        )
    n_hash = next((i for i, t in enumerate(mlp_types) if t != HASH_MOE), n_layer)
    if HASH_MOE in mlp_types[n_hash:]:
        raise V4SaveUnmappable(
            "mlp_layer_types has hash_moe after a moe layer: llama.cpp hash-routes only a "
            "leading run of layers (num_hash_layers)"
        )
    _check_supported(config)
    return {
        "compress_ratios": ratios,
        "num_hash_layers": n_hash,
        "qk_rope_head_dim": int(config.qk_rope_head_dim),
    }


def _check_supported(config: Any) -> None:
    """Values the converter would carry over wrongly or llama.cpp refuses, named before work."""
    if config.scoring_func != "sqrtsoftplus":
        raise V4SaveUnmappable(
            f"scoring_func {config.scoring_func!r}: llama.cpp's deepseek4 takes sqrtsoftplus"
        )
    if int(config.hc_mult) != 4:
        raise V4SaveUnmappable(f"hc_mult {config.hc_mult}: llama.cpp's deepseek4 requires 4")
    for label, params in dict(config.rope_parameters).items():
        rope_type = dict(params).get("rope_type", "default")
        if rope_type != "default":
            raise V4SaveUnmappable(
                f"rope_parameters[{label!r}] is {rope_type!r}: the step maps default RoPE only "
                "(the converter would drop a scaling nested per rope type)"
            )


def release_name(saved: str) -> str:
    """The release's (the converter's) name of the saved tensor ``saved``;
    :class:`V4SaveUnmappable` for a name the converter would not map."""
    if saved in _ROOT:
        return _ROOT[saved]
    match = _LAYER.fullmatch(saved)
    if match is not None:
        layer, rest = match.groups()
        rest = _LAYER_RENAMES.get(rest, rest)
        if rest in _LAYER_NAMES or _EXPERT.fullmatch(rest):
            return f"layers.{layer}.{rest}"
    raise V4SaveUnmappable(f"tensor {saved!r} has no name in the release layout")


# -- the tokenizer -----------------------------------------------------------------------------


def _known_hashes(converter_base: Path) -> tuple[str, dict[str, str]]:
    """The converter's hash text and its known ``chkhsh -> tokenizer.ggml.pre`` table, read from
    ``get_vocab_base_pre`` in its ``conversion/base.py`` (the pinned tree's own source)."""
    tree = ast.parse(converter_base.read_text(encoding="utf-8"))
    func = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "get_vocab_base_pre"
    )
    text, known = None, {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "chktxt":
            text = ast.literal_eval(node.value)
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and getattr(node.test.left, "id", None) == "chkhsh"
            and isinstance(node.test.comparators[0], ast.Constant)
            and isinstance(node.body[0], ast.Assign)
            and isinstance(node.body[0].value, ast.Constant)
        ):
            known[str(node.test.comparators[0].value)] = str(node.body[0].value.value)
    if not isinstance(text, str) or not known:
        raise RuntimeError(f"{converter_base}: no get_vocab_base_pre hash table found")
    return text, known


def converter_pre_tokenizer(saved_dir: Path, converter_base: Path) -> str:
    """The ``tokenizer.ggml.pre`` the converter would give the tokenizer in ``saved_dir``
    (computed as it does: ``AutoTokenizer``, the ids of its fixed text, SHA-256);
    :class:`TokenizerUnknownToConverter` when it would refuse it."""
    transformers = require_extras()[1]
    text, known = _known_hashes(converter_base)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(saved_dir)
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TokenizerUnknownToConverter(
            f"no tokenizer transformers can load: {first}", path=saved_dir
        ) from None
    chkhsh = hashlib.sha256(str(tokenizer.encode(text)).encode()).hexdigest()
    if chkhsh not in known:
        raise TokenizerUnknownToConverter(
            f"the pinned converter does not know this tokenizer (chkhsh {chkhsh[:16]}...): it "
            "recognises a BPE pre-tokenizer only with the vocabulary it was listed with",
            path=saved_dir,
        )
    return known[chkhsh]


# -- the step ----------------------------------------------------------------------------------


def prepare(
    saved_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    converter_tree: Path | None = None,
) -> V4Prepared:
    """Writes ``saved_dir`` (a V4 saved by ``transformers``) into the new directory ``out`` in
    the release layout; ``converter_tree`` is the pinned llama.cpp tree (default: the one
    :func:`~dgr_engine.baseline.converter.converter_tree` extracts), whose converter's tokenizer
    table is checked. Everything is checked before anything is written."""
    torch, transformers = require_extras()
    tree = converter_tree if converter_tree is not None else converter.converter_tree()
    from safetensors.torch import load_file, save_file

    saved_dir, out = Path(saved_dir), Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; the step writes a new directory")
    raw = _read_raw_config(saved_dir)
    config = transformers.AutoConfig.from_pretrained(saved_dir)
    restored = restored_keys(config, raw)
    files = sorted(saved_dir.glob("*.safetensors"))
    if not files:
        raise V4SaveUnmappable("no *.safetensors weights", path=saved_dir)
    names = {f: _tensor_names(f) for f in files}
    for saved in (n for group in names.values() for n in group):
        release_name(saved)  # refuses an unknown name before anything is written
    pre = converter_pre_tokenizer(saved_dir, tree / "conversion" / "base.py")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        count = experts = 0
        rounding = 0.0
        weight_map: dict[str, str] = {}
        for path in files:
            tensors: dict[str, Any] = {}
            for saved, value in load_file(path).items():
                name = release_name(saved)
                if _EXPERT.search(name):
                    w = value.float().numpy()
                    packed, scale = mxfp4.to_release(w)
                    rounding = max(
                        rounding, float(np.abs(mxfp4.from_release(packed, scale) - w).max())
                    )
                    base = name.removesuffix(".weight")
                    tensors[f"{base}.weight"] = torch.from_numpy(packed)
                    tensors[f"{base}.scale"] = torch.from_numpy(scale)
                    experts += 1
                else:
                    tensors[name] = value.contiguous()
                count += 1
            weight_map.update(dict.fromkeys(tensors, path.name))
            save_file(tensors, tmp / path.name, metadata={"format": "pt"})
        _write_config(tmp / "config.json", raw, restored)
        _write_index(saved_dir, tmp, weight_map)
        _copy_tokenizer(saved_dir, tmp)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return V4Prepared(out, restored, count, experts, rounding, pre)


def _read_raw_config(saved_dir: Path) -> dict[str, Any]:
    path = saved_dir / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise V4SaveUnmappable(f"config.json is not readable: {exc}", path=saved_dir) from None
    if not isinstance(raw, dict) or raw.get("model_type") != MODEL_TYPE:
        got = raw.get("model_type") if isinstance(raw, dict) else None
        raise V4SaveUnmappable(
            f"model_type is {got!r}: the step maps {MODEL_TYPE!r} saves only", path=saved_dir
        )
    return raw


def _tensor_names(path: Path) -> Sequence[str]:
    from safetensors import safe_open

    with safe_open(path, "np") as handle:
        return list(handle.keys())


def _write_config(path: Path, raw: Mapping[str, Any], restored: Mapping[str, Any]) -> None:
    path.write_text(json.dumps({**raw, **restored}, indent=2, sort_keys=True) + "\n")


def _write_index(saved_dir: Path, out: Path, weight_map: Mapping[str, str]) -> None:
    index = saved_dir / "model.safetensors.index.json"
    if index.is_file():
        meta = json.loads(index.read_text(encoding="utf-8")).get("metadata", {})
        body = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
        (out / index.name).write_text(json.dumps(body, indent=2) + "\n")


def _copy_tokenizer(saved_dir: Path, out: Path) -> None:
    """Every file besides the config, the weights and their index: the tokenizer's files and
    ``generation_config.json``, byte for byte."""
    for path in sorted(saved_dir.iterdir()):
        if path.is_file() and path.suffix != ".safetensors":
            if path.name not in _TOKENIZER_FILES_SKIPPED:
                shutil.copyfile(path, out / path.name)
