"""`rotary_embedding`: RoPE on a step's queries and keys in one kernel, reading cos and sin from a
table built once; `rotary_embedding_store_kv`: the same, and the rotated keys and the values
written straight into their slots of the paged pools (what kernels/store_kv.py does after it).

RoPE (Su et al. 2021) rotates each pair (x_i, x_{i+R/2}) of a head's first R dimensions by
position · θ_i, HF's half-split layout (nanoserve/models/layers.py, `apply_rope`, is the plain-torch
reference these kernels are tested against). Written in torch, a decode step builds cos and sin
from the positions (a multiply, a concatenation, cos, sin and two conversions) and rotates q and k
with five operations each (two multiplies, a negation, a concatenation, an add); the keys are then
gathered and scattered into the pool. Here the table cos[p, i] = cos(p · θ_i), sin[p, i] [P, R/2]
is computed once for every position the engine can reach (vLLM's cos_sin_cache), each program reads
its token's row of it, and one launch replaces all of that (issue 43, benchmarks/bench_launches.py).

The arithmetic rounds as torch's does in the model's dtype: x·cos and the rotated half times sin
are each rounded to the dtype, then their sum (in float32 the products are exact for fp16 and
bf16 values, so one rounding each, as torch's). Dimensions past R (partial RoPE: Phi-3 mini's,
GPT-NeoX's) are copied unchanged. With `slot_mapping`, slot −1 marks padding: its keys and values
are not stored, its query is still rotated. An 8-bit pool is not written here: the engine rotates
with `rotary_embedding` and quantizes with store_kv.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import INT_DTYPES, can_read_values, check_pools, check_slot_mapping
from .configs import DTYPES


def rotary_embedding_ref(q, k, positions, cos, sin):
    """Plain torch (layers.apply_rope): q [N, H, D] and k [N, Hkv, D] rotated by the table's rows
    cos, sin [P, R/2] at `positions` [N]."""
    from ..models.layers import apply_rope

    c, s = cos[positions], sin[positions]  # N, R/2
    c = torch.cat((c, c), dim=-1)[None, :, None, :]  # 1, N, 1, R  (apply_rope's [B, T, 1, R])
    s = torch.cat((s, s), dim=-1)[None, :, None, :]
    return apply_rope(q[None], c, s)[0], apply_rope(k[None], c, s)[0]


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """x (float32) rounded to `dtype` and back: a torch operation's result in that dtype."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _rotate_heads(X, stride_xh, Y, stride_yh, n_heads, head_dim, half, cos, sin,
                  H_PAD: tl.constexpr, HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr):
    """One token's heads X [n_heads, head_dim] rotated into Y (cos, sin: HALF_PAD, float32)."""
    offs_h = tl.arange(0, H_PAD)[:, None]
    offs_r = tl.arange(0, HALF_PAD)[None, :]
    mask = (offs_h < n_heads) & (offs_r < half)  # H_PAD, HALF_PAD
    x1 = tl.load(X + offs_h * stride_xh + offs_r, mask=mask, other=0.0)
    x2 = tl.load(X + offs_h * stride_xh + half + offs_r, mask=mask, other=0.0)
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    # apply_rope: x·cos + rotate_half(x)·sin, rotate_half(x) = (−x2, x1)
    y1 = _rounded(a1 * c, dtype) - _rounded(a2 * s, dtype)
    y2 = _rounded(a2 * c, dtype) + _rounded(a1 * s, dtype)
    tl.store(Y + offs_h * stride_yh + offs_r, y1.to(dtype), mask=mask)
    tl.store(Y + offs_h * stride_yh + half + offs_r, y2.to(dtype), mask=mask)
    if TAIL_PAD > 0:  # partial RoPE: the dimensions past 2·half as they are
        # (a flat range of its own: reusing offs_h's 2-d layout costs a shuffle through shared
        # memory, and a spill on sm_90)
        flat = tl.arange(0, H_PAD * TAIL_PAD)
        h = flat // TAIL_PAD
        t = 2 * half + flat % TAIL_PAD
        tail = (h < n_heads) & (t < head_dim)
        rest = tl.load(X + h * stride_xh + t, mask=tail, other=0.0)
        tl.store(Y + h * stride_yh + t, rest, mask=tail)


