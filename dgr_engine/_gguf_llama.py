"""GGUF layout of the dense llama-family fixtures: metadata keys, tensor plan, weight values.

Private helper of :mod:`dgr_engine.fixtures`. Everything here is a pure function of the fixture
spec, so one spec always produces the same bytes.

Shape order: GGUF lists dimensions fastest first (``ne = {n_embd, n_vocab}``), numpy slowest
first. Every shape in this module is a *numpy* shape; ``GGUFWriter`` reverses it on write, so a
``(n_vocab, n_embd)`` array becomes the GGUF tensor ``{n_embd, n_vocab}`` that llama.cpp expects.

Tensor and key names follow the pinned llama.cpp (``src/models/llama.cpp``,
``src/models/qwen2.cpp``, ``src/llama-arch.cpp``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

import attrs
import numpy as np
import numpy.typing as npt
from gguf import GGUFWriter

if TYPE_CHECKING:
    from dgr_engine.fixtures import FixtureSpec

GGUF_ALIGNMENT = 32
"""Tensor data alignment GGUFWriter uses by default (``general.alignment`` absent)."""

TensorKind = Literal["embedding", "matrix", "residual_out", "norm", "bias"]

_NORM_JITTER = 0.02
_BIAS_STD = 0.02


@attrs.frozen
class TensorPlan:
    """One tensor of a fixture file, before its values exist."""

    name: str
    """GGUF tensor name, e.g. ``blk.3.attn_q.weight``."""
    shape: tuple[int, ...]
    """numpy shape (slowest dimension first)."""
    dtype: np.dtype[np.floating]
    """Stored element type: float32 or float16."""
    kind: TensorKind
    """How the values are drawn (see :func:`make_tensor`)."""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def padded(nbytes: int) -> int:
    """Bytes a tensor occupies in the data section, padding included."""
    return (nbytes + GGUF_ALIGNMENT - 1) // GGUF_ALIGNMENT * GGUF_ALIGNMENT


def tensor_plan(spec: FixtureSpec) -> list[TensorPlan]:
    """Every tensor of the fixture, in file order."""
    f32 = np.dtype(np.float32)
    big = np.dtype(np.float16) if spec.matrix_dtype == "f16" else f32
    e, v, ff = spec.n_embd, spec.n_vocab, spec.n_ff
    q, kv = spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim

    plan = [
        TensorPlan("token_embd.weight", (v, e), big, "embedding"),
        TensorPlan("output_norm.weight", (e,), f32, "norm"),
    ]
    if not spec.tied_output:
        plan.append(TensorPlan("output.weight", (v, e), big, "matrix"))
    for i in range(spec.n_layer):
        b = f"blk.{i}"
        plan += [
            TensorPlan(f"{b}.attn_norm.weight", (e,), f32, "norm"),
            TensorPlan(f"{b}.attn_q.weight", (q, e), big, "matrix"),
            TensorPlan(f"{b}.attn_k.weight", (kv, e), big, "matrix"),
            TensorPlan(f"{b}.attn_v.weight", (kv, e), big, "matrix"),
        ]
        if spec.qkv_bias:
            plan += [
                TensorPlan(f"{b}.attn_q.bias", (q,), f32, "bias"),
                TensorPlan(f"{b}.attn_k.bias", (kv,), f32, "bias"),
                TensorPlan(f"{b}.attn_v.bias", (kv,), f32, "bias"),
            ]
        plan += [
            TensorPlan(f"{b}.attn_output.weight", (e, q), big, "residual_out"),
            TensorPlan(f"{b}.ffn_norm.weight", (e,), f32, "norm"),
            TensorPlan(f"{b}.ffn_gate.weight", (ff, e), big, "matrix"),
            TensorPlan(f"{b}.ffn_up.weight", (ff, e), big, "matrix"),
            TensorPlan(f"{b}.ffn_down.weight", (e, ff), big, "residual_out"),
        ]
    return plan


def write_metadata(writer: GGUFWriter, spec: FixtureSpec) -> None:
    """Add the key/value metadata (``general.architecture`` is added by the writer itself)."""
    a = spec.arch
    writer.add_string("general.name", spec.name)
    writer.add_uint32(f"{a}.context_length", spec.n_ctx_train)
    writer.add_uint32(f"{a}.embedding_length", spec.n_embd)
    writer.add_uint32(f"{a}.block_count", spec.n_layer)
    writer.add_uint32(f"{a}.feed_forward_length", spec.n_ff)
    writer.add_uint32(f"{a}.attention.head_count", spec.n_head)
    writer.add_uint32(f"{a}.attention.head_count_kv", spec.n_head_kv)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", spec.rms_eps)
    writer.add_uint32(f"{a}.rope.dimension_count", spec.head_dim)
    writer.add_float32(f"{a}.rope.freq_base", spec.rope_freq_base)
    writer.add_uint32(f"{a}.vocab_size", spec.n_vocab)
    # No token list: llama.cpp's "none" vocabulary adds vocab_size dummy tokens.
    writer.add_string("tokenizer.ggml.model", "none")


def make_tensor(spec: FixtureSpec, plan: TensorPlan) -> npt.NDArray[np.floating]:
    """The values of one tensor, seeded by (fixture seed, tensor name): order-independent.

    Scales keep activations O(1) through every layer: matrices ``N(0, 1/fan_in)``, projections
    back into the residual stream further divided by ``sqrt(2 * n_layer)``, embeddings
    ``N(0, 1/n_embd)`` (so a tied output head gives O(1) logits and the input token's own
    embedding does not dominate them), norm weights ``1 + N(0, 0.02)``, biases ``N(0, 0.02)``.
    """
    name_key = int.from_bytes(hashlib.sha256(plan.name.encode()).digest()[:8], "little")
    rng = np.random.default_rng([spec.seed, name_key])
    values = rng.standard_normal(plan.shape, dtype=np.float32)
    fan_in = plan.shape[-1]
    if plan.kind == "embedding":
        std = fan_in**-0.5
    elif plan.kind == "matrix":
        std = fan_in**-0.5
    elif plan.kind == "residual_out":
        std = fan_in**-0.5 / (2 * spec.n_layer) ** 0.5
    elif plan.kind == "bias":
        std = _BIAS_STD
    else:  # norm
        values *= np.float32(_NORM_JITTER)
        values += np.float32(1.0)
        return values
    values *= np.float32(std)
    return values.astype(plan.dtype, copy=False)


def iter_tensors(
    spec: FixtureSpec, plans: list[TensorPlan]
) -> Iterator[tuple[TensorPlan, npt.NDArray[np.floating]]]:
    """Yield each planned tensor with its values, one at a time (bounded memory)."""
    for plan in plans:
        yield plan, make_tensor(spec, plan)
