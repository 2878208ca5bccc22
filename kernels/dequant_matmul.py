"""W4A16 dequant-matmul: C = A · W for a GPTQ v1 4-bit weight, dequantized inside the kernel.

**The layout** (nanoserve/quant/packing.py). A linear with in-features K and out-features N
stores W [K, N] (here as the matmul's right operand, K rows) in four tensors:

    qweight int32 [K/8, N]   8 codes per word, packed along K: code of row k in word k // 8, bits
                             4·(k % 8) ..
    qzeros  int32 [G, N/8]   8 zero points per word, packed along N, each stored as zero − 1 (v1)
    scales  fp16  [G, N]
    g_idx   int [K] group of each row: k // group_size, or a permutation of that (act-order)

    W[k, n] = (code[k, n] − zero[g_idx[k], n]) · scale[g_idx[k], n]

**Two ways to read a tile** (kernels/int4_tiles.py): grouped, one zero / scale row per tile, when
g_idx = k // group_size (`group_size=`, which QuantLinear passes when it holds); gathered row by row
for act-order. Gathering costs a load per row instead of one per tile: on an H100 the gathered
GEMV was an order of magnitude slower than the grouped one (benchmarks/RESULTS.md).

**Why fuse, and why batch 1 gains most.** At batch 1 a linear does 2 flops per weight it reads:
far below what a GPU can compute per byte, so its time is the time to read the weights. fp16
weights are 2 bytes each; 4-bit codes plus an fp16 scale and a zero per group of 128 are
0.5 + 2.5/128 ≈ 0.52 bytes, so reading them is ~3.8× faster. That holds only if W is never
written out in fp16: dequantize-then-matmul reads 0.52 bytes, writes 2 and reads those 2 back,
slower than plain fp16. The fused kernel turns codes into fp16/fp32 values in registers, right
before they meet A, and W exists nowhere in memory.

**Large M: the torch fallback.** As M grows each weight serves more rows of A and the matmul
becomes compute-bound, so on CUDA `dequant_matmul` hands M ≥ TORCH_MIN_M (64) to
`dequantize_int4` + torch.matmul. Every call then first writes an fp16 W: by a roofline
estimate for an H100 ~2× an fp16 layer at M = 64, ~1.1× at M = 4096; the H100 measurement agrees
(benchmarks/RESULTS.md). The tiled GEMM kernel was measured only on its act-order (gather) path
there; its grouped path, and so the threshold, are still to be timed against this fallback.

**Two kernels.**
- `_dequant_gemm_kernel`, for M > 16: the textbook tiled GEMM. One program per
  [BLOCK_M, BLOCK_N] tile of C; it walks K in BLOCK_K steps, dequantizes the weight tile and
  accumulates tl.dot(a, w) in fp32. Each weight tile is dequantized once per BLOCK_M rows.
- `_dequant_gemv_kernel`, for M ≤ 16 (decode): all M rows in one tile (M padded to 16, the
  smallest tl.dot a GPU accepts), so the grid has only N / BLOCK_N programs: 64 for N = 4096, too
  few to keep 132 SMs reading memory. For M ≤ FMA_MAX_M = 2 (batch-1 decode) the rows are
  multiply-adds instead (`FMA`, int4_tiles.fma_dot): BLOCK_M = M, no padding, and the weight tile
  stays in registers (2-4 KB of shared memory where tl.dot's layout takes 29-51 KB); at M = 4 they
  would take 252 registers on sm_90 (benchmarks/kernels_compile.json). **Split-K** cuts K into
  `split_k` ranges of whole BLOCK_K tiles, grid (N / BLOCK_N, split_k); split s writes its partial
  sum to row s of an fp32 buffer [split_k, M, N]. Then, in the same launch, the split of a column
  tile that finishes last sums that tile's partials in a fixed order (split 0, 1, ...) and writes
  C in A's dtype: each split counts itself in with an atomic add on a counter per column tile
  (release: its partial is stored; acquire: the others' are visible), and the one that finds the
  count complete reduces and resets the counter to 0 for the next launch. Not tl.atomic_add on C
  itself: atomics add in whatever order programs finish, so results would change in the last bits
  from run to run. (It
  was two more launches, torch's sum and the cast; the counters are one int32 per tile, kept per
  device, so launches on one stream share them safely, launches on two streams at once would not.)
  The buffer's traffic (128 KiB for M = 1, N = 4096, split_k = 8, beside 8 MiB of weights) is
  small. With split_k = 1 the kernel writes C directly; an empty split writes zeros.
  `choose_split_k` says how many fill a GPU.

A third, `dequantize_int4`, writes W [N, K] out (packing.dequantize_gptq's layout and values) in
one pass with the same `dequant_tile`: the dequantize step of "dequantize + cuBLAS" for large M
(`dequantize_int4_mma` for codes in the MMA layout).

**The MMA layout** (`mma_layout=True`, kernels/int4_tiles.py): the codes reordered once at load so
that a GEMV tile of 128 rows is 8 products of 16 rows, each an elementwise shift of the same 16
loaded words (`mma_tile_dot`); the tensor-core path then needs no trip of the dequantized tile
through shared memory. Every kernel reads it (the others through `code_address`); the GEMV takes
its own rows of configs.DEQUANT ("gemv_mma", "gemv_mma_fma").

**Precision.** Accumulation is fp32. The interpreter cannot do bf16 arithmetic, so there tiles
become fp32 right after their load (`UPCAST`), and so on sm_75, whose tl.dot is FMA anyway. On
sm_80+ the weight tile is cast to A's dtype for the tensor cores: gathered, the dequantized values
(rounded, as the torch fallback does); grouped, code − zero (exact: |·| ≤ 15). fp32 inputs use IEEE
fp32 (not TF32). Tiles: kernels/configs.py. `dequant_matmul_ref` is the plain-torch
reference. Taught in notebooks/07_int4_kernel.ipynb (exercise 11: `dequantize_int4`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.quant.packing import check_gptq, dequantize_gptq

from .checks import DTYPES, can_read_values, check_dequant_matmul, check_mma_layout
from .configs import DEQUANT, INTERPRETER, pick
from .int4_tiles import dequant_tile, dot_tile, mma_tile_dot

GEMV_MAX_M = 16  # M ≤ this: split-K GEMV (all rows in one tile of 16)
FMA_MAX_M = 2  # M ≤ this: the GEMV's rows by multiply-adds (BLOCK_M = M); M = 4: 252 registers
TORCH_MIN_M = 64  # on CUDA, M ≥ this: dequantize + torch.matmul
MIN_TILES_PER_SPLIT = 4  # choose_split_k: a split must have work enough to pay for the second pass
MAX_SPLIT_K = 16
# (BLOCK_M, BLOCK_N, BLOCK_K) of the GEMV in the interpreter and on a GPU (every GPU row of
# configs.DEQUANT): choose_split_k counts tiles of the GPU's
_GEMV_TILES = {False: INTERPRETER["gemv"].tiles, True: DEQUANT[("gemv", 80, 2)].tiles}


# ----------------------------------------------------------------------------- the reference
def dequant_matmul_ref(a: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                       scales: torch.Tensor,
                       g_idx: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Plain torch: W = dequantize_gptq(...) [N, K] in fp32, C = A · Wᵀ in fp32, cast to A's
    dtype."""
    w = dequantize_gptq(qweight, qzeros, scales, g_idx, bits)  # N, K
    return (a.float() @ w.t()).to(a.dtype)  # M, N


