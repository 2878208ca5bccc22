"""W8A8 GEMM: int8 activations × int8 weights, accumulated in int32, scaled once at the end.

    C[m, n] = (Σ_k A[m, k] · W[n, k]) · s_a[m] · s_w[n]  (+ bias[n])

A [M, K] int8 holds the activations quantized per token (row scales s_a [M]), W [N, K] int8 the
weights per output channel (s_w [N]); nanoserve/quant/int8.py has the quantizers and the math. The
scales sit outside the sum, so the loop over K is a pure integer GEMM — `tl.dot` on int8 tiles with
an int32 accumulator, int8 tensor cores on sm_80+ (twice fp16's rate) — and the scales, the bias and
the cast to the output dtype happen once per output tile, in registers (the *epilogue*), where
`torch._int_mm` writes the int32 matrix to memory and scales it in a second pass. Every partial sum
is exact (|q| ≤ 127: K < 133,000). `w8a8_matmul_ref` is the same in plain torch. Tiles and warps:
kernels/configs.py (row "w8a8"). Taught in notebooks/13_w8a8.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import DTYPES, gpu_arch, pick


def w8a8_matmul_ref(a, scale_a, w, scale_w, bias=None, out_dtype=torch.float32) -> torch.Tensor:
    """Plain torch: the exact int32 product (via float64), times the row and column scales (fp32), +
    bias."""
    acc = (a.double() @ w.double().T).float()  # M, N   exact integers
    c = acc * scale_a.float()[:, None] * scale_w.float()[None, :]
    return (c if bias is None else c + bias.float()).to(out_dtype)


@triton.jit
def _w8a8_kernel(
    A, W, SA, SW, Bias, C, M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # BLOCK_M
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for start in range(0, K, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)  # BLOCK_K
        k_mask = offs_k < K
        a = tl.load(A + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=m_mask[:, None] & k_mask[None, :], other=0)  # BLOCK_M, BLOCK_K   int8
        w = tl.load(W + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    # BLOCK_K, BLOCK_N   int8 (Wᵀ's tile)
                    mask=k_mask[:, None] & n_mask[None, :], other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)  # exact
    # the epilogue: scales, bias and the cast, once per tile
    s_a = tl.load(SA + offs_m, mask=m_mask, other=0.0)  # BLOCK_M   fp32
    s_w = tl.load(SW + offs_n, mask=n_mask, other=0.0)  # BLOCK_N   fp32
    c = acc.to(tl.float32) * s_a[:, None] * s_w[None, :]  # BLOCK_M, BLOCK_N
    if HAS_BIAS:
        c += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(C + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             c.to(C.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w8a8_matmul(a, scale_a, w, scale_w, bias=None, out_dtype=torch.float32) -> torch.Tensor:
    """C [M, N] in out_dtype = (a [M, K] int8 · w [N, K]ᵀ int8) · scale_a [M] · scale_w [N] (fp32) +
    bias [N]."""
    if (
        a.dtype != torch.int8
        or w.dtype != torch.int8
        or a.dim() != 2
        or w.dim() != 2
        or a.shape[1] != w.shape[1]
    ):
        raise ValueError(f"a [M, K] and w [N, K] must be int8 with one K, got {a.dtype} "
                         f"{tuple(a.shape)} and {w.dtype} {tuple(w.shape)}")
    M, K = a.shape
    N = w.shape[0]
    if scale_a.shape != (M,) or scale_w.shape != (N,) or scale_a.dtype != torch.float32 \
            or scale_w.dtype != torch.float32:
        raise ValueError(f"scale_a must be fp32 [{M}] and scale_w fp32 [{N}], got {scale_a.dtype} "
                         f"{tuple(scale_a.shape)} and {scale_w.dtype} {tuple(scale_w.shape)}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")
    if out_dtype not in DTYPES:
        raise ValueError(f"out_dtype must be one of {DTYPES}, got {out_dtype}")
    if len({t.device for t in (a, w, scale_a, scale_w) + (() if bias is None else (bias,))}) != 1:
        raise ValueError("a, w, the scales and the bias must be on one device")
    arch = gpu_arch(a.device)
    if arch is not None and arch < 80:
        raise ValueError(f"sm_{arch}: the int8 GEMM needs sm_80 or newer (int8 tensor cores "
                         "through tl.dot)")
    launch = pick("w8a8", a.device, out_dtype)
    BM, BN, BK = launch.tiles
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    _w8a8_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        a, w, scale_a, scale_w, scale_w if bias is None else bias, c, M, N, K,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, **launch.options(),
    )
    return c