@triton.jit
def _rotary_kernel(
    Q, K, V, Q_out, K_out, Cos, Sin, positions, slot_mapping, K_cache, V_cache,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_qon, stride_qoh, stride_kon, stride_koh, stride_cos,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    n_heads, n_kv_heads, head_dim, half,
    BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr, D_PAD: tl.constexpr, STORE: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)  # one program per token
    pos = tl.load(positions + i).to(tl.int64)
    offs_r = tl.arange(0, HALF_PAD)
    cos = tl.load(Cos + pos * stride_cos + offs_r, mask=offs_r < half, other=0.0).to(tl.float32)
    sin = tl.load(Sin + pos * stride_cos + offs_r, mask=offs_r < half, other=0.0).to(tl.float32)
    _rotate_heads(Q + i * stride_qn, stride_qh, Q_out + i * stride_qon, stride_qoh, n_heads,
                  head_dim, half, cos, sin, H_PAD, HALF_PAD, TAIL_PAD)
    if STORE:
        slot = tl.load(slot_mapping + i).to(tl.int64)
        if slot < 0:  # padding: nothing to store (an early exit, as in store_kv)
            return
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        k_dst = K_cache + blk * stride_kcb + off * stride_kcs
        _rotate_heads(K + i * stride_kn, stride_kh, k_dst, stride_kch, n_kv_heads, head_dim,
                      half, cos, sin, HKV_PAD, HALF_PAD, TAIL_PAD)
        offs_h = tl.arange(0, HKV_PAD)[:, None]
        offs_d = tl.arange(0, D_PAD)[None, :]
        mask = (offs_h < n_kv_heads) & (offs_d < head_dim)
        v = tl.load(V + i * stride_vn + offs_h * stride_vh + offs_d, mask=mask, other=0.0)
        v_dst = V_cache + blk * stride_vcb + off * stride_vcs
        tl.store(v_dst + offs_h * stride_vch + offs_d, v, mask=mask)
    else:
        _rotate_heads(K + i * stride_kn, stride_kh, K_out + i * stride_kon, stride_koh,
                      n_kv_heads, head_dim, half, cos, sin, HKV_PAD, HALF_PAD, TAIL_PAD)


def _check(q, k, positions, cos, sin) -> None:
    """Shapes, dtypes and (where reading them is free) positions within the table."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [N, H, D] and k [N, Hkv, D], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q, k must be fp16, bf16 or fp32 alike, got {q.dtype} and {k.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must be contiguous in their last dimension (a head's values)")
    P, half = cos.shape if cos.dim() == 2 else (0, 0)
    if sin.shape != cos.shape or cos.dim() != 2 or not 1 <= 2 * half <= q.shape[2]:
        raise ValueError(f"cos and sin must be [P, R/2] with R ≤ head_dim {q.shape[2]}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != q.dtype or sin.dtype != q.dtype or cos.stride(-1) != 1:
        raise ValueError(f"cos and sin must be contiguous rows in q's dtype {q.dtype}, got "
                         f"{cos.dtype}, {sin.dtype}")
    if positions.shape != (q.shape[0],) or positions.dtype not in INT_DTYPES:
        raise ValueError(f"positions must be int32/int64 [{q.shape[0]}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if can_read_values(positions) and positions.numel() and (
            positions.min() < 0 or positions.max() >= P):
        raise ValueError(f"positions must lie in 0 .. {P - 1} (the table's rows)")


def _launch(q, k, v, positions, cos, sin, k_out, slot_mapping, k_cache, v_cache) -> torch.Tensor:
    N, H, D = q.shape
    Hkv, half = k.shape[1], cos.shape[1]
    q_out = torch.empty((N, H, D), dtype=q.dtype, device=q.device)
    if N == 0:
        return q_out
    store = k_cache is not None
    block_size = 1
    if store:
        block_size = k_cache.shape[1]
    else:  # dummies the kernel does not read
        v, slot_mapping, k_cache, v_cache = k, positions, k_out[None], k_out[None]
    _rotary_kernel[(N,)](
        q, k, v, q_out, k_out, cos, sin, positions.contiguous(), slot_mapping.contiguous(),
        k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        H, Hkv, D, half,
        BLOCK_SIZE=block_size, H_PAD=triton.next_power_of_2(H),
        HKV_PAD=triton.next_power_of_2(Hkv), HALF_PAD=triton.next_power_of_2(half),
        TAIL_PAD=0 if 2 * half == D else triton.next_power_of_2(D - 2 * half),
        D_PAD=triton.next_power_of_2(D), STORE=store,
    )
    return q_out


def rotary_embedding(q, k, positions, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, H, D] and k [N, Hkv, D] rotated by the rows of cos, sin [P, R/2] (in q's dtype) at
    `positions` [N]; new tensors, contiguous."""
    _check(q, k, positions, cos, sin)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q_out = _launch(q, k, None, positions, cos, sin, k_out, None, None, None)
    return q_out, k_out


def rotary_embedding_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache,
                              slot_mapping) -> torch.Tensor:
    """`rotary_embedding`, with the rotated k and the values v [N, Hkv, D] written into slots
    `slot_mapping` [N] (−1: padding, not written) of the pools [num_blocks, block_size, Hkv, D]
    instead of returned. Returns the rotated q [N, H, D]."""
    _check(q, k, positions, cos, sin)
    check_pools(k_cache, v_cache)
    nb, bs, Hkv, D = k_cache.shape
    if v.shape != k.shape or v.dtype != k.dtype or k.shape[1:] != (Hkv, D):
        raise ValueError(f"k, v must be [N, {Hkv}, {D}] like the pools, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k_cache.dtype != k.dtype or v.stride(-1) != 1:
        raise ValueError(f"the pools' dtype {k_cache.dtype} must be k's {k.dtype}, v's last "
                         "dimension contiguous (8-bit pools: rotary_embedding, then store_kv)")
    check_slot_mapping(slot_mapping, k.shape[0], nb * bs)
    return _launch(q, k, v, positions, cos, sin, k, slot_mapping, k_cache, v_cache)
