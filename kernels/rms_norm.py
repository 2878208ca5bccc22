"""`rms_norm`: RMSNorm in one kernel, one program per row.

y = x / sqrt(mean(x²) + eps) · w over the last dimension of x [..., N] (Zhang & Sennrich 2019), with
the two conventions of nanoserve.models.layers.RMSNorm, the plain-torch reference this kernel is
tested against: Llama rounds the normalised x to its dtype and then scales it (`w · x̂`, in w's
dtype), Gemma and OLMo 2 scale in float32 first (`(o + w) · x̂`, o = 1 for Gemma's unit offset)
and round once. The statistics are float32 either way.

Written out in torch, RMSNorm is six kernels (square, mean, add eps, rsqrt, two multiplies); a
Llama layer has two of them, so this saves ten launches a layer on the GPU path (issue 43,
benchmarks/bench_launches.py). The row is one tile: N up to MAX_N (the widest model nanoserve
runs is far below it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import DTYPES

MAX_N = 16384


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, N, eps, OFFSET: tl.constexpr,
                     SCALE_FP32: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / N
    normed = xf * tl.rsqrt(mean_sq + eps)  # BLOCK_N, float32
    w = tl.load(W + offs, mask=mask, other=0.0)
    if SCALE_FP32:
        y = normed * (OFFSET + w.to(tl.float32))
    else:  # rounded to x's dtype, then scaled in w's
        y = w.to(tl.float32) * normed.to(x.dtype).to(tl.float32)
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
             scale_fp32: bool = False) -> torch.Tensor:
    """RMSNorm of x [..., N] by weight [N] (layers.RMSNorm's conventions: see the module). The
    output has x's dtype, as layers.RMSNorm's has (its weight is in the model's dtype)."""
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"weight must be [{N}] (x's last dimension), got {list(weight.shape)}")
    if x.dtype not in DTYPES or weight.device != x.device:
        raise ValueError(f"x must be fp16, bf16 or fp32 beside its weight, got {x.dtype} on "
                         f"{x.device}, weight on {weight.device}")
    if not 1 <= N <= MAX_N:
        raise ValueError(f"rows of 1..{MAX_N} values, got {N}")
    rows = x.reshape(-1, N)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), N,
                                           float(eps), OFFSET=float(unit_offset),
                                           SCALE_FP32=bool(scale_fp32 or unit_offset),
                                           BLOCK_N=triton.next_power_of_2(N))
    return out.view(x.shape)
