"""Reading a W4A16 weight tile inside a Triton kernel: the two ways kernels/dequant_matmul.py uses.

The GPTQ v1 layout (nanoserve/quant/packing.py): qweight int32 [K/8, N] (8 codes per word, packed
along K), qzeros int32 [G, N/8] (zero − 1), scales [G, N], g_idx [K]; W[k, n] = (code −
zero[g_idx[k]]) · scale[g_idx[k]].

- **Grouped** (`grouped_codes`), for g_idx = k // group_size (RTN, AWQ, most GPTQ checkpoints): a
  tile of BLOCK_K rows lies in one group when BLOCK_K divides group_size. Each word is loaded once
  ([BLOCK_K/8, BLOCK_N]) and its 8 codes are shifted out along a new axis; one zero row and one
  scale row serve the tile, and the scale multiplies the dot's result rather than every weight.
- **Gathered** (`dequant_tile`), for any g_idx (act-order: neighbouring rows in different groups):
  row k loads the word k // 8 (each word 8 times: the cache serves the repeats), and its zero and
  scale are gathered row by row through g_idx. One scale row per tile would be wrong there (the
  tests' negative control shows how wrong).

`dot_tile` is a [BLOCK_M, BLOCK_K] activation tile times the weight tile, read either way
(GROUP_SIZE > 0: grouped). The gathered read is much the slower of the two (an H100 GEMV:
benchmarks/RESULTS.md). With FMA, the product is multiply-adds on the CUDA cores instead of
`tl.dot`, which needs at least 16 rows on a GPU: a GEMV of 1 or 2 rows then computes only its own
rows rather than 16, and the weight tile goes from its load to the multiply-adds in registers,
without the trip through shared memory the tensor cores' layout takes (`fma_dot`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dequant_tile(QW, QZ, S, G_IDX, offs_k, offs_n, k_mask, n_mask,
                  stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn):
    """W[offs_k, offs_n] in fp32 from the GPTQ v1 tensors; 0 outside the masks."""
    mask = k_mask[:, None] & n_mask[None, :]  # BLOCK_K, BLOCK_N
    g = tl.load(G_IDX + offs_k, mask=k_mask, other=0)  # BLOCK_K   group of each row
    words = tl.load(QW + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                    mask=mask, other=0)  # BLOCK_K, BLOCK_N   the word holding each code
    codes = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF  # >> sign-extends; the mask drops it
    zwords = tl.load(QZ + g[:, None] * stride_zg + (offs_n // 8)[None, :] * stride_zn,
                     mask=mask, other=0)  # BLOCK_K, BLOCK_N
    zeros = ((zwords >> ((offs_n % 8) * 4)[None, :]) & 0xF) + 1  # v1 stores zero − 1
    scales = tl.load(S + g[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                     # BLOCK_K, BLOCK_N   0 outside: w = 0 there
                     mask=mask, other=0.0).to(tl.float32)
    return (codes - zeros).to(tl.float32) * scales


@triton.jit
def grouped_codes(QW, QZ, S, start, offs_n, n_mask, K,
                   stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
                   BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """(code − zero) [BLOCK_K, BLOCK_N] as integers and the tile's scale row [BLOCK_N], for rows
    start .. start + BLOCK_K that all lie in group start // GROUP_SIZE (no act-order; BLOCK_K
    divides GROUP_SIZE).

    Each word is loaded once, [BLOCK_K / 8, BLOCK_N], and its 8 codes are shifted out along a new
    middle
    axis: [BLOCK_K / 8, 8, BLOCK_N], whose rows, read in order, are k = 8 · word + nibble. One zero
    row and one scale row serve the whole tile, so W = (code − zero) · scale leaves the scale for
    after the dot."""
    offs_w = start // 8 + tl.arange(0, BLOCK_K // 8)  # BLOCK_K / 8   words along K
    words = tl.load(QW + offs_w[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                    # BLOCK_K / 8, BLOCK_N
                    mask=(offs_w < K // 8)[:, None] & n_mask[None, :], other=0)
    shifts = tl.arange(0, 8) * 4  # 8
    codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # BLOCK_K / 8, 8, BLOCK_N
    # BLOCK_K, BLOCK_N   row 8·w + j: word w, nibble j
    codes = tl.reshape(codes, (BLOCK_K, BLOCK_N))
    g = start // GROUP_SIZE
    # BLOCK_N
    zwords = tl.load(QZ + g * stride_zg + (offs_n // 8) * stride_zn, mask=n_mask, other=0)
    zeros = ((zwords >> ((offs_n % 8) * 4)) & 0xF) + 1  # v1 stores zero − 1
    # BLOCK_N
    scales = tl.load(S + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
    return codes - zeros[None, :], scales


@triton.jit
def fma_dot(a, w):
    """a [BLOCK_M, BLOCK_K] · w [BLOCK_K, BLOCK_N] in fp32 as multiply-adds (no tensor cores): each
    row of a times w, summed over K. For a few rows only: the product is [BLOCK_M, BLOCK_K,
    BLOCK_N] before the sum."""
    return tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def dot_tile(a, QW, QZ, S, G_IDX, start, offs_k, offs_n, k_mask, n_mask, K,
              stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
              BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
              FMA: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] · W[offs_k, offs_n] in fp32, W read one of the two ways above; FMA:
    by multiply-adds (`fma_dot`) instead of tl.dot."""
    if GROUP_SIZE > 0:  # one group per tile: integer codes into the dot, the scale after it
        # [BK, BN], [BN]
        q, scale = grouped_codes(QW, QZ, S, start, offs_n, n_mask, K, stride_qk, stride_qn,
                                 stride_zg, stride_zn, stride_sg, stride_sn, BLOCK_K, BLOCK_N,
                                 GROUP_SIZE)
        if FMA:
            out = fma_dot(a, q) * scale[None, :]  # BLOCK_M, BLOCK_N
        else:
            out = tl.dot(a, q.to(a.dtype), input_precision="ieee") * scale[None, :]
    else:  # any g_idx (act-order): zero and scale gathered row by row
        w = dequant_tile(QW, QZ, S, G_IDX, offs_k, offs_n, k_mask, n_mask,
                          # BLOCK_K, BLOCK_N
                          stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn)
        if FMA:
            out = fma_dot(a, w)  # BLOCK_M, BLOCK_N
        else:
            out = tl.dot(a, w.to(a.dtype), input_precision="ieee")
    return out
