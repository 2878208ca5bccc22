"""Flash attention for prefill: packed variable-length sequences, GQA, and a paged KV prefix.

Attention is softmax(q·kᵀ·scale + mask)·v. Written out (`flash_attention_ref`, beside), it
materialises a [Lq, Lk] score matrix per head: O(L²) memory, and on a GPU O(L²) traffic to
and from slow HBM. FlashAttention (Dao et al. 2022) never builds that matrix. One program
owns a tile of BLOCK_M queries, keeps it on chip, and streams the keys and values past it in
tiles of BLOCK_N, folding each tile into a running result with the *online softmax*:

    for each key tile j:   s = q·k_jᵀ·scale                    # BLOCK_M, BLOCK_N
                           m' = max(m, rowmax(s))              # new running max
                           p = exp(s − m')                     # unnormalised tile probabilities
                           l = l·exp(m − m') + rowsum(p)       # running denominator
                           acc = acc·exp(m − m') + p·v_j       # running numerator
    out = acc / l

Rescaling by exp(m − m') whenever the max grows keeps every exponent ≤ 0 (no overflow) and
makes the result exactly softmax·v once all tiles are in. We follow FlashAttention-2 (Dao
2023): the loop over keys is the inner loop, queries are split across programs, the division
by l happens once at the end, and the scale is folded into exp2 (exp(x) = 2^(x·log2 e)).
Accumulation is fp32 whatever the input dtype; the output has q's dtype.

**Packed variable lengths** (FlashAttention's "varlen" convention). B sequences of different
lengths are concatenated without padding: q [total_q, H, D], k/v [total_k, Hkv, D], and
`cu_seqlens_q` [B+1] holds the cumulative lengths, so sequence b's queries are rows
cu_seqlens_q[b] : cu_seqlens_q[b+1]. Grid: (cdiv(max Lq, BLOCK_M), B·H); a program whose
query tile starts past its sequence's end returns at once.

**Bottom-right causal alignment.** A sequence with Lq queries and Lk keys is the *last* Lq
tokens of Lk: query i sits at position Lk − Lq + i and sees keys 0..Lk − Lq + i. With Lq = Lk
that is ordinary causal attention; with Lq < Lk the new tokens see everything before them.
A query that sees no key (only when Lq > Lk) gets output 0. A sliding window w hides keys more than
w − 1 back too (both loops start at the tile's first visible key). A soft-cap c maps x to c·tanh(x /
c). **Token trees** (speculative verification, nanoserve/spec/tree_sampler.py): `tree_bits`
[total_q] gives each query the new keys it may see, bit j for new key j (its ancestors and itself),
on top of causality; −1 (every bit) for a row that is a plain chain. The prefix is seen whole, as
before. **Attention sinks** (gpt-oss): `sinks` [H], one learned logit per query head, joins every
softmax with no value behind it. The online softmax simply starts from it instead of from nothing:
m = sink (log2 units), l = 1 (exp of the sink minus itself), acc = 0; no extra pass, and a query
that sees no key gets 0 as before.

**Paged prefix** (chunked prefill, prefix-cache hits). With `block_tables`, `k_cache`,
`v_cache` and `context_lens`, sequence b first has `context_lens[b]` = P tokens already in the
paged cache ([num_blocks, block_size, Hkv, D]; token t in block block_table[t // block_size] at
offset t % block_size: nanoserve/kv/cache.py), then its Lk new keys at positions P..P + Lk − 1.
Two loops over key tiles share one online softmax: the prefix, each key row gathered through the
block table, then the new keys. Masked loads never touch a slot past P, so whatever sits in unused
blocks (the tests fill them with NaN) cannot leak in. A quantized pool (8-bit codes with one scale
per token and kv head, or int4 codes two a byte with a scale and a minimum per QGROUP values:
nanoserve/kv/quant.py) is dequantized tile by tile in registers (kv_quant.py).

**GQA.** H query heads share Hkv kv heads: query head h reads kv head h // (H // Hkv).

**Masks cost.** The key tiles every query of a program sees (below the diagonal, no window) run
without building or applying a mask (loop 2a); only the diagonal tiles are masked (2b). BLOCK_D is
head_dim rounded up to a power of two (≥ 16, as tl.dot needs); when they are equal the head-dim mask
is a constant (`EVEN_D`), so K / V loads stay 16 bytes wide. On an H100 the two took d 64 from 0.45×
to 0.73× SDPA-flash (benchmarks/RESULTS.md). Triton notes (docs/ARCHITECTURE.md): in the interpreter
tiles become fp32 after their load (`UPCAST`: no bf16 arithmetic there); on a GPU q·kᵀ and p·v run
in the input dtype on tensor cores with fp32 accumulation, fp32 as IEEE (no silent TF32). Tiles,
warps and
stages: kernels/configs.py. Taught in notebooks/04_attention_kernels.ipynb (exercise 7).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .checks import (
    check_flash_attention,
    check_sinks,
    check_softcap,
    check_tiles,
    check_tree_bits,
    check_window,
)
from .configs import pick
from .kv_quant import (
    code_column,
    group_size,
    kv_bits,
    kv_quant_code,
    load_kv_tile,
    scale_index,
)
from .online_softmax import online_softmax_step


# ----------------------------------------------------------------------------- the kernel
@triton.jit
def _flash_attention_kernel(
    Q, K, V, O, cu_seqlens_q, cu_seqlens_k,
    block_tables, K_cache, V_cache, K_scale, V_scale, context_lens, tree_bits, Sinks,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt_b, stride_bt_i,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    qk_scale, H, group, head_dim, page_size, window,
    SOFTCAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_PREFIX: tl.constexpr, UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, TREE: tl.constexpr, QGROUP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    kvh = h // group  # GQA: `group` query heads share this kv head

    q_start = tl.load(cu_seqlens_q + b)
    Lq = tl.load(cu_seqlens_q + b + 1) - q_start
    if start_m >= Lq:  # this sequence has fewer than start_m queries: nothing to do
        return
    k_start = tl.load(cu_seqlens_k + b)
    Lk = tl.load(cu_seqlens_k + b + 1) - k_start
    P = 0
    if HAS_PREFIX:
        P = tl.load(context_lens + b)

    offs_m = start_m + tl.arange(0, BLOCK_M)  # BLOCK_M     query index within the sequence
    offs_n = tl.arange(0, BLOCK_N)  # BLOCK_N
    offs_d = tl.arange(0, BLOCK_D)  # BLOCK_D
    m_ok = offs_m < Lq  # BLOCK_M
    d_ok = offs_d < head_dim  # BLOCK_D
    if EVEN_D:  # head_dim == BLOCK_D: a constant mask, so loads along D stay 16 bytes wide
        d_ok = tl.full([BLOCK_D], 1, tl.int1)  # BLOCK_D
    q_pos = P + Lk - Lq + offs_m  # BLOCK_M     absolute positions (bottom-right alignment)
    first = 0  # the first key position any query of this tile sees: 0, or its window's start
    if window > 0:
        first = tl.maximum(P + Lk - Lq + start_m - window + 1, 0)

    q_ptrs = (Q + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh
              + offs_d[None, :] * stride_qd)  # BLOCK_M, BLOCK_D
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # BLOCK_M, BLOCK_D
    if UPCAST:
        q = q.to(tl.float32)

    # BLOCK_M     running max (log2 units)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # BLOCK_M     running denominator
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # BLOCK_M, BLOCK_D running numerator
    if HAS_SINKS:  # start from head h's sink: m = sink · log2 e, l = exp2(m − m) = 1, no value
        sink = tl.load(Sinks + h).to(tl.float32)
        m_i = tl.full([BLOCK_M], 1.4426950408889634, dtype=tl.float32) * sink
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)

    # ---- loop 1: the cached prefix, keys at positions 0..P-1, gathered through the block table
    if HAS_PREFIX:
        p_hi = P
        # the tile's last query sees prefix keys up to position P + Lk - Lq + start_m + BLOCK_M - 1
        if CAUSAL:
            p_hi = tl.minimum(P, P + Lk - Lq + start_m + BLOCK_M)
        cols = code_column(offs_d, KV_QUANT)  # BLOCK_D   each value's code (int4: byte d // 2)
        n_groups = head_dim // QGROUP  # int4: scales per token and head
        for start_n in range(first, p_hi, BLOCK_N):
            t = start_n + offs_n  # BLOCK_N     token index = position within the prefix
            n_ok = t < P  # BLOCK_N
            blk = tl.load(block_tables + b * stride_bt_b + (t // page_size) * stride_bt_i,
                          # BLOCK_N     physical block of each token
                          mask=n_ok, other=0).to(tl.int64)
            off = t % page_size  # BLOCK_N     offset inside the block
            # BLOCK_N   a quantized pool's scales
            scale_at = (blk * page_size + off) * (H // group) + kvh
            k_at = (K_cache + blk[None, :] * stride_kcb + off[None, :] * stride_kcs
                    + kvh * stride_kch + cols[:, None] * stride_kcd)  # BLOCK_D, BLOCK_N
            # 1, BLOCK_N (int4: BLOCK_D, BLOCK_N, each value's group's scale)
            k_s = scale_index(scale_at[None, :], offs_d[:, None], n_groups, KV_QUANT, QGROUP)
            kT = load_kv_tile(k_at, d_ok[:, None] & n_ok[None, :], K_scale + k_s, n_ok[None, :],
                              offs_d[:, None], KV_QUANT, q.dtype)
            v_at = (V_cache + blk[:, None] * stride_vcb + off[:, None] * stride_vcs
                    + kvh * stride_vch + cols[None, :] * stride_vcd)  # BLOCK_N, BLOCK_D
            v_s = scale_index(scale_at[:, None], offs_d[None, :], n_groups, KV_QUANT, QGROUP)
            v = load_kv_tile(v_at, n_ok[:, None] & d_ok[None, :], V_scale + v_s, n_ok[:, None],
                             offs_d[None, :], KV_QUANT, q.dtype)
            valid = n_ok[None, :] & m_ok[:, None]  # BLOCK_M, BLOCK_N
            # bites where queries sit inside the prefix: Lq > Lk, or all keys paged (Lk = 0)
            if CAUSAL:
                valid = valid & (t[None, :] <= q_pos[:, None])
            if window > 0:
                valid = valid & (t[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = online_softmax_step(q, kT, v, valid, m_i, l_i, acc, qk_scale, SOFTCAP,
                                                UPCAST, True)

    # ---- loop 2: this step's new keys, at positions P..P+Lk-1
    lo = tl.maximum(first - P, 0)
    hi = Lk
    if CAUSAL:  # the tile's last query sees new keys up to Lk - Lq + (start_m + BLOCK_M - 1)
        hi = tl.minimum(Lk, Lk - Lq + start_m + BLOCK_M)
    # 2a: whole key tiles every query of this tile sees (no window; causal: up to the first query's
    # position)
    full = lo
    # (a tree's queries see only some earlier keys: every tile is masked)
    if window == 0 and not TREE:
        seen_by_all = Lk
        if CAUSAL:
            seen_by_all = tl.minimum(Lk, Lk - Lq + start_m + 1)
        full = lo + tl.maximum(seen_by_all - lo, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, full, BLOCK_N):
        rows = (k_start + start_n + offs_n).to(tl.int64)  # BLOCK_N
        kT = tl.load(K + rows[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None] * stride_kd,
                     mask=d_ok[:, None], other=0.0)  # BLOCK_D, BLOCK_N
        v = tl.load(V + rows[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :] * stride_vd,
                    mask=d_ok[None, :], other=0.0)  # BLOCK_N, BLOCK_D
        m_i, l_i, acc = online_softmax_step(q, kT, v, None, m_i, l_i, acc, qk_scale, SOFTCAP,
                                            UPCAST, False)
    # 2b: the diagonal tiles (and a ragged end, or every tile under a window or of a tree), masked
    if TREE:  # each query's visible new keys, one bit per key (−1: all of them, a chain)
        bits = tl.load(tree_bits + q_start + offs_m, mask=m_ok, other=0)  # BLOCK_M (int64)
    for start_n in range(full, hi, BLOCK_N):
        j = start_n + offs_n  # BLOCK_N     key index within the sequence's new keys
        n_ok = j < Lk  # BLOCK_N
        rows = (k_start + j).to(tl.int64)  # BLOCK_N
        kT = tl.load(K + rows[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None] * stride_kd,
                     mask=d_ok[:, None] & n_ok[None, :], other=0.0)  # BLOCK_D, BLOCK_N
        v = tl.load(V + rows[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # BLOCK_N, BLOCK_D
        valid = n_ok[None, :] & m_ok[:, None]  # BLOCK_M, BLOCK_N
        if CAUSAL:
            valid = valid & ((P + j)[None, :] <= q_pos[:, None])
        if window > 0:
            valid = valid & ((P + j)[None, :] > q_pos[:, None] - window)
        # key j visible only where its bit is set (a shift past 63 reads bit 63: set only in −1)
        if TREE:
            valid = valid & (((bits[:, None] >> tl.minimum(j, 63)[None, :]) & 1) != 0)
        m_i, l_i, acc = online_softmax_step(q, kT, v, valid, m_i, l_i, acc, qk_scale, SOFTCAP,
                                            UPCAST, True)

    # A row that saw no key has l = 0 and acc = 0: output 0, not 0/0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # BLOCK_M, BLOCK_D
    o_ptrs = (O + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh
              + offs_d[None, :] * stride_od)  # BLOCK_M, BLOCK_D
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------- the wrapper
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                    causal: bool = True, sm_scale: float | None = None,
                    block_tables: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                    v_cache: torch.Tensor | None = None, context_lens: torch.Tensor | None = None,
                    *, block_m: int | None = None, block_n: int | None = None,
                    max_seqlen_q: int | None = None, window: int | None = None,
                    softcap: float | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, kv_cache_dtype: str = "auto",
                    tree_bits: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over packed sequences.  q [total_q, H, D]; k, v [total_k, Hkv, D] -> [total_q, H,
                                         D].

    cu_seqlens_q/k [B+1]: cumulative lengths (sequence b is rows cu[b]:cu[b+1]). causal:
    bottom-right aligned (query i of Lq sits at position P + Lk − Lq + i). sm_scale defaults to
    1/√D. Optional paged
    prefix: block_tables [B, max_blocks], k_cache/v_cache [num_blocks, block_size, Hkv, D],
    context_lens [B] (P, cached tokens per sequence, read before the new keys). block_m/block_n
    override the tile sizes of kernels/configs.py (powers of two, ≥ 16 on a GPU). max_seqlen_q: the
    longest query sequence, or any bound above it, known on the host (sizes the grid; None reads it
    from cu_seqlens_q, a host sync on a GPU). window: a sliding window (with causal), each query
    sees its `window` newest keys only (None: all). softcap: scores x -> softcap·tanh(x / softcap)
    (None: off). kv_cache_dtype "int8" / "fp8_e4m3" / "fp8_e5m2": the prefix pools hold 8-bit
    codes and k_scale, v_scale [num_blocks, block_size, Hkv] their fp16 scales
    (nanoserve/kv/quant.py), dequantized as they are read; "int4": codes two a byte [.., Hkv, D
    / 2], scales [.., Hkv, 2 · D / group] (a scale and a minimum per group). tree_bits [total_q]
    (int64, with causal): bit j of a query's entry set = it sees new key j of its sequence.
    sinks [H]: each query head's learned sink logit (gpt-oss), one more softmax column with no
    value (None: none).
    """
    window, softcap = check_window(window, causal), check_softcap(softcap)
    sinks = check_sinks(sinks, q.shape[1])
    check_tree_bits(tree_bits, q, causal)
    has_prefix = check_flash_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, block_tables, k_cache,
                                       v_cache, context_lens, max_seqlen_q, k_scale, v_scale,
                                       kv_cache_dtype)
    quant = kv_quant_code(kv_cache_dtype)
    total_q, H, D = q.shape
    Hkv = k.shape[1]
    B = cu_seqlens_q.numel() - 1
    launch = pick("flash", q.device, q.dtype, D, kv_bits=kv_bits(kv_cache_dtype))
    block_m, block_n = block_m or launch.tiles[0], block_n or launch.tiles[1]
    check_tiles(launch.gpu, block_m=block_m, block_n=block_n)
    out = torch.empty_like(q)  # total_q, H, D
    if total_q == 0 or B == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_q == 0:
        return out
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)

    cu_q = cu_seqlens_q.to(torch.int32)  # B+1
    cu_k = cu_seqlens_k.to(torch.int32)  # B+1
    if has_prefix:
        bt = block_tables.to(torch.int32)  # B, max_blocks
        ctx = context_lens.to(torch.int32)  # B
        kc, vc, page_size = k_cache, v_cache, k_cache.shape[1]
    else:  # dummies: the HAS_PREFIX=False kernel never reads them
        bt = ctx = cu_q
        kc, vc, page_size = k, v, 1
    if not quant:  # dummies: the KV_QUANT = 0 kernel never reads them
        k_scale = v_scale = cu_q
    bits = cu_q if tree_bits is None else tree_bits  # (a dummy the TREE = False kernel never reads)
    sink_logits = cu_q if sinks is None else sinks.contiguous()  # (a dummy, as bits)
    bt_strides = bt.stride() if has_prefix else (0, 0)
    kc_strides = kc.stride() if has_prefix else (0, 0, 0, 0)
    vc_strides = vc.stride() if has_prefix else (0, 0, 0, 0)

    # programs past a sequence's end return at once
    grid = (triton.cdiv(max_seqlen_q, block_m), B * H)
    _flash_attention_kernel[grid](
        q, k, v, out, cu_q, cu_k, bt, kc, vc, k_scale, v_scale, ctx, bits, sink_logits,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        *bt_strides, *kc_strides, *vc_strides,
        sm_scale * math.log2(math.e), H, H // Hkv, D, page_size, window,
        SOFTCAP=softcap, CAUSAL=bool(causal), HAS_PREFIX=has_prefix, UPCAST=launch.upcast,
        KV_QUANT=quant,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        EVEN_D=D == max(16, triton.next_power_of_2(D)), TREE=tree_bits is not None,
        QGROUP=group_size(kv_cache_dtype, D), HAS_SINKS=sinks is not None,
        **launch.options(),
    )
    return out


from .flash_attention_ref import flash_attention_ref  # noqa: E402,F401  (the plain-torch reference, beside)
