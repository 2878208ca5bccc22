"""Paged decode attention: one new query token per sequence attends to its K/V in a block pool.

**The layout** (PagedAttention, Kwon et al. 2023; see nanoserve/kv/cache.py). Per layer, keys
and values live in pools `[num_blocks, block_size, Hkv, D]`. Token t of sequence b lives in
block `block_tables[b, t // block_size]` at offset `t % block_size`, i.e. in *slot*
`block_tables[b, t // block_size] · block_size + t % block_size`. Two kernels work on it:

- `store_kv` (kernels/store_kv.py) scatters a step's new k, v [N, Hkv, D] into their slots.
- `paged_attention` is decode attention: q [B, H, D] holds each sequence's newest token, whose
  own K/V is already stored, so it sees keys 0 .. context_lens[b] − 1. A program walks its
  sequence's keys in tiles of BLOCK_N *token positions*; each position finds its slot through
  the block table, so a tile may straddle pages and the tile size is free of the page size.
  The tiles fold into an *online softmax*, as in kernels/flash_attention.py: per tile of scores
  x, m' = max(m, max x), l = l·exp(m − m') + Σ exp(x − m'), acc = acc·exp(m − m') + exp(x − m')·v,
  and out = acc / l at the end (m, l, acc in fp32): the step FlashAttention takes too, one function
  for both (kernels/online_softmax.py). With a sliding window w (Mistral), the query
  at position len − 1 sees only keys len − w .. len − 1, so the walk simply starts at len − w: the
  blocks before it are never read (the engine may already have given them back to the pool). A
  soft-cap c (Gemma 2) maps each score x to c·tanh(x / c) first (online_softmax.softcap_scores).
  **Attention sinks** (gpt-oss: one learned logit per query head joins the softmax, with no
  value): the online softmax starts from the sink instead of from nothing, m = sink, l =
  exp(sink − m) = 1, acc = 0, so no extra pass; with split-KV only split 0 starts so (the sink
  counts once, and the merge's log-sum-exp weights then divide by it too).

**GQA, one program per group.** H query heads share Hkv kv heads (head h reads kv head
h // G, G = H // Hkv). A program owns one (sequence, kv head) and all G query heads of its
group as the rows of a [G_PAD, D] tile, so every K/V tile is loaded once per group, not G
times, and q·kᵀ, p·v are real matrix products (tl.dot; G_PAD = G rounded up to ≥ 16, the
smallest tl.dot a GPU accepts; padding rows have q = 0 and are never stored).

**Split-KV** (Flash-Decoding, Dao et al. 2023: kernels/split_kv.py). With few sequences, B·Hkv
programs leave most of a GPU idle, so the context is cut into `num_splits` ranges of whole tiles,
grid (B, Hkv, num_splits): each split writes its partial output, normalised over its own keys, and
their log-sum-exp, and `merge_splits` combines them exactly. With num_splits = 1 the single partial
is the answer, written to `out`.

**Quantized pools** (`kv_cache_dtype` int8 / fp8_e4m3 / fp8_e5m2, nanoserve/kv/quant.py): K and V
hold 8-bit codes, `k_scale`/`v_scale` [num_blocks, block_size, Hkv] one fp16 scale per token and kv
head; int4: two codes a byte ([.., Hkv, D / 2]) and a scale and a minimum per group of QGROUP
values ([.., Hkv, 2 · D / QGROUP]). Each tile is dequantized in registers as it is loaded
(kernels/kv_quant.py: codes · scale, in q's dtype); no full-precision copy of the cache exists
anywhere.

**Precision.** On a GPU, q·kᵀ and p·v run in the input dtype on tensor cores with fp32
accumulation (p is rounded to fp16/bf16 for the second product, as in FlashAttention), and fp32
inputs use IEEE fp32 (`input_precision="ieee"`, not TF32). Triton's interpreter cannot do bf16
arithmetic (docs/ARCHITECTURE.md, section 'Triton on CPU and GPU'), so there every tile becomes
fp32 right after its load (`UPCAST`). The scale · log2 e multiplies the fp32 scores, and exp2
does the rest: exp(x) = 2^(x·log2 e). Tiles, warps and stages: kernels/configs.py. Taught in
notebooks/04_attention_kernels.ipynb.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .checks import check_paged_attention, check_sinks, check_softcap, check_window
from .configs import pick
from .kv_quant import code_column, group_size, kv_bits, load_kv_tile, scale_index
from .online_softmax import online_softmax_step
from .split_kv import choose_num_splits, merge_splits


# ----------------------------------------------------------------------------- the reference
def paged_attention_ref(q, k_cache, v_cache, block_tables, context_lens, sm_scale=None, window=None,
                        softcap=None, sinks=None) -> torch.Tensor:
    """Plain torch, one sequence at a time: gather its keys through the block table (the `window`
    newest only, with a sliding window), softmax (with each head's sink logit sinks[h] as one more
    column, dropped after), sum values."""
    B, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    out = torch.empty_like(q)  # B, H, D
    for b in range(B):
        ctx = int(context_lens[b])
        pos = torch.arange(max(ctx - window, 0) if window else 0, ctx, device=q.device)  # L
        slots = block_tables[b, pos // bs].long() * bs + pos % bs  # L
        k = k_cache.flatten(0, 1)[slots].float().repeat_interleave(H // Hkv, dim=1)  # L, H, D
        v = v_cache.flatten(0, 1)[slots].float().repeat_interleave(H // Hkv, dim=1)  # L, H, D
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale  # H, L
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:  # H, L + 1: the sink's column, dropped after the softmax
            scores = torch.cat([scores, sinks.float()[:, None]], dim=-1)
        probs = scores.softmax(dim=-1)[:, :len(pos)]  # H, L
        out[b] = torch.einsum("hl,lhd->hd", probs, v).to(q.dtype)  # H, D
    return out


# ----------------------------------------------------------------------------- the kernels
@triton.jit
def _paged_decode_kernel(
    Q, K_cache, V_cache, K_scale, V_scale, block_tables, context_lens, Out, Lse, Sinks,
    stride_qb, stride_qh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    qk_scale, head_dim, n_kv_heads, window,
    SOFTCAP: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, KV_QUANT: tl.constexpr,
    QGROUP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(context_lens + b).to(tl.int32)
    first = 0  # the first key the query sees: 0, or with a sliding window, ctx − window
    if window > 0:
        first = tl.maximum(ctx - window, 0)
    # whole tiles per split
    split_len = tl.cdiv(tl.cdiv(ctx - first, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, ctx)  # lo ≥ hi: an empty split, the loop below never runs

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g  # G_PAD   the query heads of this kv head's group
    row_mask = offs_g < GROUP
    d_mask = offs_d < head_dim
    cols = code_column(offs_d, KV_QUANT)  # D_PAD   where each value's code sits (int4: d // 2)
    n_groups = head_dim // QGROUP  # int4: scales per token and head (QGROUP values each)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # G_PAD, D_PAD
    if UPCAST:  # the interpreter cannot do bf16 arithmetic
        q = q.to(tl.float32)

    m = tl.full([G_PAD], float("-inf"), tl.float32)  # running max (log2 units)
    l = tl.zeros([G_PAD], tl.float32)  # running denominator
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)  # running numerator
    if HAS_SINKS:  # split 0 starts from each head's sink: m = sink, l = 1 (its exp), no value
        sink = tl.load(Sinks + heads, mask=row_mask, other=0.0).to(tl.float32)  # G_PAD
        first_split = tl.full([G_PAD], split, tl.int32) == 0  # G_PAD
        m = tl.where(first_split, sink * 1.4426950408889634, m)  # log2 units
        l = tl.where(first_split, 1.0, l)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n  # BLOCK_N   token positions in the sequence
        n_mask = pos < hi
        blk = tl.load(block_tables + b * stride_bt + pos // BLOCK_SIZE, mask=n_mask,
                      other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        # masked slots are never read: NaN there cannot leak
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # BLOCK_N   a quantized pool's scale of each key
        scale_at = (blk * BLOCK_SIZE + off) * n_kv_heads + kvh
        # BLOCK_N, 1 (int4: BLOCK_N, D_PAD, each value's group's scale)
        scale_at = scale_index(scale_at[:, None], offs_d[None, :], n_groups, KV_QUANT, QGROUP)
        k_at = (K_cache + blk[:, None] * stride_kcb + off[:, None] * stride_kcs
                + kvh * stride_kch + cols[None, :])  # BLOCK_N, D_PAD
        k = load_kv_tile(k_at, kv_mask, K_scale + scale_at, n_mask[:, None], offs_d[None, :],
                         KV_QUANT, q.dtype)  # BLOCK_N, D_PAD
        v_at = (V_cache + blk[:, None] * stride_vcb + off[:, None] * stride_vcs
                + kvh * stride_vch + cols[None, :])  # BLOCK_N, D_PAD
        v = load_kv_tile(v_at, kv_mask, V_scale + scale_at, n_mask[:, None], offs_d[None, :],
                         KV_QUANT, q.dtype)  # BLOCK_N, D_PAD
        # the step FlashAttention takes (online_softmax.py), over the G_PAD query heads of the
        # group: scores scaled by scale · log2 e in fp32, keys past the context masked
        m, l, acc = online_softmax_step(q, tl.trans(k), v, n_mask[None, :], m, l, acc, qk_scale,
                                        SOFTCAP, UPCAST, True)

    nonempty = l > 0
    l_safe = tl.where(nonempty, l, 1.0)
    out = acc / l_safe[:, None]  # G_PAD, D_PAD   an empty split leaves 0 here
    # G_PAD, natural log
    lse = tl.where(nonempty, m * 0.6931471805599453 + tl.log(l_safe), float("-inf"))
    o_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    tl.store(Lse + b * stride_lb + heads * stride_lh + split, lse, mask=row_mask)


# ----------------------------------------------------------------------------- the wrappers
def paged_attention_split(q, k_cache, v_cache, block_tables, context_lens, sm_scale=None,
                          num_splits=1,
                          *, out=None, max_context=None, window=None, softcap=None, k_scale=None,
                          v_scale=None,
                          kv_cache_dtype="auto", sinks=None):
    """The first phase alone: partial outputs [B, H, num_splits, D] and their log-sum-exps [B, H,
    num_splits] (fp32).

    With `out` ([B, H, D]) and num_splits = 1, the single partial is written straight to it instead.
    max_context: a bound on context_lens known on the host (see `paged_attention`), checked with the
    values.
    """
    quant = check_paged_attention(q, k_cache, v_cache, block_tables, context_lens, num_splits,
                                  max_context,
                                  k_scale, v_scale, kv_cache_dtype)
    window, softcap = check_window(window), check_softcap(softcap)
    sinks = check_sinks(sinks, q.shape[1])
    if out is not None and (num_splits != 1 or out.shape != q.shape or out.stride(-1) != 1):
        raise ValueError("out= is for num_splits = 1 only, and must be shaped like q, contiguous "
                         "in head_dim")
    B, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    launch = pick("decode", q.device, q.dtype, D, kv_bits=kv_bits(kv_cache_dtype))
    q, block_tables, context_lens = (
        q.contiguous(), block_tables.contiguous(), context_lens.contiguous(),
    )
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)  # B, H, S
    if out is None:
        part = torch.empty(B, H, num_splits, D, dtype=torch.float32, device=q.device)  # B, H, S, D
        part_strides = part.stride()[:3]
    else:  # num_splits == 1: the "partial" is the final output, in q's dtype
        part, part_strides = out, (out.stride(0), out.stride(1), 0)
    if not quant:  # dummies: the KV_QUANT = 0 kernel never reads them
        k_scale = v_scale = lse
    has_sinks = sinks is not None
    sinks = sinks.contiguous() if has_sinks else lse  # (a dummy the HAS_SINKS = False kernel skips)
    _paged_decode_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, part, lse, sinks,
        q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
        *part_strides, lse.stride(0), lse.stride(1),
        scale * 1.4426950408889634, D, Hkv, window,  # · log2 e
        SOFTCAP=softcap, BLOCK_SIZE=bs, GROUP=H // Hkv,
        G_PAD=max(16, triton.next_power_of_2(H // Hkv)),
        D_PAD=max(16, triton.next_power_of_2(D)), BLOCK_N=launch.tiles[0], UPCAST=launch.upcast,
        KV_QUANT=quant, QGROUP=group_size(kv_cache_dtype, D), HAS_SINKS=has_sinks,
        **launch.options(),
    )
    return part, lse


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, sm_scale=None,
                    num_splits: int | None = 1,
                    *, max_context: int | None = None, window: int | None = None,
                    softcap: float | None = None,
                    k_scale=None, v_scale=None, kv_cache_dtype: str = "auto",
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over paged K/V.

    q [B, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]
    and context_lens [B] (int32 or int64); returns out [B, H, D] in q's dtype. Query head h reads
    kv head h // (H // Hkv); sequence b sees keys 0 .. context_lens[b] − 1. sm_scale defaults to
    1/√D. num_splits > 1 runs Flash-Decoding's split-KV pass, then the LSE-weighted merge; None
    lets `choose_num_splits` decide from max_context, the longest context (or any bound above it)
    known on the host; without it that reads context_lens, a host sync on a GPU. window: a sliding
    window, each query sees its `window` newest keys only (None: all). softcap: scores x ->
    softcap·tanh(x / softcap) before the softmax (None: off). kv_cache_dtype "int8" / "fp8_e4m3" /
    "fp8_e5m2": the pools hold 8-bit codes (int8, or FP8 bits in uint8) and k_scale, v_scale
    [num_blocks, block_size, Hkv] their fp16 scales (nanoserve/kv/quant.py), dequantized as they are
    read; "int4": pools [num_blocks, block_size, Hkv, D / 2] of packed codes and scales
    [num_blocks, block_size, Hkv, 2 · D / group] (a scale and a minimum per group). sinks [H]:
    each query head's learned sink logit (gpt-oss), one more softmax column with no value (None:
    none).
    """
    kv = dict(k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=kv_cache_dtype, sinks=sinks)
    if num_splits is None:
        if max_context is None:
            max_context = int(context_lens.max()) if context_lens.numel() else 1
        num_splits = choose_num_splits(q.shape[0], k_cache.shape[2], max_context)
    if num_splits == 1:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # B, H, D
        paged_attention_split(q, k_cache, v_cache, block_tables, context_lens, sm_scale, 1, out=out,
                              max_context=max_context, window=window, softcap=softcap, **kv)
        return out
    part, lse = paged_attention_split(q, k_cache, v_cache, block_tables, context_lens, sm_scale,
                                      num_splits, max_context=max_context, window=window,
                                      softcap=softcap, **kv)
    return merge_splits(part, lse, q.dtype)


