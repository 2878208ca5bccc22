"""Many LoRA adapters in one batch: each token row's x·Aₛᵀ·Bₛᵀ added to the base output, in Triton.

Punica (Chen et al. 2023) names the two halves: **shrink**, h = x·Aₛᵀ ([in] → [R], R the slots'
rank), and **expand**, y += h·Bₛᵀ ([R] → [out]), where s is the row's adapter slot (−1: none, the
row is left as it is). BGMV ("batched gather matrix-vector") runs them per row, each row reading its
own adapter's A and B from the slot tensors A [S, R, in], B [S, out, R] (nanoserve/lora/batched.py
keeps them):

- `_shrink_kernel`, grid (N,): one program per row walks `in` in tiles of BLOCK_K and accumulates
  A[s, :, k-tile] · x[k-tile] into an [R] vector in fp32 (a GEMV: elementwise products and a sum, no
  tl.dot, whose tiles would need ≥ 16 rows on a GPU where a row has one).
- `_expand_kernel`, grid (N, ⌈out / BLOCK_O⌉): each program reads h [R] and one [BLOCK_O, R] tile of
  B[s], and adds their product to its slice of y, in place.

A row with slot −1 is skipped by both (its h is never read). The reference, `lora_bgmv_ref`, is
nanoserve/lora/batched.py's `lora_gathered`: each row's A and B gathered, in plain torch. Segmented
variants (SGMV, one GEMM per adapter over its rows) suit prefill, where an adapter owns many rows;
decode, one row per sequence, is this kernel's case.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the reference: each row's A and B gathered, in torch
from ..lora.batched import lora_gathered as lora_bgmv_ref
from .checks import INT_DTYPES, check_tiles

__all__ = ["lora_bgmv", "lora_bgmv_ref"]


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, IN, R, stride_xn, stride_as, stride_ar,
                   stride_hn, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0)
    s = tl.load(slots_ptr + n)
    if s >= 0:
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, IN, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            # BLOCK_K
            xk = tl.load(x_ptr + n * stride_xn + k, mask=k < IN, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + s * stride_as + r[:, None] * stride_ar + k[None, :],
                        # BLOCK_R, BLOCK_K
                        mask=(r[:, None] < R) & (k[None, :] < IN), other=0.0).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
        tl.store(h_ptr + n * stride_hn + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, y_ptr, OUT, R, stride_hn, stride_bs, stride_bo,
                   stride_yn, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    n = tl.program_id(0)
    s = tl.load(slots_ptr + n)
    if s >= 0:
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        r = tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + n * stride_hn + r, mask=r < R, other=0.0)  # BLOCK_R (fp32)
        b = tl.load(b_ptr + s * stride_bs + o[:, None] * stride_bo + r[None, :],
                    # BLOCK_O, BLOCK_R
                    mask=(o[:, None] < OUT) & (r[None, :] < R), other=0.0).to(tl.float32)
        y = tl.load(y_ptr + n * stride_yn + o, mask=o < OUT, other=0.0)
        tl.store(y_ptr + n * stride_yn + o,
                 (y.to(tl.float32) + tl.sum(b * h[None, :], axis=1)).to(y.dtype),
                 mask=o < OUT)


def lora_bgmv(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
              y: torch.Tensor, *,
              block_k: int = 64, block_o: int = 64) -> torch.Tensor:
    """y += each row's x·A[s]ᵀ·B[s]ᵀ, in place, and return y. x [N, in]; A [S, R, in]; B [S, out,
    R]; slots [N] int32/int64, each −1 (no adapter) or a slot 0 .. S − 1; y [N, out]. All on one
    device, the last dimension of each contiguous; A, B in x's dtype."""
    shapes_ok = x.dim() == 2 and A.dim() == 3 and B.dim() == 3 and y.dim() == 2
    N, IN = x.shape if shapes_ok else (0, 0)
    S, R, _ = A.shape if shapes_ok else (0, 0, 0)
    OUT = B.shape[1] if shapes_ok else 0
    if (
        not shapes_ok
        or A.shape[2] != IN
        or tuple(B.shape) != (S, OUT, R)
        or tuple(y.shape) != (N, OUT)
    ):
        raise ValueError("lora_bgmv needs x [N, in], A [S, R, in], B [S, out, R], y [N, out]; got "
                         f"x {tuple(x.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)}, y "
                         f"{tuple(y.shape)}")
    if slots.shape != (N,) or slots.dtype not in INT_DTYPES:
        raise ValueError(f"slots must be int32/int64 [{N}], got {slots.dtype} {tuple(slots.shape)}")
    if (
        len({t.device for t in (x, A, B, slots, y)}) != 1
        or len({x.dtype, A.dtype, B.dtype, y.dtype}) != 1
    ):
        raise ValueError("x, A, B, slots and y must be on one device, and x, A, B, y of one dtype")
    if any(t.stride(-1) != 1 for t in (x, A, B, y)):
        raise ValueError("the last dimension of x, A, B and y must be contiguous")
    if slots.device.type == "cpu" and N and (int(slots.min()) < -1 or int(slots.max()) >= S):
        raise ValueError(f"slots must be −1 or 0 .. {S - 1}, got {int(slots.min())} .. "
                         f"{int(slots.max())}")
    check_tiles(x.is_cuda, block_k=block_k, block_o=block_o)
    if N == 0:
        return y
    h = torch.empty(N, R, device=x.device, dtype=torch.float32)  # N, R
    BLOCK_R = max(triton.next_power_of_2(R), 16 if x.is_cuda else 1)
    _shrink_kernel[(N,)](x, A, slots, h, IN, R, x.stride(0), A.stride(0), A.stride(1), h.stride(0),
                         BLOCK_R=BLOCK_R, BLOCK_K=block_k)
    _expand_kernel[(N, triton.cdiv(OUT, block_o))](h, B, slots, y, OUT, R, h.stride(0), B.stride(0),
                                                   B.stride(1),
                                                    y.stride(0), BLOCK_O=block_o, BLOCK_R=BLOCK_R)
    return y
