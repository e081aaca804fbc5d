"""How many rows a verification pass may carry (``dgr_session.speculation.verify_rows``): every
row must keep the bits plain one-row decoding gives. Where the CPU backend repacks a weight type
(its kernels take rows four at a time), a pass keeps to 3 rows; elsewhere to 17 (16 drafts, under
the 32 rows from which sgemm takes a matmul)."""

from __future__ import annotations

import pytest

from dgr_session.speculation import MAX_DRAFTS, REPACKED_PASS_ROWS, verify_rows

X86 = "x86_64 | AMD EPYC | avx avx2 f16c fma"


@pytest.mark.parametrize(
    ("types", "hardware", "rows"),
    [
        (("F32",), X86, MAX_DRAFTS + 1),
        (("Q4_1", "Q6_K", "F32"), X86, MAX_DRAFTS + 1),  # SmolLM2: nothing repacked on x86
        (("Q4_K", "Q6_K", "F32"), X86, REPACKED_PASS_ROWS),  # Gemma 3 270M's Q4_K_M
        (("q4_0",), X86, REPACKED_PASS_ROWS),
        (("MXFP4", "F32"), X86, REPACKED_PASS_ROWS),
        (("Q6_K",), "aarch64 | neon dotprod", REPACKED_PASS_ROWS),  # repacked on ARM only
        (("Q6_K",), "", REPACKED_PASS_ROWS),  # an unknown family: any family's rule
        (("Q8_0", "F16"), X86, MAX_DRAFTS + 1),
    ],
)
def test_the_rows_of_a_pass_follow_the_weight_types_and_the_cpu(
    types: tuple[str, ...], hardware: str, rows: int
) -> None:
    assert verify_rows(types, hardware) == rows
