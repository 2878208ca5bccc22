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

**The MMA layout** (Marlin's idea: codes reordered once, at load, for the kernel that reads
them). Shifting a word's 8 codes out along a new axis and reshaping them into K rows
(`grouped_codes`) puts a tile's codes in a layout of the compiler's choosing; tl.dot then wants the
tensor cores' operand layout, and the compiler moves the dequantized fp16 tile there through
shared memory, every tile (a `local_alloc` of [BLOCK_K, BLOCK_N] fp16 in the TTGIR). Reordered so
that, in each tile of MMA_TILE_K = 128 rows, word r holds rows r, 16 + r, 32 + r, ..., 112 + r
(nibble j: row 16·j + r), shift j of the tile's 16 words is rows 16·j .. 16·j + 15 in order: an
elementwise op on the loaded words, so a tile is 8 products of 16 rows each (`mma_tile_dot`), and
the compiler loads the packed words from shared memory straight into the operand layout and
unpacks them there (no fp16 tile through shared memory: benchmarks/kernels_compile.json).
`to_mma_layout` / `from_mma_layout` reorder a GPTQ qweight (torch, on any device); every read of
codes takes `MMA` (`code_address`), so the other paths read the reordered words too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MMA_TILE_K = 128  # rows per tile of the MMA layout: 16 words, 8 codes each


# ----------------------------------------------------------------------------- the MMA layout
def mma_row_order(K: int, device=None) -> torch.Tensor:
    """order [K]: the row of W whose code the MMA layout keeps at GPTQ position p (word p // 8,
    nibble p % 8): in each tile of 128 rows, position 8·r + j holds row 16·j + r."""
    p = torch.arange(K, device=device)
    tile, within = p // MMA_TILE_K, p % MMA_TILE_K
    word, nibble = within // 8, within % 8
    return tile * MMA_TILE_K + nibble * 16 + word


