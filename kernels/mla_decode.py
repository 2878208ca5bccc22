"""Decode attention for multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent
cache: every query head reads one shared latent "KV head".

**What is cached** (kernels/mla_decode_ref.py has the math and the reference). Per layer a pool
`kv_cache` [num_blocks, block_size, 1, r + d_rope] holds per token the compressed latent c (r =
`kv_lora_rank` values, after its RMSNorm) followed by the rotated RoPE key k_pe (d_rope values).
Token t of sequence b lives in block `block_tables[b, t // block_size]` at offset
`t % block_size`, as in kernels/paged_attention.py. The caller absorbs W_UK into the query
(q_lat [B, H, r]) and applies W_UV to the output afterwards, so the kernel computes, per head,

    s_j = scale · (q_lat · c_j + q_pe · k_pe_j),   o_lat = Σ_j softmax(s)_j · c_j   [B, H, r]

for keys j = 0 .. context_lens[b] − 1: MQA in the latent space, where the latent is the key
(with k_pe) and the value at once.

**One program per (sequence, block of BLOCK_H heads).** All heads share the one latent head, so
a program takes BLOCK_H query heads as the rows of its q tiles and reads each latent tile once for
all of them: q_lat · cᵀ, q_pe · k_peᵀ and p · c are real matrix products (tl.dot, BLOCK_H ≥ 16 on
a GPU). The keys come in tiles of BLOCK_N token positions, each finding its slot through the block
table (a tile may straddle pages), folded into an online softmax as in kernels/online_softmax.py:
m' = max(m, max s), l = l·exp(m − m') + Σ exp(s − m'), acc = acc·exp(m − m') + exp(s − m')·c, and
o = acc / l at the end (fp32). The scores carry two products, the latent one and the RoPE one,
which is why the shared `online_softmax_step` (one q·kᵀ) is not called here. The c tile loaded
for the scores is the V tile of the second product: each latent is read from memory once.

A sequence's latent cache is read ⌈H / BLOCK_H⌉ times, once per head block; at DeepSeek-V3's
H = 128 that is the price of keeping a [BLOCK_H, r] fp32 accumulator in registers (at r = 512, 64
heads a program take all 255 registers and 112-144 KB of shared memory: kernels/configs.py). No
split-KV here: with B · ⌈H / BLOCK_H⌉ programs, a long context on few sequences leaves part of a
GPU idle (FlashMLA splits the keys too).

**Precision.** On a GPU both products run in the input dtype on tensor cores with fp32
accumulation (p rounded to it for the second, as FlashAttention does); fp32 inputs use IEEE fp32,
never TF32. Triton's interpreter cannot do bf16 arithmetic, so there tiles become fp32 after their
load (`UPCAST`). Tiles, warps and stages: kernels/configs.py ("mla_decode"). Taught in
notebooks/21_kv_cache_by_architecture.ipynb.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import configs
from .checks import can_read_values, check_block_ids, check_tables
from .configs import DTYPES, MIN_ATTENTION_ARCH, pick


# ----------------------------------------------------------------------------- the kernel
@triton.jit
def _mla_decode_kernel(
    QL, QP, KV, block_tables, context_lens, Out,
    stride_qlb, stride_qlh, stride_qpb, stride_qph,
    stride_kvb, stride_kvs,
    stride_bt, stride_ob, stride_oh,
    qk_scale, n_heads, rank, rope_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    R_PAD: tl.constexpr, P_PAD: tl.constexpr, UPCAST: tl.constexpr,
):
    b, hblk = tl.program_id(0), tl.program_id(1)
    ctx = tl.load(context_lens + b).to(tl.int32)
    heads = hblk * BLOCK_H + tl.arange(0, BLOCK_H)  # BLOCK_H
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, P_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = heads < n_heads
    r_mask = offs_r < rank
    p_mask = offs_p < rope_dim
    q_lat = tl.load(QL + b * stride_qlb + heads[:, None] * stride_qlh + offs_r[None, :],
                    mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # BLOCK_H, R_PAD
    q_pe = tl.load(QP + b * stride_qpb + heads[:, None] * stride_qph + offs_p[None, :],
                   mask=h_mask[:, None] & p_mask[None, :], other=0.0)  # BLOCK_H, P_PAD
    if UPCAST:  # the interpreter cannot do bf16 arithmetic
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (log2 units)
    l = tl.zeros([BLOCK_H], tl.float32)  # running denominator
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)  # running numerator, in the latent space
    for start in range(0, ctx, BLOCK_N):
        pos = start + offs_n  # BLOCK_N   token positions in the sequence
        n_mask = pos < ctx
        blk = tl.load(block_tables + b * stride_bt + pos // BLOCK_SIZE, mask=n_mask,
                      other=0).to(tl.int64)
        row = KV + blk * stride_kvb + (pos % BLOCK_SIZE) * stride_kvs  # BLOCK_N   each token's
        # masked slots are never read: NaN in a free block cannot leak
        c = tl.load(row[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                    other=0.0)  # BLOCK_N, R_PAD   the latents: keys and values at once
        k_pe = tl.load(row[:, None] + rank + offs_p[None, :],
                       mask=n_mask[:, None] & p_mask[None, :], other=0.0)  # BLOCK_N, P_PAD
        if UPCAST:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")  # BLOCK_H, BLOCK_N
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))  # log2 units
        # every tile holds a key < ctx, so m_new is finite from the first tile on
        m_new = tl.maximum(m, tl.max(s, 1))  # BLOCK_H
        alpha = tl.math.exp2(m - m_new)  # BLOCK_H   rescales what the old max weighted
        p = tl.math.exp2(s - m_new[:, None])  # BLOCK_H, BLOCK_N
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")
        m = m_new

    l_safe = tl.where(l > 0, l, 1.0)  # an empty context (ctx = 0) writes zeros
    out = acc / l_safe[:, None]  # BLOCK_H, R_PAD
    o_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + offs_r[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=h_mask[:, None] & r_mask[None, :])


# ----------------------------------------------------------------------------- the launcher
def check_mla_decode(q_lat, q_pe, kv_cache, block_tables, context_lens, sm_scale) -> None:
    """Raise ValueError on inconsistent inputs (shapes, dtypes, devices; lengths and block ids
    where reading them is free, kernels/checks.py)."""
    if q_lat.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_lat.shape[:2]:
        raise ValueError(f"q_lat must be [B, H, r] and q_pe [B, H, d_rope], got "
                         f"{tuple(q_lat.shape)} and {tuple(q_pe.shape)}")
    B, H, r = q_lat.shape
    width = r + q_pe.shape[2]
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] != width:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, 1, r + d_rope = {width}], "
                         f"got {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last dim (stride 1)")
    if kv_cache.dtype not in DTYPES or {q_lat.dtype, q_pe.dtype} != {kv_cache.dtype}:
        raise ValueError(f"q_lat, q_pe and kv_cache must share one of {DTYPES}, got "
                         f"{q_lat.dtype}, {q_pe.dtype} and {kv_cache.dtype}")
    if not isinstance(sm_scale, (int, float)) or not 0 < sm_scale < math.inf:
        raise ValueError(f"sm_scale must be a positive finite number (the expanded head's "
                         f"1/√(d_nope + d_rope)), got {sm_scale!r}")
    check_tables(block_tables, context_lens, B)
    if len({t.device for t in (q_lat, q_pe, kv_cache, block_tables, context_lens)}) != 1:
        raise ValueError("q_lat, q_pe, kv_cache, block_tables and context_lens must be on one "
                         "device")
    if B == 0 or not can_read_values(block_tables, context_lens):
        return
    capacity = block_tables.shape[1] * kv_cache.shape[1]
    if context_lens.min() < 1 or context_lens.max() > capacity:
        raise ValueError(f"context_lens must lie in 1 .. {capacity} (max_blocks · block_size), "
                         f"got {context_lens.tolist()}")
    check_block_ids(block_tables, context_lens, kv_cache.shape[1], kv_cache.shape[0])


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor,
               sm_scale: float) -> torch.Tensor:
    """MLA decode attention in the latent space over a paged latent cache.

    q_lat [B, H, r] (q_nope with W_UK absorbed), q_pe [B, H, d_rope] (rotated); kv_cache
    [num_blocks, block_size, 1, r + d_rope] (c, then k_pe, per token); block_tables [B, max_blocks]
    and context_lens [B] (int32 or int64); sm_scale: the expanded head's scale, 1/√(d_nope +
    d_rope) (times an mscale² where the model has one). Returns o_lat [B, H, r] in q_lat's dtype;
    the caller applies W_UV (kernels/mla_decode_ref.py, `expand_output`).
    """
    check_mla_decode(q_lat, q_pe, kv_cache, block_tables, context_lens, sm_scale)
    arch = configs.gpu_arch(q_lat.device)
    if arch is not None and arch < MIN_ATTENTION_ARCH:
        raise ValueError(f"sm_{arch}: the MLA decode kernel needs sm_{MIN_ATTENTION_ARCH} or "
                         "newer (tensor-core tl.dot, bf16)")
    B, H, r = q_lat.shape
    launch = pick("mla_decode", q_lat.device, q_lat.dtype)
    smallest = 16 if launch.gpu else 1  # tl.dot takes ≥ 16 rows on a GPU
    block_h = min(launch.tiles[0], max(smallest, triton.next_power_of_2(H)))
    q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty_like(q_lat)  # B, H, r
    _mla_decode_kernel[(B, triton.cdiv(H, block_h))](
        q_lat, q_pe, kv_cache, block_tables, context_lens, out,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        sm_scale * 1.4426950408889634, H, r, q_pe.shape[2],  # scale · log2 e
        BLOCK_SIZE=kv_cache.shape[1], BLOCK_H=block_h, BLOCK_N=launch.tiles[1],
        R_PAD=max(16, triton.next_power_of_2(r)),
        P_PAD=max(16, triton.next_power_of_2(q_pe.shape[2])), UPCAST=launch.upcast,
        **launch.options(),
    )
    return out
