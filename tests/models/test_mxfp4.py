"""MXFP4 in the release layout (what the converter reads) and in ggml's blocks (what a GGUF
holds): quantizing is idempotent on the grid, the release layout round-trips, and values off the
grid are rounded, not kept."""

from __future__ import annotations

import numpy as np
import pytest

from dgr_engine.baseline import mxfp4

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)


def test_values_on_the_grid_go_through_unchanged() -> None:
    rng = np.random.default_rng(7)
    w = rng.standard_normal((48, 96)).astype(np.float32) * 0.2
    grid = mxfp4.to_grid(w)
    assert not np.array_equal(grid, w)  # random floats are not on the grid
    assert np.array_equal(mxfp4.to_grid(grid), grid)
    weight, scale = mxfp4.to_release(grid)
    assert weight.shape == (48, 48) and scale.shape == (48, 3)
    assert weight.dtype == scale.dtype == np.uint8
    assert np.array_equal(mxfp4.from_release(weight, scale), grid)
    # every value is an E2M1 magnitude times its block's power of two
    blocks = np.abs(grid).reshape(48, 3, 32) / np.exp2(scale.astype(np.float64) - 127)[..., None]
    assert np.isin(blocks, E2M1).all()


def test_the_release_layout_puts_element_2i_in_the_low_nibble() -> None:
    row = np.zeros((1, 32), np.float32)
    row[0, 0], row[0, 1] = 1.0, -6.0  # codes 2 and 8 + 7 = 15 with scale 2^0
    weight, scale = mxfp4.to_release(row)
    assert int(scale[0, 0]) == 127
    assert int(weight[0, 0]) == 2 | (15 << 4)


def test_rows_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.to_release(np.zeros((2, 48), np.float32))
