"""`silu_and_mul`: SwiGLU's activation, silu(gate) · up, in one kernel.

x [..., 2·I] holds a gated MLP's two projections side by side, gate = x[..., :I] then
up = x[..., I:] (the fused gate_up projection of Llama-style MLPs, Shazeer 2020); the output
y [..., I] = silu(gate) · up, silu(g) = g · σ(g) = g / (1 + e^(−g)). `silu_and_mul_ref` is the
same in plain torch, `F.silu(gate) * up`, the reference the kernel is tested against, and the
kernel rounds as it does: silu in float32 rounded to x's dtype (what F.silu does on a half
tensor), then the product in float32 of that and up, rounded to x's dtype (what `*` does).

In torch that is two launches, silu and the multiply, and a round trip of the [..., I] silu
through memory between them; here it is one (vLLM's name for it: silu_and_mul). One program per
row and BLOCK_N columns of it, a 2-d grid (rows, column blocks), so that the widest intermediate
sizes (14336 and more) need no tile that wide; the widths are rarely powers of two (5632, 11008,
14336), masks take the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .configs import DTYPES

MAX_BLOCK_N = 1024  # columns per program


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch: silu(x[..., :I]) · x[..., I:] for x [..., 2·I]."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, inter, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < inter  # inter: I, the width of each half
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    # torch's two roundings: silu to x's dtype, then the product
    silu = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32)  # BLOCK_N
    tl.store(Y + row * stride_y + offs, (silu * up).to(Y.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for x [..., 2·I] = [gate | up]: y [..., I] in x's dtype (see the module)."""
    width = x.shape[-1] if x.dim() else 0
    if width == 0 or width % 2:
        raise ValueError(f"x's last dimension must be even and positive (gate then up, I values "
                         f"each), got {width}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    inter = width // 2
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)  # M, I
    block = min(MAX_BLOCK_N, triton.next_power_of_2(inter))
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](rows, out, rows.stride(0), out.stride(0), inter, BLOCK_N=block)
    return out.view(*x.shape[:-1], inter)
