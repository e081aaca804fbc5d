"""Does a GGUF's metadata agree with the HF config it should have been made from?

Checked before the baseline runs, so a GGUF of another model (or an edited copy) is refused with
the first disagreeing key named, instead of showing up as a parity failure."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gguf import GGUFReader

from dgr_engine.baseline.errors import MetadataDisagrees

DENSE_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
"""GGUF architectures whose attention and feed-forward keys the config determines here."""


def _rope_theta(config: Mapping[str, Any]) -> float | None:
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        params = params.get("full_attention", params)  # per layer type (Gemma 3): the global's
    if isinstance(params, Mapping) and "rope_theta" in params:
        return float(params["rope_theta"])
    value = config.get("rope_theta")
    return None if value is None else float(value)


def expected(config: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """GGUF key -> the value the config implies (only keys the config determines)."""
    out: dict[str, Any] = {
        f"{arch}.block_count": config.get("num_hidden_layers"),
        f"{arch}.embedding_length": config.get("hidden_size"),
        "tokenizer.ggml.tokens": config.get("vocab_size"),  # compared by length
    }
    if arch in DENSE_ARCHS:
        heads = config.get("num_attention_heads")
        out[f"{arch}.attention.head_count"] = heads
        out[f"{arch}.attention.head_count_kv"] = config.get("num_key_value_heads", heads)
        out[f"{arch}.feed_forward_length"] = config.get("intermediate_size")
        out[f"{arch}.rope.freq_base"] = _rope_theta(config)
        if config.get("head_dim") is not None:
            out[f"{arch}.attention.key_length"] = config.get("head_dim")
    return {key: value for key, value in out.items() if value is not None}


def check(gguf: str | os.PathLike[str], config: Mapping[str, Any], arch: str) -> None:
    """:class:`MetadataDisagrees` naming the first key whose value is not the config's."""
    fields = GGUFReader(gguf).fields
    got_arch = (
        fields["general.architecture"].contents() if "general.architecture" in fields else None
    )
    if got_arch != arch:
        raise MetadataDisagrees(
            f"general.architecture is {got_arch!r}, the config's model is {arch!r}", path=Path(gguf)
        )
    for key, want in expected(config, arch).items():
        field = fields.get(key)
        if field is None:
            if key.endswith(".key_length"):
                continue  # llama.cpp derives it from embedding_length / head_count
            raise MetadataDisagrees(
                f"{key} is missing (the config implies {want})", path=Path(gguf)
            )
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = len(value)
        same = math.isclose(float(value), float(want), rel_tol=1e-6)
        if not same:
            raise MetadataDisagrees(f"{key} is {value}, the config implies {want}", path=Path(gguf))