# ----------------------------------------------------------------------------- the kernels
@triton.jit
def _dequant_gemm_kernel(
    A, QW, QZ, S, G_IDX, C,
    M, N, K,
    stride_am, stride_ak, stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, GROUP_SIZE: tl.constexpr, MMA: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # BLOCK_M
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N
    m_mask, n_mask = offs_m < M, offs_n < N
    rows = offs_m.to(tl.int64)  # M · K may pass 2^31
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        if MMA and GROUP_SIZE > 0 and BLOCK_K == 128:  # a tile of the MMA layout: 8 products
            acc += mma_tile_dot(A, rows, m_mask, start, stride_am, stride_ak, QW, QZ, S, offs_n,
                                n_mask, stride_qk, stride_qn, stride_zg, stride_zn, stride_sg,
                                stride_sn, BLOCK_M, BLOCK_N, GROUP_SIZE, UPCAST, False)
        else:
            offs_k = start + tl.arange(0, BLOCK_K)  # BLOCK_K
            k_mask = offs_k < K
            a = tl.load(A + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # BLOCK_M, BLOCK_K
            if UPCAST:
                a = a.to(tl.float32)
            # BLOCK_M, BLOCK_N
            acc += dot_tile(a, QW, QZ, S, G_IDX, start, offs_k, offs_n, k_mask, n_mask, K,
                            stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
                            BLOCK_K, BLOCK_N, GROUP_SIZE, False, MMA)  # M > 16: tensor cores
    c_ptrs = C + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequant_gemv_kernel(
    A, QW, QZ, S, G_IDX, P, C, Counts,
    M, N, K, k_per_split,
    stride_am, stride_ak, stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
    stride_ps, stride_pm, stride_pn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, GROUP_SIZE: tl.constexpr, REDUCE: tl.constexpr, FMA: tl.constexpr,
    MMA: tl.constexpr,
):
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)  # BLOCK_M   every row of A (M ≤ BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N
    m_mask, n_mask = offs_m < M, offs_n < N
    lo = split * k_per_split  # k_per_split: whole BLOCK_K tiles
    hi = tl.minimum(lo + k_per_split, K)  # lo ≥ hi: an empty split, which writes zeros
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_K):
        if MMA and GROUP_SIZE > 0 and BLOCK_K == 128:  # a tile of the MMA layout: 8 products
            acc += mma_tile_dot(A, offs_m, m_mask, start, stride_am, stride_ak, QW, QZ, S, offs_n,
                                n_mask, stride_qk, stride_qn, stride_zg, stride_zn, stride_sg,
                                stride_sn, BLOCK_M, BLOCK_N, GROUP_SIZE, UPCAST, FMA)
        else:
            offs_k = start + tl.arange(0, BLOCK_K)  # BLOCK_K
            k_mask = offs_k < hi
            a = tl.load(A + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # BLOCK_M, BLOCK_K
            if UPCAST:
                a = a.to(tl.float32)
            # BLOCK_M, BLOCK_N
            acc += dot_tile(a, QW, QZ, S, G_IDX, start, offs_k, offs_n, k_mask, n_mask, K,
                            stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
                            BLOCK_K, BLOCK_N, GROUP_SIZE, FMA, MMA)
    p_ptrs = P + split * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :] * stride_pn
    tl.store(p_ptrs, acc.to(P.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    if REDUCE:  # the tile's last split to finish sums every partial, in split order (above)
        tl.debug_barrier()  # every thread's part of the partial stored before it is counted
        tile = tl.program_id(0)
        arrived = tl.atomic_add(Counts + tile, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:
            reduce_splits(P, C, offs_m, offs_n, m_mask, n_mask, stride_ps, stride_pm, stride_pn,
                           stride_cm, stride_cn, BLOCK_M, BLOCK_N)
            tl.atomic_xchg(Counts + tile, 0)  # ready for the next launch


@triton.jit
def reduce_splits(P, C, offs_m, offs_n, m_mask, n_mask, stride_ps, stride_pm, stride_pn,
                   stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """C's tile = the sum of the splits' partials, split 0 first (a fixed order)."""
    mask = m_mask[:, None] & n_mask[None, :]
    at = offs_m[:, None] * stride_pm + offs_n[None, :] * stride_pn
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(0, tl.num_programs(1)):
        total += tl.load(P + s * stride_ps + at, mask=mask, other=0.0)
    c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, total.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(
    QW, QZ, S, G_IDX, W,
    N, K,
    stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn, stride_wn, stride_wk,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, MMA: tl.constexpr,
):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)  # BLOCK_K   input rows of W's tile
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N   output columns
    k_mask, n_mask = offs_k < K, offs_n < N
    w = dequant_tile(QW, QZ, S, G_IDX, offs_k, offs_n, k_mask, n_mask,
                      # BLOCK_K, BLOCK_N
                      stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn, MMA)
    # W is [N, K] (nn.Linear's layout): the [K, N] tile is stored transposed, through the strides
    # BLOCK_K, BLOCK_N
    w_ptrs = W + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    tl.store(w_ptrs, w.to(W.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


# ----------------------------------------------------------------------------- the wrappers
def dequant_matmul(a: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                   scales: torch.Tensor,
                   g_idx: torch.Tensor, bits: int = 4, *, split_k: int | None = None,
                   group_size: int | None = None, mma_layout: bool = False) -> torch.Tensor:
    """C [M, N] = A [M, K] · W, W [K, N] dequantized on the fly from GPTQ v1 4-bit tensors.

    qweight int32 [K/8, N], qzeros int32 [G, N/8] (zero − 1), scales [G, N], g_idx [K] (int32/int64,
    any assignment of rows to groups: act-order works). A is fp16, bf16 or fp32; C has its dtype.
    M ≤ 16: split-K GEMV (split_k: None = `choose_split_k`); larger M: the tiled GEMM, or on CUDA
    with M ≥ 64 dequantize + torch.matmul. `group_size`: the caller's word that g_idx is k //
    group_size (no act-order), so a tile of BLOCK_K rows has one zero and scale row
    (`grouped_codes`); checked against g_idx where its values can be read without a host sync (CPU),
    ignored when BLOCK_K does not divide it. `mma_layout`: qweight is in the MMA layout
    (int4_tiles.to_mma_layout; K a multiple of 128), read as such by every path.
    """
    K, N = check_dequant_matmul(a, qweight, qzeros, scales, g_idx, bits, split_k, group_size,
                                mma_layout)
    M = a.shape[0]
    if M <= GEMV_MAX_M:
        return _launch_gemv(a, qweight, qzeros, scales, g_idx, K, N, split_k, group_size,
                            mma_layout=mma_layout)
    # cuBLAS does the matmul; the cost is in the module docstring
    if a.is_cuda and M >= TORCH_MIN_M:
        # dequantize_int4's kernel: dequantize_gptq's values bit for bit, in one pass and
        # without its host-synced g_idx check
        w = _dequantize(qweight, qzeros, scales, g_idx, a.dtype, mma_layout)
        return a @ w.t()  # M, N
    return _launch_gemm(a, qweight, qzeros, scales, g_idx, K, N, group_size, mma_layout)


def dequant_gemm(a, qweight, qzeros, scales, g_idx, bits: int = 4, *,
                 group_size: int | None = None, mma_layout: bool = False) -> torch.Tensor:
    """The tiled GEMM kernel alone, for any M (no torch fallback); arguments as `dequant_matmul`."""
    K, N = check_dequant_matmul(a, qweight, qzeros, scales, g_idx, bits, None, group_size,
                                mma_layout)
    return _launch_gemm(a, qweight, qzeros, scales, g_idx, K, N, group_size, mma_layout)


def dequant_gemv(a, qweight, qzeros, scales, g_idx, bits: int = 4, *, split_k: int | None = None,
                 group_size: int | None = None, fma: bool | None = None,
                 mma_layout: bool = False) -> torch.Tensor:
    """The split-K GEMV kernel alone, for M ≤ 16; arguments as `dequant_matmul`. fma: the rows by
    multiply-adds (True) or tl.dot over 16 rows (False); None: multiply-adds for M ≤ FMA_MAX_M."""
    K, N = check_dequant_matmul(a, qweight, qzeros, scales, g_idx, bits, split_k, group_size,
                                mma_layout)
    if a.shape[0] > GEMV_MAX_M:
        raise ValueError(f"the GEMV kernel takes M ≤ {GEMV_MAX_M} rows, got M={a.shape[0]}")
    if fma and a.shape[0] > FMA_MAX_M:
        raise ValueError(f"fma=True takes M ≤ {FMA_MAX_M} rows, got M={a.shape[0]}")
    return _launch_gemv(a, qweight, qzeros, scales, g_idx, K, N, split_k, group_size, fma,
                        mma_layout)


def _group_constexpr(group_size: int | None, launch) -> int:
    """GROUP_SIZE for the kernels: the group size where every tile of BLOCK_K rows lies in one
    group, else 0 (the row-by-row gather of `dequant_tile`). Not on sm_75 (a GPU launch that
    upcasts): there the grouped tile's integer codes beside their fp32 copy spill 160-600 B
    (benchmarks/kernels_compile.json)."""
    block_k = launch.tiles[-1]
    if launch.gpu and launch.upcast:
        return 0
    return group_size if group_size and group_size % block_k == 0 else 0


def dequantize_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor,
                    *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] from GPTQ v1 4-bit tensors, in one Triton kernel: packing.dequantize_gptq(...,
    bits=4, dtype=dtype).

    W[n, k] = (code[n, k] − zero[n, g_idx[k]]) · scale[n, g_idx[k]], one fp32 product (exact for
    fp16 scales) rounded once to `dtype`, so the result equals dequantize_gptq's bit for bit.
    Arguments as `dequant_matmul` (any g_idx: act-order works). Why a kernel: dequantize_gptq is
    several torch passes over [N, K] tensors (unpack, subtract, gather, multiply, cast); this reads
    the packed tensors once and writes W once, the dequantize step of "dequantize + cuBLAS" for
    large M. It is also the reference of exercise 11 (exercises/dequant_matmul.py,
    notebooks/07_int4_kernel section 3). Codes in the MMA layout: `dequantize_int4_mma`.
    """
    return _dequantize(qweight, qzeros, scales, g_idx, dtype, mma_layout=False)


def dequantize_int4_mma(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                        g_idx: torch.Tensor,
                        *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize_int4` of codes in the MMA layout (kernels/int4_tiles.py `to_mma_layout`)."""
    return _dequantize(qweight, qzeros, scales, g_idx, dtype, mma_layout=True)


def _dequantize(qweight, qzeros, scales, g_idx, dtype: torch.dtype, mma_layout: bool
                ) -> torch.Tensor:
    K, N, _ = check_gptq(qweight, qzeros, scales, g_idx, 4, check_values=can_read_values(g_idx))
    check_mma_layout(K, mma_layout)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    launch = pick("dequantize", qweight.device, dtype)
    # Without bf16 arithmetic (Triton's interpreter truncates fp32 to bf16, where a GPU and torch
    # round to nearest even; sm_75 has none) the kernel writes fp32 and torch rounds.
    out_dtype = torch.float32 if dtype == torch.bfloat16 and launch.upcast else dtype
    w = torch.empty(N, K, dtype=out_dtype, device=qweight.device)  # N, K
    if N == 0 or K == 0:
        return w.to(dtype)
    block_k, block_n = launch.tiles
    _dequantize_kernel[(triton.cdiv(K, block_k), triton.cdiv(N, block_n))](
        qweight, qzeros, scales, g_idx.contiguous(), w,
        N, K,
        *qweight.stride(), *qzeros.stride(), *scales.stride(), *w.stride(),
        BLOCK_K=block_k, BLOCK_N=block_n, MMA=mma_layout, **launch.options(),
    )
    return w.to(dtype)  # N, K   a no-op unless the interpreter wrote fp32 for bf16


def choose_split_k(n: int, k: int, num_sms: int | None = None,
                   tiles: tuple[int, int, int] | None = None) -> int:
    """How many K splits fill the GPU at M ≤ 16: ⌈4 · num_sms / N-tiles⌉, capped.

    Four programs per SM keep enough loads in flight for a memory-bound GEMV (a guess, untuned).
    Caps: each split keeps ≥ MIN_TILES_PER_SPLIT tiles of BLOCK_K, and at most MAX_SPLIT_K.
    num_sms = None reads it from the current CUDA device; on CPU the answer is 1. tiles: the
    launch's (BLOCK_M, BLOCK_N, BLOCK_K); None: the sm_80+ 16-bit GEMV row's.
    """
    if num_sms is None:
        if not torch.cuda.is_available():
            return 1
        num_sms = torch.cuda.get_device_properties(
            torch.cuda.current_device()
        ).multi_processor_count
    _, block_n, block_k = tiles or _GEMV_TILES[True]  # the launch's (BLOCK_M, BLOCK_N, BLOCK_K)
    fill = -(-4 * num_sms // max(1, -(-n // block_n)))
    by_length = max(1, -(-k // block_k) // MIN_TILES_PER_SPLIT)
    return max(1, min(fill, by_length, MAX_SPLIT_K))


def _launch_gemm(a, qweight, qzeros, scales, g_idx, K, N, group_size=None,
                 mma_layout: bool = False) -> torch.Tensor:
    M = a.shape[0]
    launch = pick("gemm_mma" if mma_layout else "gemm", a.device, a.dtype)
    block_m, block_n, block_k = launch.tiles
    c = torch.zeros(M, N, dtype=a.dtype, device=a.device)  # M, N
    if M == 0 or N == 0:
        return c
    _dequant_gemm_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        a, qweight, qzeros, scales, g_idx.contiguous(), c,
        M, N, K,
        *a.stride(), *qweight.stride(), *qzeros.stride(), *scales.stride(), *c.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=launch.upcast, GROUP_SIZE=_group_constexpr(group_size, launch), MMA=mma_layout,
        **launch.options(),
    )
    return c


def _launch_gemv(a, qweight, qzeros, scales, g_idx, K, N, split_k, group_size=None,
                 fma: bool | None = None, mma_layout: bool = False) -> torch.Tensor:
    M = a.shape[0]
    fma = fma if fma is not None else M <= FMA_MAX_M
    launch = pick(_gemv_row(mma_layout, fma), a.device, a.dtype)
    group = _group_constexpr(group_size, launch)
    # the gather path has a row of its own (the grouped path's tiles cost it 3× the shared memory)
    if not group:
        launch = pick("gemv_gather", a.device, a.dtype)
    block_m, block_n, block_k = launch.tiles
    if M == 0 or N == 0:
        return torch.zeros(M, N, dtype=a.dtype, device=a.device)  # M, N
    if fma:  # only the real rows, rounded up to a power of two (tl.arange's)
        block_m = triton.next_power_of_2(M)
    split_k = choose_split_k(N, K, tiles=launch.tiles) if split_k is None else split_k
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k  # whole tiles per split
    tiles_n = triton.cdiv(N, block_n)
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)  # M, N
    p, p_strides, counts = split_k_partials(out, split_k, tiles_n)
    _dequant_gemv_kernel[(tiles_n, split_k)](
        a, qweight, qzeros, scales, g_idx.contiguous(), p, out, counts,
        M, N, K, k_per_split,
        *a.stride(), *qweight.stride(), *qzeros.stride(), *scales.stride(), *p_strides,
        *out.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=launch.upcast, GROUP_SIZE=group, REDUCE=split_k > 1, FMA=fma, MMA=mma_layout,
        **launch.options(),
    )
    return out


def split_k_partials(out: torch.Tensor, split_k: int,
                     tiles_n: int) -> tuple[torch.Tensor, tuple, torch.Tensor]:
    """(partials, their strides, arrival counters) for a split-K launch writing `out` [M, N]: with
    one split the single partial is the answer (written to `out` directly, in its dtype); else
    fp32 partials [S, M, N] that the last split to arrive at a tile adds up (`reduce_splits`)."""
    if split_k == 1:
        return out, (0, *out.stride()), out  # (the counters unused)
    M, N = out.shape
    partials = torch.empty(split_k, M, N, dtype=torch.float32, device=out.device)  # S, M, N
    return partials, partials.stride(), _arrival_counts(out.device, tiles_n)


def _gemv_row(mma_layout: bool, fma: bool) -> str:
    """The GEMV's row of configs.DEQUANT: the MMA layout's tiles are its own 128 rows
    (int4_tiles.mma_tile_dot), with narrower ones for the multiply-adds."""
    if not mma_layout:
        return "gemv"
    return "gemv_mma_fma" if fma else "gemv_mma"


_COUNTS: dict[torch.device, torch.Tensor] = {}  # per device: the split-K arrival counters
_OUTGROWN: list[torch.Tensor] = []  # counters a larger set replaced: kept, graphs may read them


def _arrival_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per column tile, kept per device (every launch leaves them at 0
    again). Allocated at the first split-K launch, which the engine makes before it captures CUDA
    graphs (a warm-up forward); never freed, so a captured graph never reads freed memory."""
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < tiles:
        if counts is not None:
            _OUTGROWN.append(counts)
        counts = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTS[device] = counts
    return counts
