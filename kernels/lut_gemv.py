"""Look-up GEMV: y = x · Ŵᵀ for a clustered weight, Ŵ[n, k] = codebook[n, codes[n, k]], without
ever writing Ŵ to memory.

nanoserve/quant/clustering.py stores a weight [N, K] as uint8 codes [N, K] and a codebook
[N, 2^b] per output row (b = 2..4). A decode step has a few rows of x (M ≤ 16), so the layer is
bound by reading the codes, one byte per weight here (half of fp16's traffic; packing two 4-bit
codes per byte would halve it again). Grid (⌈N / BLOCK_N⌉,): each program

1. loads the codebooks of its BLOCK_N outputs once, [BLOCK_N, 2^b] — 16 values per row at most,
   kept in registers for the whole loop over K;
2. for each BLOCK_K tile of inputs: loads the codes [BLOCK_N, BLOCK_K], turns them into weights
   with `tl.gather` along the codebook's row (a look-up in registers: no memory read), and
   accumulates x_tile · w_tileᵀ in fp32 — by multiply-adds and a sum when x has ≤ 4 rows, by
   `tl.dot` (x padded to 16 rows, what tl.dot needs on a GPU) above that.

The look-up is the price of a non-uniform grid: an int4 grid (kernels/dequant_matmul.py) turns a
code into a weight with one multiply-add, a codebook with a gather, which GPUs and CPUs do less
well than arithmetic. benchmarks/bench_clustering.py measures what it costs on a CPU.
`lut_gemv_ref` is the plain-torch reference (gather, then matmul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_tiles
from .configs import DTYPES

__all__ = ["MAX_ROWS", "lut_gemv", "lut_gemv_ref"]

MAX_ROWS = 16          # decode batches; a prefill builds Ŵ once and runs a GEMM instead
FMA_MAX_ROWS = 4       # up to here multiply-adds; above, tl.dot on rows padded to 16
CODEBOOK_SIZES = (4, 8, 16)


def lut_gemv_ref(x: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Plain torch: gather each row's weights from its codebook, then x · Ŵᵀ in fp32; x's dtype."""
    w = codebook.float().gather(1, codes.long())                                      # N, K
    return (x.float() @ w.T).to(x.dtype)                                              # M, N


@triton.jit
def _lut_gemv_kernel(X, Codes, Codebook, Y, M, N, K, stride_xm, stride_cn, stride_bn, stride_ym,
                     N_CENTROIDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)                                        # BLOCK_M
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)           # BLOCK_N
    m_mask = offs_m < M
    n_mask = offs_n < N
    centroid = tl.arange(0, N_CENTROIDS)                                  # C
    # the codebooks of this program's rows, read once
    book = tl.load(Codebook + offs_n.to(tl.int64)[:, None] * stride_bn + centroid[None, :],
                   mask=n_mask[:, None], other=0.0).to(tl.float32)        # BLOCK_N, C
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)                               # BLOCK_K
        k_mask = offs_k < K
        # masked codes read 0: a real centroid, multiplied by the masked x's 0
        codes = tl.load(Codes + offs_n.to(tl.int64)[:, None] * stride_cn + offs_k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0)  # BLOCK_N, BLOCK_K
        w = tl.gather(book, codes.to(tl.int32), axis=1)                   # BLOCK_N, BLOCK_K
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)    # BLOCK_M, BLOCK_K
        if USE_DOT:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
        else:
            prod = x.to(tl.float32)[:, None, :] * w[None, :, :]   # BLOCK_M, BLOCK_N, BLOCK_K
            acc += tl.sum(prod, axis=2)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _check(x: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor) -> None:
    if x.dim() != 2 or codes.dim() != 2 or codebook.dim() != 2 or x.shape[1] != codes.shape[1] \
            or codebook.shape[0] != codes.shape[0]:
        raise ValueError("lut_gemv needs x [M, K], codes [N, K], codebook [N, C]; got x "
                         f"{tuple(x.shape)}, codes {tuple(codes.shape)}, codebook "
                         f"{tuple(codebook.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"lut_gemv is a decode kernel for at most {MAX_ROWS} rows of x, got "
                         f"M={x.shape[0]}: build Ŵ once and use a GEMM for more")
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codebook.shape[1] not in CODEBOOK_SIZES:
        raise ValueError(f"the codebook must hold 2^bits centroids per row, one of "
                         f"{CODEBOOK_SIZES} (bits 2, 3, 4), got {codebook.shape[1]}")
    if x.dtype not in DTYPES or not codebook.is_floating_point():
        raise ValueError(f"x must be one of {DTYPES} and the codebook a float tensor, got "
                         f"{x.dtype} and {codebook.dtype}")
    if len({x.device, codes.device, codebook.device}) != 1:
        raise ValueError("x, codes and codebook must be on one device")
    if any(t.stride(-1) != 1 for t in (x, codes, codebook)):
        raise ValueError("the last dimension of x, codes and codebook must be contiguous")
    if codes.device.type == "cpu" and codes.numel() and int(codes.max()) >= codebook.shape[1]:
        raise ValueError(f"codes must be below the codebook's {codebook.shape[1]} entries, got "
                         f"{int(codes.max())}")


def lut_gemv(x: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor, *,
             block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """y [M, N] in x's dtype = x [M, K] · Ŵᵀ, Ŵ[n, k] = codebook[n, codes[n, k]].

    codes uint8 [N, K]; codebook [N, 2^b] in any float dtype (fp16 as stored); M ≤ 16."""
    _check(x, codes, codebook)
    M, K = x.shape
    N = codes.shape[0]
    use_dot = M > FMA_MAX_ROWS
    block_m = 16 if use_dot else triton.next_power_of_2(max(M, 1))
    if block_n is None:
        block_n = 64
    if block_k is None:  # fp32's exact tl.dot runs on FMAs: a 64-wide K tile spills there
        block_k = 64 if use_dot and x.dtype != torch.float32 else 32
    check_tiles(x.is_cuda, block_n=block_n, block_k=block_k)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # exact fp32, not TF32
    _lut_gemv_kernel[(triton.cdiv(N, block_n),)](
        x, codes, codebook, y, M, N, K, x.stride(0), codes.stride(0), codebook.stride(0),
        y.stride(0), N_CENTROIDS=codebook.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, USE_DOT=use_dot, DOT_PRECISION=precision, num_warps=4,
    )
    return y
