"""GGUF layout of the DeepSeek V4 fixtures: spec, metadata keys, tensor plan, weight values.

Private helper of :mod:`dgr_engine.fixtures`. Everything here is a pure function of the spec, so
one spec always produces the same bytes.

PyPI ``gguf`` 0.19.0 has no DEEPSEEK4 constants, so the keys are written by their raw names
(``deepseek4.*``, as in ``src/llama-arch.cpp`` of the pinned llama.cpp) and the hash-routing
table ``ffn_gate_tid2eid`` as an I32 tensor. The tensors are those ``src/models/deepseek4.cpp``
loads for the main layers; no MTP (nextn) layers are written.

Shape order: every shape here is a *numpy* shape (slowest dimension first); ``GGUFWriter``
reverses it, so a ``(n_vocab, n_embd)`` array is the GGUF tensor ``{n_embd, n_vocab}``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Literal

import attrs
import numpy as np
import numpy.typing as npt
from gguf import GGUFWriter

ARCH = "deepseek4"
"""``general.architecture`` of every V4 fixture."""

GGUF_ALIGNMENT = 32
"""Tensor data alignment GGUFWriter uses by default (``general.alignment`` absent)."""

CSA_RATIO = 4
"""Compression ratio of the compressed sparse attention layers (they also have an indexer)."""

HCA_RATIO = 128
"""Compression ratio of the heavily compressed attention layers."""

EXPERT_GATING_SQRT_SOFTPLUS = 4
"""``expert_gating_func`` value V4 requires (``LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS``)."""

TensorKind = Literal[
    "embedding", "matrix", "residual_out", "norm", "small", "hc_scale", "routing", "zero"
]

_NORM_JITTER = 0.02
_SMALL_STD = 0.05


def _ratios(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _positive(spec: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be positive, got {value}")


@attrs.frozen
class Deepseek4Spec:
    """Everything that determines a V4 fixture file's bytes (with the generator version)."""

    name: str
    """Public fixture name; also seeds the random weights."""
    n_layer: int = attrs.field(validator=_positive)
    """Main layers (``block_count``; no MTP layers are written)."""
    n_embd: int = attrs.field(validator=_positive)
    n_head: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    """``attention.key_length`` = ``value_length`` (one shared KV head)."""
    n_rot: int = attrs.field(validator=_positive)
    """``rope.dimension_count``: the roped tail of each head."""
    q_lora_rank: int = attrs.field(validator=_positive)
    o_groups: int = attrs.field(validator=_positive)
    """``attention.output_group_count``."""
    o_lora_rank: int = attrs.field(validator=_positive)
    n_expert: int = attrs.field(validator=_positive)
    n_expert_used: int = attrs.field(validator=_positive)
    n_ff_exp: int = attrs.field(validator=_positive)
    n_expert_shared: int = attrs.field(validator=_positive)
    n_vocab: int = attrs.field(validator=_positive)
    n_ctx_train: int = attrs.field(validator=_positive)
    n_swa: int = attrs.field(validator=_positive)
    """``attention.sliding_window``."""
    compress_ratios: tuple[int, ...] = attrs.field(converter=_ratios)
    """One ratio per main layer: 0 (sliding window only), 4 (CSA + indexer) or 128 (HCA)."""
    hash_layer_count: int = 0
    """Layers ``il < hash_layer_count`` route experts by token id (``ffn_gate_tid2eid``)."""
    indexer_n_head: int = 2
    indexer_head_dim: int = 64
    """``attention.indexer.key_length``: a power of two >= 64."""
    indexer_top_k: int = 8
    hc_mult: int = 4
    """Hyper-connection streams; llama.cpp requires 4."""
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_eps: float = 1e-6
    rope_freq_base: float = 10000.0
    compress_rope_freq_base: float = 160000.0
    expert_weights_scale: float = 1.5
    expert_weights_norm: bool = True
    swiglu_limit: float = 10.0
    description: str = ""
    """One line for ``list``; not part of the bytes nor of the cache key."""

    @property
    def arch(self) -> str:
        return ARCH

    def __attrs_post_init__(self) -> None:
        if len(self.compress_ratios) != self.n_layer:
            raise ValueError(
                f"{len(self.compress_ratios)} compress ratios for {self.n_layer} layers"
            )
        bad = sorted(set(self.compress_ratios) - {0, CSA_RATIO, HCA_RATIO})
        if bad:
            raise ValueError(f"compress ratios must be 0, 4 or 128, got {bad}")
        if not 0 <= self.hash_layer_count <= self.n_layer:
            raise ValueError(f"hash_layer_count {self.hash_layer_count} outside [0, n_layer]")
        if self.hc_mult != 4:
            raise ValueError("llama.cpp's deepseek4 graph requires hc_mult 4")
        if self.n_head % self.o_groups:
            raise ValueError(f"n_head {self.n_head} not divisible by o_groups {self.o_groups}")
        if self.n_rot > self.head_dim or self.n_rot % 2:
            raise ValueError(f"n_rot {self.n_rot} must be even and <= head_dim {self.head_dim}")
        d = self.indexer_head_dim
        if d < 64 or d & (d - 1):
            raise ValueError(f"indexer_head_dim must be a power of two >= 64, got {d}")
        if self.n_expert_used > self.n_expert:
            raise ValueError("n_expert_used exceeds n_expert")

    @property
    def seed(self) -> int:
        """64-bit seed derived from the fixture name only."""
        digest = hashlib.sha256(f"dgr-fixture/{self.name}".encode()).digest()
        return int.from_bytes(digest[:8], "little")

    @property
    def boundary_width(self) -> int:
        """Floats per token crossing a stage boundary: the ``hc_mult`` streams."""
        return self.hc_mult * self.n_embd


