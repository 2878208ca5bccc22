"""Exercise 20: dequantize llama.cpp's Q4_K, a super-block of 256 weights, by hand.

Your versions of nanoserve/quant/ggml_blocks.py's `k4_scales_mins`, `four_bit_chunks` and
`dequantize_q4_k`, with the same names and signatures. Taught in notebooks/17_gguf.ipynb,
section 3 ("K-quants: scales of scales"). Check your work with

    make exercises EX=ex20        # or: .venv/bin/pytest tests/exercises -m ex20 --impl exercises

A Q4_K block is 144 bytes for 256 weights, eight sub-blocks of 32:

    bytes 0-1    d      float16, the scale of the sub-block scales
    bytes 2-3    dmin   float16, the scale of the sub-block mins
    bytes 4-15   eight 6-bit scales and eight 6-bit mins, packed into 12 bytes:
                 byte k     (k = 0..3)  low 6 bits: scale k;  top 2 bits: bits 4-5 of scale k + 4
                 byte 4 + k             low 6 bits: min k;    top 2 bits: bits 4-5 of min k + 4
                 byte 8 + k             low nibble: bits 0-3 of scale k + 4;
                                        high nibble: bits 0-3 of min k + 4
    bytes 16-143 the 4-bit codes, four chunks of 32 bytes: byte l of chunk j holds weight
                 64·j + l in its low nibble and weight 64·j + 32 + l in its high one

and weight i, in sub-block s = i // 32, is  w = (d·scale_s)·q_i − (dmin·min_s), with both
products taken in float32 before the subtraction (as llama.cpp does: then your result equals
the `gguf` package's bit for bit). Shapes: n blocks.
"""

from __future__ import annotations

import torch  # noqa: F401  (you will want it)

from nanoserve.quant.ggml_blocks import QK_K, _f16  # noqa: F401  (given: 256; the float16 at a byte)


# ----------------------------------------------------------------------------- exercise 20
def k4_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and eight 6-bit mins of each block. packed: uint8 [n, 12] (bytes 4-15
    of a block) → (scales, mins), each float32 [n, 8] holding integers 0..63."""
    raise NotImplementedError(
        "Exercise 20.1: the first four sub-blocks keep their scale and min whole in six bits of a "
        "byte; the last four are split, a nibble in the last four bytes and their top two bits in "
        "the spare bits of the first eight (roughly 6 lines; see notebooks/17_gguf, section 3, "
        "'K-quants: scales of scales'; more: make hint EX=ex20 N=2)")


def four_bit_chunks(qs: torch.Tensor) -> torch.Tensor:
    """The 256 codes of each block in weight order. qs: uint8 [n, 128] (bytes 16-143 of a block)
    → uint8 [n, 256], values 0..15."""
    raise NotImplementedError(
        "Exercise 20.2: each 32-byte chunk holds 64 weights, the first 32 in its low nibbles and "
        "the next 32 in its high ones, not neighbours side by side (roughly 4 lines; see "
        "notebooks/17_gguf, section 3, 'K-quants: scales of scales'; more: make hint EX=ex20 N=2)")


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks uint8 [n, 144] → the weights, float32 [n, 256]."""
    raise NotImplementedError(
        "Exercise 20.3: the two float16 scales of scales times the sub-block's integer scale and "
        "min give each sub-block a step and an offset; a weight is its code times the step, less "
        "the offset (roughly 5 lines; see notebooks/17_gguf, section 3, 'K-quants: scales of "
        "scales'; more: make hint EX=ex20 N=2)")
