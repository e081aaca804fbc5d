"""MXFP4 weights in the two layouts a DeepSeek V4 passes through on its way to a GGUF.

An MXFP4 block is 32 values sharing one E8M0 scale (a biased power of two, ``2^(byte - 127)``),
each value one E2M1 code (sign, then an index into 0, 0.5, 1, 1.5, 2, 3, 4, 6). The arithmetic is
the ``gguf`` package's (``gguf.quants.MXFP4``, llama.cpp's reference quantizer: the scale is
``2^(floor(log2 max|x|) - 2)``, each value the nearest code, ties to the smaller magnitude).

* The **release layout** is what DeepSeek ships and what llama.cpp's converter reads for routed
  experts: ``weight`` uint8 ``[rows, cols / 2]`` (element ``2i`` in the low nibble, ``2i + 1`` in
  the high one) and ``scale`` uint8 ``[rows, cols / 32]`` (the E8M0 bytes).
* **ggml's blocks** are what a GGUF holds: per block the scale byte, then 16 bytes where byte
  ``j`` holds element ``j`` (low nibble) and ``j + 16`` (high nibble). The converter moves the
  bits from one layout to the other and changes no value.

Quantizing is idempotent on values already on the MXFP4 grid (each block's largest magnitude
picks the same power of two back), so weights drawn on the grid go through unchanged.
"""

from __future__ import annotations

import os
from typing import Final

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

BLOCK: Final = 32
"""Values per MXFP4 block (one shared scale)."""
_BLOCK_BYTES: Final = 1 + BLOCK // 2

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


def _check_rows(values: np.ndarray) -> None:
    if values.ndim < 1 or values.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 rows need a multiple of {BLOCK} values; got shape {values.shape}")


def to_grid(values: np.ndarray) -> F32:
    """``values`` (float, rows along the last axis) rounded onto the MXFP4 grid, as float32."""
    _check_rows(values)
    blocks = quantize(np.asarray(values, dtype=np.float32), GGMLQuantizationType.MXFP4)
    return expand(blocks)


def expand(blocks: np.ndarray) -> F32:
    """ggml MXFP4 blocks (uint8, ``[..., rows, cols / 32 * 17]``) as float32 ``[..., rows,
    cols]``: exact (every MXFP4 value is a float32)."""
    return np.asarray(dequantize(np.asarray(blocks, dtype=np.uint8), GGMLQuantizationType.MXFP4))


def to_release(values: np.ndarray) -> tuple[U8, U8]:
    """``values`` (float ``[rows, cols]``) quantized to MXFP4 in the release layout: ``(weight,
    scale)``."""
    _check_rows(values)
    blocks = quantize(np.asarray(values, dtype=np.float32), GGMLQuantizationType.MXFP4)
    rows, n_blocks = blocks.shape[0], blocks.shape[-1] // _BLOCK_BYTES
    blocks = blocks.reshape(rows, n_blocks, _BLOCK_BYTES)
    scale = np.ascontiguousarray(blocks[:, :, 0])
    qs = blocks[:, :, 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, blocks, 32] in element order
    codes = codes.reshape(rows, n_blocks * BLOCK)
    weight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return weight, scale.astype(np.uint8)


def from_release(weight: np.ndarray, scale: np.ndarray) -> F32:
    """The float32 values of release-layout MXFP4 ``(weight, scale)`` (the inverse of
    :func:`to_release` on grid values)."""
    w = np.asarray(weight, dtype=np.uint8)
    s = np.asarray(scale, dtype=np.uint8)
    rows, cols = w.shape[0], w.shape[1] * 2
    if s.shape != (rows, cols // BLOCK):
        raise ValueError(f"MXFP4 scale shape {s.shape} does not match weight shape {w.shape}")
    codes = np.stack([w & 0x0F, w >> 4], axis=-1).reshape(rows, cols // BLOCK, BLOCK)
    qs = codes[:, :, : BLOCK // 2] | (codes[:, :, BLOCK // 2 :] << 4)
    blocks = np.concatenate([s[:, :, None], qs], axis=-1).reshape(rows, -1)
    return expand(blocks)


def float_tensors(gguf: str | os.PathLike[str]) -> dict[str, F32]:
    """Every MXFP4 tensor of the GGUF ``gguf``, by name, as float32 (numpy shape)."""
    reader = GGUFReader(gguf)
    return {
        t.name: expand(t.data)
        for t in reader.tensors
        if t.tensor_type == GGMLQuantizationType.MXFP4
    }
