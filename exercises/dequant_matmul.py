"""Exercise 11: unpacking int4 in a Triton kernel.

Your version of `dequantize_int4` in nanoserve/kernels/dequant_matmul.py, with the same signature:
write a Triton kernel in this file and launch it from `dequantize_int4`. Taught in
notebooks/07_int4_kernel.ipynb, section 3, "Unpacking int4 in a Triton kernel" (section 2 for the
layout and its golden words). Check your work with

    make exercises EX=ex11        # or: .venv/bin/pytest tests/exercises -m ex11 --impl exercises

The GPTQ v1 layout (nanoserve/quant/packing.py), for a linear with K inputs and N outputs:

    qweight int32 [K/8, N]   code of row k, column n: word qweight[k // 8, n], bits 4·(k % 8) .. 4·(k % 8) + 3
    qzeros  int32 [G, N/8]   zero point of group g, column n: word qzeros[g, n // 8], field n % 8, stored as zero − 1
    scales  float [G, N]
    g_idx   int   [K]        the group of each row k (not always k // group_size: act-order)

    W[n, k] = (code[n, k] − zero[n, g_idx[k]]) · scale[n, g_idx[k]]      returned as W [N, K]

Sub-tasks, in the order the tests check them:
  11.1  the codes: shift each word right by 4·(k % 8) and mask 0xF. A word with bit 31 set is a
        negative int32, and >> copies that sign bit into the high bits: the mask removes it.
  11.2  zero points (packed along N, plus 1) and scales, gathered through g_idx: W, bit for bit
        equal to packing.dequantize_gptq in fp32, shapes off the tile edges (masked loads and stores).
  11.3  act-order g_idx (each row of a tile looks up its own group) and the output dtype.

Triton on a machine without CUDA: kernels run in Triton's interpreter, which must be switched on
(TRITON_INTERPRET=1) before triton is first imported. The tests do that for you (tests/conftest.py);
in your own scripts set it in the environment, or `import nanoserve` first. The interpreter cannot
compute in bf16 and converts fp32 to bf16 by truncation, not rounding: for dtype=torch.bfloat16
compute fp32 and round in torch (`.to(dtype)`), as the reference does.
"""

from __future__ import annotations

import torch
import triton  # noqa: F401  (you will want them)
import triton.language as tl  # noqa: F401


def dequantize_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor,
                    *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] from GPTQ v1 4-bit tensors, computed in a Triton kernel; equal to
    nanoserve.quant.packing.dequantize_gptq(qweight, qzeros, scales, g_idx, bits=4, dtype=dtype).

    qweight int32 [K/8, N], qzeros int32 [G, N/8] (zero − 1), scales [G, N], g_idx int32/int64 [K].
    Compute (code − zero) · scale in fp32 (exact for fp16 scales), then round once to `dtype`.
    """
    raise NotImplementedError(
        "Exercise 11.1: eight 4-bit codes share a word along K, lowest bits first: a shift and a "
        "mask bring one down, even from a negative word; 11.2: each weight is (code − zero) × "
        "scale of its group, zeros stored minus one; 11.3: the group from g_idx, always. A 12-line "
        "kernel and its launch (roughly 25 lines; see notebooks/07_int4_kernel, section 3, "
        "'Unpacking int4 in a Triton kernel'; more: make hint EX=ex11 N=2)")