def _codes(qweight: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes [K, N] of words [K/8, N] (nibble j of word w: row 8·w + j)."""
    shifts = torch.arange(0, 32, 4, device=qweight.device)
    codes = (qweight.long()[:, None, :] >> shifts[None, :, None]) & 0xF  # K/8, 8, N
    return codes.reshape(-1, qweight.shape[1])


def _words(codes: torch.Tensor) -> torch.Tensor:
    """Codes [K, N] packed 8 to an int32 word along K (the inverse of `_codes`)."""
    shifts = torch.arange(0, 32, 4, device=codes.device)
    words = (codes.reshape(-1, 8, codes.shape[1]) << shifts[None, :, None]).sum(1)  # < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _check_mma_k(qweight: torch.Tensor) -> None:
    K = qweight.shape[0] * 8
    if K % MMA_TILE_K:
        raise ValueError(f"the MMA layout reorders tiles of {MMA_TILE_K} rows; K={K} is not a "
                         "multiple of it")


def to_mma_layout(qweight: torch.Tensor) -> torch.Tensor:
    """A GPTQ qweight [K/8, N] (K a multiple of 128) reordered into the MMA layout."""
    _check_mma_k(qweight)
    codes = _codes(qweight)
    return _words(codes[mma_row_order(codes.shape[0], qweight.device)])


def from_mma_layout(qweight: torch.Tensor) -> torch.Tensor:
    """The GPTQ qweight of an MMA-layout one (`to_mma_layout`'s inverse)."""
    _check_mma_k(qweight)
    codes = torch.empty_like(_codes(qweight))
    codes[mma_row_order(codes.shape[0], qweight.device)] = _codes(qweight)
    return _words(codes)


# ----------------------------------------------------------------------------- reading tiles
@triton.jit
def code_address(offs_k, MMA: tl.constexpr):
    """(word row of qweight, bit shift) of the codes of rows offs_k: GPTQ's (k // 8, 4 · (k % 8)),
    or the MMA layout's (16 words a tile of 128 rows; row 16·j + r in word r, nibble j)."""
    if MMA:
        within = offs_k % 128
        word = (offs_k // 128) * 16 + within % 16
        shift = (within // 16) * 4
    else:
        word = offs_k // 8
        shift = (offs_k % 8) * 4
    return word, shift


@triton.jit
def dequant_tile(QW, QZ, S, G_IDX, offs_k, offs_n, k_mask, n_mask,
                  stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
                  MMA: tl.constexpr):
    """W[offs_k, offs_n] in fp32 from the GPTQ v1 tensors (MMA: codes in the MMA layout); 0
    outside the masks."""
    mask = k_mask[:, None] & n_mask[None, :]  # BLOCK_K, BLOCK_N
    g = tl.load(G_IDX + offs_k, mask=k_mask, other=0)  # BLOCK_K   group of each row
    word, shift = code_address(offs_k, MMA)  # BLOCK_K each
    words = tl.load(QW + word[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                    mask=mask, other=0)  # BLOCK_K, BLOCK_N   the word holding each code
    codes = (words >> shift[:, None]) & 0xF  # >> sign-extends; the mask drops it
    zwords = tl.load(QZ + g[:, None] * stride_zg + (offs_n // 8)[None, :] * stride_zn,
                     mask=mask, other=0)  # BLOCK_K, BLOCK_N
    zeros = ((zwords >> ((offs_n % 8) * 4)[None, :]) & 0xF) + 1  # v1 stores zero − 1
    scales = tl.load(S + g[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                     # BLOCK_K, BLOCK_N   0 outside: w = 0 there
                     mask=mask, other=0.0).to(tl.float32)
    return (codes - zeros).to(tl.float32) * scales


@triton.jit
def group_row(QZ, S, g, offs_n, n_mask, stride_zg, stride_zn, stride_sg, stride_sn):
    """Group g's zero points (integers) and scales (fp32), [BLOCK_N] each."""
    zwords = tl.load(QZ + g * stride_zg + (offs_n // 8) * stride_zn, mask=n_mask, other=0)
    zeros = ((zwords >> ((offs_n % 8) * 4)) & 0xF) + 1  # v1 stores zero − 1
    scales = tl.load(S + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)
    return zeros, scales


@triton.jit
def grouped_codes(QW, QZ, S, start, offs_n, n_mask, K,
                   stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
                   BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
                   MMA: tl.constexpr):
    """(code − zero) [BLOCK_K, BLOCK_N] as integers and the tile's scale row [BLOCK_N], for rows
    start .. start + BLOCK_K that all lie in group start // GROUP_SIZE (no act-order; BLOCK_K
    divides GROUP_SIZE).

    GPTQ order: each word is loaded once, [BLOCK_K / 8, BLOCK_N], and its 8 codes are shifted out
    along a new middle axis: [BLOCK_K / 8, 8, BLOCK_N], whose rows, read in order, are k = 8 · word
    + nibble. (MMA layout: each row's word and shift, `code_address`.) One zero row and one scale
    row serve the whole tile, so W = (code − zero) · scale leaves the scale for after the dot."""
    if MMA:
        offs_k = start + tl.arange(0, BLOCK_K)  # BLOCK_K
        word, shift = code_address(offs_k, MMA)
        words = tl.load(QW + word[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                        mask=(offs_k < K)[:, None] & n_mask[None, :], other=0)  # BK, BN
        codes = (words >> shift[:, None]) & 0xF  # BLOCK_K, BLOCK_N
    else:
        offs_w = start // 8 + tl.arange(0, BLOCK_K // 8)  # BLOCK_K / 8   words along K
        words = tl.load(QW + offs_w[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                        # BLOCK_K / 8, BLOCK_N
                        mask=(offs_w < K // 8)[:, None] & n_mask[None, :], other=0)
        shifts = tl.arange(0, 8) * 4  # 8
        codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # BLOCK_K / 8, 8, BLOCK_N
        # BLOCK_K, BLOCK_N   row 8·w + j: word w, nibble j
        codes = tl.reshape(codes, (BLOCK_K, BLOCK_N))
    zeros, scales = group_row(QZ, S, start // GROUP_SIZE, offs_n, n_mask, stride_zg, stride_zn,
                              stride_sg, stride_sn)  # BLOCK_N each
    return codes - zeros[None, :], scales


@triton.jit
def mma_tile_dot(A, offs_m, m_mask, start, stride_am, stride_ak, QW, QZ, S, offs_n, n_mask,
                 stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
                 UPCAST: tl.constexpr, FMA: tl.constexpr):
    """A[offs_m, start .. start + 128] · W[start .. start + 128, offs_n] in fp32, W in the MMA
    layout, one group (GROUP_SIZE a multiple of 128): the tile's 16 words loaded once, shift j of
    them (rows 16·j ..) times the 16 columns of A they meet, 8 products; the scale after them. A
    is loaded here, 16 columns at a time (k beyond K: the caller's tiles are whole)."""
    offs_r = tl.arange(0, 16)  # 16   words of the tile
    words = tl.load(QW + (start // 8 + offs_r)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                    mask=n_mask[None, :], other=0)  # 16, BLOCK_N
    zeros, scales = group_row(QZ, S, start // GROUP_SIZE, offs_n, n_mask, stride_zg, stride_zn,
                              stride_sg, stride_sn)  # BLOCK_N each
    part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(8):
        q = ((words >> (4 * j)) & 0xF) - zeros[None, :]  # 16, BLOCK_N   rows start + 16·j ..
        offs_k = start + 16 * j + offs_r  # 16
        a = tl.load(A + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=m_mask[:, None], other=0.0)  # BLOCK_M, 16
        if UPCAST:
            a = a.to(tl.float32)
        if FMA:
            part += fma_dot(a, q)
        else:
            part += tl.dot(a, q.to(a.dtype), input_precision="ieee")
    return part * scales[None, :]


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
              FMA: tl.constexpr, MMA: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] · W[offs_k, offs_n] in fp32, W read one of the two ways above (MMA:
    its codes in the MMA layout); FMA: by multiply-adds (`fma_dot`) instead of tl.dot."""
    if GROUP_SIZE > 0:  # one group per tile: integer codes into the dot, the scale after it
        # [BK, BN], [BN]
        q, scale = grouped_codes(QW, QZ, S, start, offs_n, n_mask, K, stride_qk, stride_qn,
                                 stride_zg, stride_zn, stride_sg, stride_sn, BLOCK_K, BLOCK_N,
                                 GROUP_SIZE, MMA)
        if FMA:
            out = fma_dot(a, q) * scale[None, :]  # BLOCK_M, BLOCK_N
        else:
            out = tl.dot(a, q.to(a.dtype), input_precision="ieee") * scale[None, :]
    else:  # any g_idx (act-order): zero and scale gathered row by row
        w = dequant_tile(QW, QZ, S, G_IDX, offs_k, offs_n, k_mask, n_mask,
                          # BLOCK_K, BLOCK_N
                          stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn, MMA)
        if FMA:
            out = fma_dot(a, w)  # BLOCK_M, BLOCK_N
        else:
            out = tl.dot(a, w.to(a.dtype), input_precision="ieee")
    return out
