"""`rms_norm`: RMSNorm in one kernel, one program per row; `add_rms_norm`: the residual add before
it folded into the same launch.

y = x / sqrt(mean(x²) + eps) · w over the last dimension of x [..., N] (Zhang & Sennrich 2019), with
the two conventions of nanoserve.models.layers.RMSNorm, the plain-torch reference this kernel is
tested against: Llama rounds the normalised x to its dtype and then scales it (`w · x̂`, in w's
dtype), Gemma and OLMo 2 scale in float32 first (`(o + w) · x̂`, o = 1 for Gemma's unit offset)
and round once. The statistics are float32 either way.

Written out in torch, RMSNorm is six kernels (square, mean, add eps, rsqrt, two multiplies); a
Llama layer has two of them, so this saves ten launches a layer on the GPU path (issue 43,
benchmarks/bench_launches.py). The row is one tile: N up to MAX_N (the widest model nanoserve
runs is far below it).

`add_rms_norm` is vLLM's fused_add_rms_norm: a pre-norm block ends with `h = x + residual` and
the next block opens with `norm(h)`, two launches that read the same row. Here the program adds
the row to its residual (in float32, rounded to x's dtype as torch's `x + residual` is), writes
that sum out as the new residual and normalises it while it is still in registers: one launch
instead of two, and the sum is read back from memory zero times instead of once. It is the same
kernel as `rms_norm`, behind a constexpr flag (HAS_RESIDUAL), so the plain path compiles as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import DTYPES

MAX_N = 16384


@triton.jit
def _rms_norm_kernel(X, W, Y, R, R_OUT, stride_x, stride_y, stride_r, stride_r_out, N, eps,
                     OFFSET: tl.constexpr, SCALE_FP32: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # x + residual, rounded to x's dtype as torch's `+` rounds: the norm's input
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(R_OUT + row * stride_r_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / N
    normed = xf * tl.rsqrt(mean_sq + eps)  # BLOCK_N, float32
    w = tl.load(W + offs, mask=mask, other=0.0)
    if SCALE_FP32:
        y = normed * (OFFSET + w.to(tl.float32))
    else:  # rounded to x's dtype, then scaled in w's
        y = w.to(tl.float32) * normed.to(x.dtype).to(tl.float32)
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    """The arguments both launchers share: a weight [N] beside x [..., N] in a supported dtype."""
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"weight must be [{N}] (x's last dimension), got {list(weight.shape)}")
    if x.dtype not in DTYPES or weight.device != x.device:
        raise ValueError(f"x must be fp16, bf16 or fp32 beside its weight, got {x.dtype} on "
                         f"{x.device}, weight on {weight.device}")
    if not 1 <= N <= MAX_N:
        raise ValueError(f"rows of 1..{MAX_N} values, got {N}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., N] as rows [M, N] whose values are contiguous (the kernel steps rows by a stride)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(rows, weight, out, eps, unit_offset, scale_fp32, residual=None, residual_out=None):
    """One program per row of rows [M, N]; with residual [M, N], the add first (see the module)."""
    has_residual = residual is not None
    if not has_residual:  # dummies: the HAS_RESIDUAL = False kernel never touches them
        residual, residual_out = rows, out
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, residual, residual_out,
                                           rows.stride(0), out.stride(0), residual.stride(0),
                                           residual_out.stride(0), rows.shape[1], float(eps),
                                           OFFSET=float(unit_offset),
                                           SCALE_FP32=bool(scale_fp32 or unit_offset),
                                           HAS_RESIDUAL=has_residual,
                                           BLOCK_N=triton.next_power_of_2(rows.shape[1]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
             scale_fp32: bool = False) -> torch.Tensor:
    """RMSNorm of x [..., N] by weight [N] (layers.RMSNorm's conventions: see the module). The
    output has x's dtype, as layers.RMSNorm's has (its weight is in the model's dtype)."""
    _check(x, weight)
    rows = _rows(x)
    out = torch.empty_like(rows)
    _launch(rows, weight, out, eps, unit_offset, scale_fp32)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool = False,
                 scale_fp32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual): new_residual = x + residual (torch's rounding in x's dtype) and
    normed = rms_norm(new_residual, weight, eps, ...), in one launch. x, residual [..., N] share
    shape, dtype and device; both outputs are new tensors of that shape and dtype, the inputs are
    left as they were (vLLM's fused_add_rms_norm updates them in place)."""
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {list(x.shape)}, got "
                         f"{list(residual.shape)}")
    if residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"residual must have x's dtype and device ({x.dtype} on {x.device}), got "
                         f"{residual.dtype} on {residual.device}")
    rows = _rows(x)
    out, new_residual = torch.empty_like(rows), torch.empty_like(rows)
    _launch(rows, weight, out, eps, unit_offset, scale_fp32, _rows(residual), new_residual)
    return out.view(x.shape), new_residual.view(x.shape)