@attrs.frozen
class TensorPlan:
    """One tensor of a fixture file, before its values exist."""

    name: str
    """GGUF tensor name, e.g. ``blk.3.attn_q_a.weight``."""
    shape: tuple[int, ...]
    """numpy shape (slowest dimension first)."""
    dtype: np.dtype[np.float32] | np.dtype[np.int32]
    """Stored element type: float32, or int32 for the hash-routing table."""
    kind: TensorKind
    """How the values are drawn (see :func:`make_tensor`)."""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def padded(nbytes: int) -> int:
    """Bytes a tensor occupies in the data section, padding included."""
    return (nbytes + GGUF_ALIGNMENT - 1) // GGUF_ALIGNMENT * GGUF_ALIGNMENT


def tensor_plan(spec: Deepseek4Spec) -> list[TensorPlan]:
    """Every tensor of the fixture, in file order."""
    f32: np.dtype[np.float32] = np.dtype(np.float32)
    i32: np.dtype[np.int32] = np.dtype(np.int32)
    e, v, hc = spec.n_embd, spec.n_vocab, spec.hc_mult
    h, d, q = spec.n_head, spec.head_dim, spec.q_lora_rank
    g, r = spec.o_groups, spec.o_lora_rank
    x, k, ff, fs = (
        spec.n_expert,
        spec.n_expert_used,
        spec.n_ff_exp,
        spec.n_ff_exp * spec.n_expert_shared,
    )
    mix = (2 + hc) * hc

    def t(name: str, shape: tuple[int, ...], kind: TensorKind) -> TensorPlan:
        return TensorPlan(name, shape, i32 if kind == "routing" else f32, kind)

    plan = [
        t("token_embd.weight", (v, e), "embedding"),
        t("output_norm.weight", (e,), "norm"),
        t("output.weight", (v, e), "matrix"),
        t("output_hc_fn.weight", (hc, hc * e), "matrix"),
        t("output_hc_base.weight", (hc,), "small"),
        t("output_hc_scale.weight", (1,), "hc_scale"),
    ]
    for i in range(spec.n_layer):
        b = f"blk.{i}"
        plan += [
            t(f"{b}.attn_norm.weight", (e,), "norm"),
            t(f"{b}.attn_sinks.weight", (h,), "small"),
            t(f"{b}.attn_q_a.weight", (q, e), "matrix"),
            t(f"{b}.attn_q_a_norm.weight", (q,), "norm"),
            t(f"{b}.attn_q_b.weight", (h * d, q), "matrix"),
            t(f"{b}.attn_kv.weight", (d, e), "matrix"),
            t(f"{b}.attn_kv_a_norm.weight", (d,), "norm"),
            t(f"{b}.attn_output_a.weight", (r * g, h * d // g), "matrix"),
            t(f"{b}.attn_output_b.weight", (e, g * r), "residual_out"),
            t(f"{b}.hc_attn_fn.weight", (mix, hc * e), "matrix"),
            t(f"{b}.hc_attn_base.weight", (mix,), "small"),
            t(f"{b}.hc_attn_scale.weight", (3,), "hc_scale"),
            t(f"{b}.hc_ffn_fn.weight", (mix, hc * e), "matrix"),
            t(f"{b}.hc_ffn_base.weight", (mix,), "small"),
            t(f"{b}.hc_ffn_scale.weight", (3,), "hc_scale"),
        ]
        ratio = spec.compress_ratios[i]
        if ratio:
            c = 2 if ratio == CSA_RATIO else 1
            plan += [
                t(f"{b}.attn_compressor_kv.weight", (c * d, e), "matrix"),
                t(f"{b}.attn_compressor_gate.weight", (c * d, e), "matrix"),
                t(f"{b}.attn_compressor_ape.weight", (ratio, c * d), "small"),
                t(f"{b}.attn_compressor_norm.weight", (d,), "norm"),
            ]
        if ratio == CSA_RATIO:
            ih, idim = spec.indexer_n_head, spec.indexer_head_dim
            plan += [
                t(f"{b}.indexer.proj.weight", (ih, e), "matrix"),
                t(f"{b}.indexer.attn_q_b.weight", (ih * idim, q), "matrix"),
                t(f"{b}.indexer_compressor_kv.weight", (2 * idim, e), "matrix"),
                t(f"{b}.indexer_compressor_gate.weight", (2 * idim, e), "matrix"),
                t(f"{b}.indexer_compressor_ape.weight", (ratio, 2 * idim), "small"),
                t(f"{b}.indexer_compressor_norm.weight", (idim,), "norm"),
            ]
        plan.append(t(f"{b}.ffn_gate_inp.weight", (x, e), "matrix"))
        if i < spec.hash_layer_count:
            plan.append(t(f"{b}.ffn_gate_tid2eid.weight", (v, k), "routing"))
        else:
            plan.append(t(f"{b}.exp_probs_b.bias", (x,), "zero"))
        plan += [
            t(f"{b}.ffn_norm.weight", (e,), "norm"),
            t(f"{b}.ffn_gate_exps.weight", (x, ff, e), "matrix"),
            t(f"{b}.ffn_down_exps.weight", (x, e, ff), "residual_out"),
            t(f"{b}.ffn_up_exps.weight", (x, ff, e), "matrix"),
            t(f"{b}.ffn_gate_shexp.weight", (fs, e), "matrix"),
            t(f"{b}.ffn_down_shexp.weight", (e, fs), "residual_out"),
            t(f"{b}.ffn_up_shexp.weight", (fs, e), "matrix"),
        ]
    return plan


def write_metadata(writer: GGUFWriter, spec: Deepseek4Spec) -> None:
    """Add the key/value metadata (``general.architecture`` is added by the writer itself)."""
    a = ARCH
    n = spec.n_layer
    writer.add_string("general.name", spec.name)
    writer.add_uint32(f"{a}.context_length", spec.n_ctx_train)
    writer.add_uint32(f"{a}.embedding_length", spec.n_embd)
    writer.add_uint32(f"{a}.embedding_length_out", spec.boundary_width)
    writer.add_uint32(f"{a}.block_count", n)
    writer.add_uint32(f"{a}.vocab_size", spec.n_vocab)
    writer.add_uint32(f"{a}.attention.head_count", spec.n_head)
    writer.add_uint32(f"{a}.attention.head_count_kv", 1)
    writer.add_uint32(f"{a}.attention.key_length", spec.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", spec.head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", spec.rms_eps)
    writer.add_uint32(f"{a}.attention.q_lora_rank", spec.q_lora_rank)
    writer.add_uint32(f"{a}.attention.sliding_window", spec.n_swa)
    writer.add_uint32(f"{a}.attention.indexer.head_count", spec.indexer_n_head)
    writer.add_uint32(f"{a}.attention.indexer.key_length", spec.indexer_head_dim)
    writer.add_uint32(f"{a}.attention.indexer.top_k", spec.indexer_top_k)
    writer.add_uint32(f"{a}.attention.output_group_count", spec.o_groups)
    writer.add_uint32(f"{a}.attention.output_lora_rank", spec.o_lora_rank)
    writer.add_array(f"{a}.attention.compress_ratios", [int(c) for c in spec.compress_ratios])
    writer.add_float32(f"{a}.attention.compress_rope_freq_base", spec.compress_rope_freq_base)
    writer.add_uint32(f"{a}.rope.dimension_count", spec.n_rot)
    writer.add_float32(f"{a}.rope.freq_base", spec.rope_freq_base)
    writer.add_uint32(f"{a}.expert_count", spec.n_expert)
    writer.add_uint32(f"{a}.expert_used_count", spec.n_expert_used)
    writer.add_uint32(f"{a}.expert_feed_forward_length", spec.n_ff_exp)
    writer.add_uint32(f"{a}.expert_shared_count", spec.n_expert_shared)
    writer.add_float32(f"{a}.expert_weights_scale", spec.expert_weights_scale)
    writer.add_bool(f"{a}.expert_weights_norm", spec.expert_weights_norm)
    writer.add_uint32(f"{a}.expert_gating_func", EXPERT_GATING_SQRT_SOFTPLUS)
    writer.add_array(f"{a}.swiglu_clamp_exp", [float(spec.swiglu_limit)] * n)
    writer.add_array(f"{a}.swiglu_clamp_shexp", [float(spec.swiglu_limit)] * n)
    writer.add_uint32(f"{a}.hyper_connection.count", spec.hc_mult)
    writer.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", spec.hc_sinkhorn_iters)
    writer.add_float32(f"{a}.hyper_connection.epsilon", spec.hc_eps)
    writer.add_uint32(f"{a}.hash_layer_count", spec.hash_layer_count)
    # No token list: llama.cpp's "none" vocabulary adds vocab_size dummy tokens.
    writer.add_string("tokenizer.ggml.model", "none")


def _rng(spec: Deepseek4Spec, plan: TensorPlan) -> np.random.Generator:
    name_key = int.from_bytes(hashlib.sha256(plan.name.encode()).digest()[:8], "little")
    return np.random.default_rng([spec.seed, name_key])


def make_tensor(spec: Deepseek4Spec, plan: TensorPlan) -> npt.NDArray[np.float32 | np.int32]:
    """The values of one tensor, seeded by (fixture seed, tensor name): order-independent.

    Matrices ``N(0, 1/fan_in)``, projections back into the residual streams further divided by
    ``sqrt(2 * n_layer)``, embeddings ``N(0, 1/n_embd)``, norm weights ``1 + N(0, 0.02)``,
    hyper-connection bases and sinks ``N(0, 0.05)``, hyper-connection scales ``0.5 + N(0,
    0.05)``, expert score biases zero. The routing table gives each token ``n_expert_used``
    distinct experts.
    """
    rng = _rng(spec, plan)
    if plan.kind == "routing":
        n_vocab, k = plan.shape
        table = np.argsort(rng.random((n_vocab, spec.n_expert)), axis=1)[:, :k]
        return table.astype(np.int32)
    if plan.kind == "zero":
        return np.zeros(plan.shape, dtype=np.float32)
    values = rng.standard_normal(plan.shape, dtype=np.float32)
    fan_in = plan.shape[-1]
    if plan.kind == "norm":
        values *= np.float32(_NORM_JITTER)
        values += np.float32(1.0)
        return values
    if plan.kind == "hc_scale":
        values *= np.float32(_SMALL_STD)
        values += np.float32(0.5)
        return values
    if plan.kind == "small":
        std = _SMALL_STD
    elif plan.kind == "residual_out":
        std = fan_in**-0.5 / (2 * spec.n_layer) ** 0.5
    else:  # embedding, matrix
        std = fan_in**-0.5
    values *= np.float32(std)
    return values


def iter_tensors(
    spec: Deepseek4Spec, plans: list[TensorPlan]
) -> Iterator[tuple[TensorPlan, npt.NDArray[np.float32 | np.int32]]]:
    """Yield each planned tensor with its values, one at a time (bounded memory)."""
    for plan in plans:
        yield plan, make_tensor(spec, plan)
