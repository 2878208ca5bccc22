"""Flash attention (prefill) against torch: the plain reference and, as the outside oracle, SDPA.

docs/TESTING.md §D. Every case runs the Triton kernel in the interpreter on CPU. Tolerances: fp32
≤ 1e-4 (the kernel and torch sum the same fp32 products in different orders; measured ~1e-6);
fp16 inputs atol 1e-2 (both sides compute in fp32; the gap is the final rounding of the output
to 11 mantissa bits); bf16 (8 bits) 1e-2 on |Δ| / (1 + |expected|), see
test_half_precision_inputs. The SDPA oracle never sees the paged pool: it gets each sequence's
prefix in logical order, exactly as the test wrote it into scattered, NaN-poisoned blocks.
Negative controls at the end show each comparison can fail.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from nanoserve.kernels.flash_attention import flash_attention, flash_attention_ref

FP32_TOL = 1e-4
LENS = [1, 7, 17, 33]  # no length a multiple of the 16-wide interpreter tile; 33 spans three tiles


# ----------------------------------------------------------------------------- helpers
def _cu(lens: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor(
        [0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device
    )  # B+1


def _packed(lens_q, lens_k, H, Hkv, D, dtype=torch.float32, seed=0, device="cpu"):
    """Random packed q [Σlq, H, D], k, v [Σlk, Hkv, D] and their cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), H, D, generator=g).to(device, dtype)  # total_q, H, D
    k = torch.randn(sum(lens_k), Hkv, D, generator=g).to(device, dtype)  # total_k, Hkv, D
    v = torch.randn(sum(lens_k), Hkv, D, generator=g).to(device, dtype)  # total_k, Hkv, D
    return q, k, v, _cu(lens_q, device), _cu(lens_k, device)


def _paged_prefix(prefix_lens, Hkv, D, block_size, dtype=torch.float32, seed=1, device="cpu"):
    """A NaN-filled pool with each sequence's prefix written through a random block table.

    Returns (k_cache, v_cache, block_tables, context_lens, prefixes) where prefixes[b] = (k, v)
    [P, Hkv, D] in logical order, for the oracle. Slots past P (rest of the last block, unused
    blocks, table padding) stay NaN, so any read past the prefix poisons the output.
    """
    g = torch.Generator().manual_seed(seed)
    # +1: a padding entry per row
    max_blocks = max(1, max(-(-p // block_size) for p in prefix_lens) + 1)
    num_blocks = 4 * len(prefix_lens) * max_blocks  # a pool larger than needed
    k_cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"))  # num_blocks, bs, Hkv, D
    v_cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"))
    block_tables = torch.randperm(num_blocks, generator=g)[: len(prefix_lens) * max_blocks]
    block_tables = block_tables.view(len(prefix_lens), max_blocks).to(torch.int32)  # B, max_blocks
    prefixes = []
    for b, P in enumerate(prefix_lens):
        pk = torch.randn(P, Hkv, D, generator=g)  # P, Hkv, D
        pv = torch.randn(P, Hkv, D, generator=g)
        t = torch.arange(P)  # P
        slots = block_tables[b, t // block_size].long() * block_size + t % block_size  # P
        k_cache.view(-1, Hkv, D)[slots] = pk
        v_cache.view(-1, Hkv, D)[slots] = pv
        prefixes.append((pk.to(dtype), pv.to(dtype)))
    ctx = torch.tensor(prefix_lens, dtype=torch.int32)  # B
    return (k_cache.to(device, dtype), v_cache.to(device, dtype), block_tables.to(device),
            ctx.to(device),
            prefixes)


def _sdpa_oracle(q, k, v, cu_q, cu_k, causal, prefixes=None, gqa_repeat=None, window=None):
    """Per sequence F.scaled_dot_product_attention in fp32 with a bottom-right causal mask (and a
    sliding window: key j hidden from the query at p when j ≤ p − window)."""
    out = torch.zeros(q.shape, dtype=torch.float32)  # total_q, H, D
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    H, Hkv = q.shape[1], k.shape[1]
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].float().cpu()  # Lq, H, D
        kb = k[cu_k[b]:cu_k[b + 1]].float().cpu()  # Lk, Hkv, D
        vb = v[cu_k[b]:cu_k[b + 1]].float().cpu()
        if prefixes is not None:
            kb = torch.cat([prefixes[b][0].float(), kb])  # S, Hkv, D
            vb = torch.cat([prefixes[b][1].float(), vb])
        Lq, S = qb.shape[0], kb.shape[0]
        if Lq == 0:
            continue
        if gqa_repeat is not None:  # negative control: a wrong head mapping
            kb, vb = gqa_repeat(kb, H // Hkv), gqa_repeat(vb, H // Hkv)  # S, H, D
        mask = None
        if causal:  # query i at position S - Lq + i sees keys 0..S - Lq + i
            mask = torch.arange(S)[None, :] <= torch.arange(S - Lq, S)[:, None]  # Lq, S
            if window:
                mask &= torch.arange(S)[None, :] > torch.arange(S - Lq, S)[:, None] - window
        o = F.scaled_dot_product_attention(qb.transpose(0, 1), kb.transpose(0, 1),
                                           vb.transpose(0, 1),
                                           attn_mask=mask, enable_gqa=kb.shape[1] != H)  # H, Lq, D
        out[cu_q[b]:cu_q[b + 1]] = o.transpose(0, 1)  # Lq, H, D
    return out


def _err(a: torch.Tensor, b: torch.Tensor, scaled: bool = False) -> float:
    """max |a - b| in fp32 (divided by 1 + |b| when scaled); NaN anywhere gives NaN, failing every
    `err <= tol`."""
    diff = (a.float().cpu() - b.float().cpu()).abs()
    if scaled:
        diff = diff / (1 + b.float().cpu().abs())
    return float("nan") if diff.isnan().any() else diff.max().item() if diff.numel() else 0.0


def _wrong(err: float) -> bool:
    return math.isnan(err) or err > 1e-2


# ----------------------------------------------------------------------------- agreement
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_varlen_fp32(causal, group, D):
    """4 packed sequences of lengths 1, 7, 17, 33 (tile 16), H = 4, GQA ratios 1/2/4."""
    q, k, v, cu_q, cu_k = _packed(LENS, LENS, 4, 4 // group, D, seed=group * D + causal)
    out = flash_attention(q, k, v, cu_q, cu_k, causal=causal)  # total, H, D
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _err(out, flash_attention_ref(q, k, v, cu_q, cu_k, causal=causal)) <= FP32_TOL
    assert _err(out, _sdpa_oracle(q, k, v, cu_q, cu_k, causal)) <= FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_half_precision_inputs(dtype, D):
    """fp16: atol 1e-2 (measured ~1e-3). bf16 keeps 8 mantissa bits, so an output near 4 can differ
    by one ulp, 1.6e-2, on rounding alone; scaled by 1 + |expected| one ulp is < 2^-7 (measured
    ~5e-3)."""
    q, k, v, cu_q, cu_k = _packed([7, 33], [7, 33], 4, 2, D, dtype=dtype, seed=D)
    out = flash_attention(q, k, v, cu_q, cu_k)  # total, H, D
    assert out.dtype == dtype
    scaled = dtype == torch.bfloat16
    assert _err(out, flash_attention_ref(q, k, v, cu_q, cu_k), scaled) <= 1e-2
    assert _err(out, _sdpa_oracle(q, k, v, cu_q, cu_k, True), scaled) <= 1e-2


def test_bottom_right_alignment():
    """Lq < Lk: the queries are the last Lq tokens and see every key before them.

    Lq = 16, Lk = 17: query 15 (the last row of its tile) sees key 16, the first key of the next
    key tile — the case that catches an off-by-one in the causal loop bound.
    """
    lens_q, lens_k = [5, 1, 16, 3], [12, 9, 17, 40]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 64, seed=3)
    out = flash_attention(q, k, v, cu_q, cu_k)  # total_q, H, D
    assert _err(out, flash_attention_ref(q, k, v, cu_q, cu_k)) <= FP32_TOL
    assert _err(out, _sdpa_oracle(q, k, v, cu_q, cu_k, True)) <= FP32_TOL


@pytest.mark.parametrize("prefix_lens", [None, [5, 3]])
def test_more_queries_than_keys_gives_zero_rows(prefix_lens):
    """Lq > P + Lk: query i sits at position P + Lk - Lq + i, negative for the first rows, which see
    no key.

    With a prefix, the next rows see only part of it: the causal mask applies to prefix keys too.
    """
    q, k, v, cu_q, cu_k = _packed([20, 4], [6, 4], 2, 1, 64, seed=4)
    paged = {}
    if prefix_lens:
        kc, vc, bt, ctx, _ = _paged_prefix(prefix_lens, 1, 64, block_size=4)
        paged = dict(block_tables=bt, k_cache=kc, v_cache=vc, context_lens=ctx)
    out = flash_attention(q, k, v, cu_q, cu_k, **paged)  # total_q, H, D
    assert _err(out, flash_attention_ref(q, k, v, cu_q, cu_k, **paged)) <= FP32_TOL
    blind = 20 - 6 - (prefix_lens[0] if prefix_lens else 0)  # rows with nothing to attend to
    assert torch.equal(out[:blind], torch.zeros_like(out[:blind]))
    assert out[blind:20].abs().amax() > 0.1


def test_strided_views_and_odd_head_dim():
    """q, k, v as views into one fused qkv buffer (non-contiguous), head_dim 80 (BLOCK_D 128,
    masked).

    The buffer's columns 80..127 hold NaN: a load that forgets the head-dim mask poisons the output.
    """
    H, Hkv, D = 4, 2, 80
    qkv = torch.full((sum(LENS), H + 2 * Hkv, 128), float("nan"))  # total, H+2Hkv, 128
    qkv[..., :D] = torch.randn(sum(LENS), H + 2 * Hkv, D,
                               generator=torch.Generator().manual_seed(5))
    q, k, v = qkv[..., :D].split([H, Hkv, Hkv], dim=1)  # total, H|Hkv|Hkv, D
    cu = _cu(LENS)
    assert not q.is_contiguous()
    out = flash_attention(q, k, v, cu, cu)  # total, H, D
    assert _err(out, _sdpa_oracle(q, k, v, cu, cu, True)) <= FP32_TOL


def test_empty_sequence_in_batch():
    """A sequence with no new tokens (and a prefix) runs no program and disturbs no neighbour."""
    q, k, v, cu_q, cu_k = _packed([3, 0, 9], [3, 0, 9], 2, 2, 64, seed=6)
    kc, vc, bt, ctx, prefixes = _paged_prefix([2, 5, 0], 2, 64, block_size=4)
    out = flash_attention(q, k, v, cu_q, cu_k, True, None, bt, kc, vc, ctx)  # total_q, H, D
    assert _err(out, _sdpa_oracle(q, k, v, cu_q, cu_k, True, prefixes)) <= FP32_TOL


# ----------------------------------------------------------------------------- paged prefix
@pytest.mark.parametrize("block_size, group, D", [(4, 2, 64), (16, 1, 128), (32, 4, 64)])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_prefix(causal, block_size, group, D):
    """Prefix lengths 0, bs-1, bs, bs+1 from a NaN-poisoned pool, then 5, 1, 17, 8 new tokens."""
    prefix_lens = [0, block_size - 1, block_size, block_size + 1]
    new_lens = [5, 1, 17, 8]
    Hkv = 4 // group
    q, k, v, cu_q, cu_k = _packed(new_lens, new_lens, 4, Hkv, D, seed=block_size)
    kc, vc, bt, ctx, prefixes = _paged_prefix(prefix_lens, Hkv, D, block_size)
    out = flash_attention(q, k, v, cu_q, cu_k, causal, None, bt, kc, vc, ctx)  # total_q, H, D
    assert torch.isfinite(out).all()  # nothing read from a poisoned slot
    assert _err(out,
                flash_attention_ref(q, k, v, cu_q, cu_k, causal, None, bt, kc, vc, ctx)) <= FP32_TOL
    assert _err(out, _sdpa_oracle(q, k, v, cu_q, cu_k, causal, prefixes)) <= FP32_TOL


def test_paged_prefix_fp16_wide_tiles():
    """fp16 cache and a 32-wide key tile spanning eight 4-token blocks."""
    new_lens, prefix_lens = [9, 2], [37, 3]
    q, k, v, cu_q, cu_k = _packed(new_lens, new_lens, 4, 2, 64, dtype=torch.float16, seed=7)
    kc, vc, bt, ctx, prefixes = _paged_prefix(prefix_lens, 2, 64, block_size=4, dtype=torch.float16)
    out = flash_attention(q, k, v, cu_q, cu_k, True, None, bt, kc, vc, ctx, block_m=16, block_n=32)
    assert _err(out, _sdpa_oracle(q, k, v, cu_q, cu_k, True, prefixes)) <= 1e-2


def test_prefix_equals_packing_it_with_the_new_tokens():
    """Chunked prefill is exact: prefix-from-cache + new == the whole sequence attended in one
    call."""
    P, T, Hkv, D = 19, 14, 2, 64
    kc, vc, bt, ctx, prefixes = _paged_prefix([P], Hkv, D, block_size=8)
    q, k, v, cu_q, cu_k = _packed([T], [T], 4, Hkv, D, seed=8)
    chunked = flash_attention(q, k, v, cu_q, cu_k, True, None, bt, kc, vc, ctx)  # T, H, D
    k_all, v_all = torch.cat([prefixes[0][0], k]), torch.cat([prefixes[0][1], v])  # P+T, Hkv, D
    # T, H, D (bottom-right: last T of P+T)
    whole = flash_attention(q, k_all, v_all, cu_q, _cu([P + T]))
    assert _err(chunked, whole) <= FP32_TOL


# one key; under, at and over a block; past every length
@pytest.mark.parametrize("window", [1, 3, 4, 9, 64])
def test_sliding_window_with_paged_prefix(window):
    """Each query sees its `window` newest keys, across the prefix and the new tokens. Blocks wholly
    before the first query's window are NaN (the engine frees them): both loops must start past
    them."""
    prefix_lens, new_lens, bs = [0, 3, 4, 13, 21], [5, 1, 17, 8, 2], 4
    q, k, v, cu_q, cu_k = _packed(new_lens, new_lens, 4, 2, 64, seed=5)
    kc, vc, bt, ctx, prefixes = _paged_prefix(prefix_lens, 2, 64, bs)
    want = _sdpa_oracle(q, k, v, cu_q, cu_k, True, prefixes, window=window)
    for b, P in enumerate(prefix_lens):
        # before the first query's window
        kc[bt[b, :max(P - window + 1, 0) // bs].long()] = float("nan")
    out = flash_attention(q, k, v, cu_q, cu_k, True, None, bt, kc, vc, ctx, window=window)
    assert _err(out, want) <= FP32_TOL
    assert _err(flash_attention_ref(q, k, v, cu_q, cu_k, True, None, bt, kc, vc, ctx,
                                    window=window), want) <= FP32_TOL
    # negative control: without the window the kernel reads the freed blocks (NaN) or too far back
    if window < 9:
        assert _wrong(_err(flash_attention(q, k, v, cu_q, cu_k, True, None, bt, kc, vc, ctx), want))
    with pytest.raises(ValueError, match="window=3 needs causal=True"):
        flash_attention(q, k, v, cu_q, cu_k, False, window=3)


@pytest.mark.parametrize("softcap", [0.5, 50.0])
def test_soft_capped_scores_with_paged_prefix(softcap):
    """Gemma 2: scores x -> c·tanh(x / c), with a custom scale and a window; checked against the
    reference and against SDPA given the capped scores as an additive mask (q·k·0 + capped scores:
    an oracle with no tanh of ours). Negative control: the uncapped kernel differs."""
    prefix_lens, new_lens, bs = [0, 5, 13], [6, 1, 9], 4
    q, k, v, cu_q, cu_k = _packed(new_lens, new_lens, 4, 2, 64, seed=9)
    q = q * 4
    kc, vc, bt, ctx, prefixes = _paged_prefix(prefix_lens, 2, 64, bs)
    out = flash_attention(q, k, v, cu_q, cu_k, True, 0.2, bt, kc, vc, ctx, window=7,
                          softcap=softcap)
    want = flash_attention_ref(q, k, v, cu_q, cu_k, True, 0.2, bt, kc, vc, ctx, window=7,
                               softcap=softcap)
    assert _err(out, want) <= FP32_TOL
    for b, (P, n) in enumerate(zip(prefix_lens, new_lens)):  # the oracle: SDPA over capped scores
        qb = q[cu_q[b]:cu_q[b + 1]].float().transpose(0, 1)  # H, n, D
        kb = (
            torch.cat([prefixes[b][0], k[cu_k[b] : cu_k[b + 1]]]) .float() .repeat_interleave(2, 1)
            .transpose(0, 1)
        )
        vb = (
            torch.cat([prefixes[b][1], v[cu_k[b] : cu_k[b + 1]]]) .float() .repeat_interleave(2, 1)
            .transpose(0, 1)
        )
        x = qb @ kb.transpose(1, 2) * 0.2  # H, n, P + n
        kpos, qpos = torch.arange(P + n)[None, :], torch.arange(P, P + n)[:, None]
        bias = (softcap * torch.tanh(x / softcap)).masked_fill(
            ~((kpos <= qpos) & (kpos > qpos - 7)), float("-inf")
        )
        o = F.scaled_dot_product_attention(qb * 0, kb, vb, attn_mask=bias)  # H, n, D
        assert _err(out[cu_q[b]:cu_q[b + 1]], o.transpose(0, 1)) <= FP32_TOL
    assert _wrong(
        _err(flash_attention(q, k, v, cu_q, cu_k, True, 0.2, bt, kc, vc, ctx, window=7), want)
    )


# ----------------------------------------------------------------------------- negative controls
def test_negative_control_missing_causal_mask():
    q, k, v, cu_q, cu_k = _packed(LENS, LENS, 4, 2, 64, seed=9)
    wrong = flash_attention(q, k, v, cu_q, cu_k, causal=False)  # total, H, D
    assert _wrong(_err(wrong, flash_attention_ref(q, k, v, cu_q, cu_k, causal=True)))
    assert _wrong(_err(wrong, _sdpa_oracle(q, k, v, cu_q, cu_k, True)))


@pytest.mark.parametrize("delta", [-1, 1])
def test_negative_control_off_by_one_prefix(delta):
    """context_lens off by one: one key too few (drops a real key) or one too many (reads a poisoned
    slot)."""
    prefix_lens = [7, 8, 9]
    q, k, v, cu_q, cu_k = _packed([3, 5, 2], [3, 5, 2], 2, 1, 64, seed=10)
    kc, vc, bt, ctx, prefixes = _paged_prefix(prefix_lens, 1, 64, block_size=8)
    # total_q, H, D
    wrong = flash_attention(q, k, v, cu_q, cu_k, True, None, bt, kc, vc, ctx + delta)
    assert _wrong(_err(wrong, _sdpa_oracle(q, k, v, cu_q, cu_k, True, prefixes)))


@pytest.mark.parametrize("variant", ["other_sequence_block", "swap_with_partial_block"])
def test_negative_control_wrong_block_table(variant):
    """A wrong table entry must be seen.

    (Swapping two *full* blocks of one prefix would not be: with every prefix key visible,
    attention is a sum over keys and ignores their order — positions enter only through RoPE,
    applied before k reaches the cache, and through the causal mask.)
    """
    q, k, v, cu_q, cu_k = _packed([4, 3], [4, 3], 2, 2, 64, seed=11)
    kc, vc, bt, ctx, prefixes = _paged_prefix([20, 16], 2, 64, block_size=8)
    bt_wrong = bt.clone()
    if variant == "other_sequence_block":  # real data, wrong sequence: finite but wrong
        bt_wrong[0, 1] = bt[1, 0]
    else:  # full block 1 <-> block 2 holding 4 tokens: slots 20..23 of the prefix are NaN
        bt_wrong[0, [1, 2]] = bt[0, [2, 1]]
    wrong = flash_attention(q, k, v, cu_q, cu_k, True, None, bt_wrong, kc, vc, ctx)  # 7, H, D
    assert _wrong(_err(wrong, _sdpa_oracle(q, k, v, cu_q, cu_k, True, prefixes)))


def test_negative_control_wrong_gqa_mapping():
    """Head h must read kv head h // group (repeat_interleave), not h % Hkv (repeat)."""
    q, k, v, cu_q, cu_k = _packed([17], [17], 4, 2, 64, seed=12)
    out = flash_attention(q, k, v, cu_q, cu_k)  # 17, H, D
    tiled = _sdpa_oracle(q, k, v, cu_q, cu_k, True, gqa_repeat=lambda t, g: t.repeat(1, g, 1))
    assert _wrong(_err(out, tiled))


# ----------------------------------------------------------------------------- validation
def _valid_args():
    q, k, v, cu_q, cu_k = _packed([3, 4], [3, 4], 4, 2, 16)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(k=a["k"][:, :1].repeat(1, 3, 1), v=a["v"][:, :1].repeat(1, 3, 1)),
     "multiple of kv heads"),
    (lambda a: a.update(q=a["q"].half()), "share one dtype"),
    (lambda a: a.update(q=a["q"][None]), r"\[tokens, heads, head_dim\]"),
    (lambda a: a.update(v=a["v"][:, :, :8]), "shapes differ"),
    (lambda a: a.update(cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32)),
     "rise from 0 to 7"),
    (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"].float()), "int32"),
    (lambda a: a.update(block_tables=torch.zeros(2, 1, dtype=torch.int32)), "needs all of"),
])
def test_validation(change, message):
    args = _valid_args()
    change(args)
    with pytest.raises(ValueError, match=message):
        flash_attention(**args)


def test_validation_prefix_longer_than_table():
    args = _valid_args()
    kc, vc, bt, ctx, _ = _paged_prefix([3, 4], 2, 16, block_size=4)
    with pytest.raises(ValueError, match="context_lens"):
        flash_attention(**args, block_tables=bt, k_cache=kc, v_cache=vc,
                        context_lens=ctx + bt.shape[1] * 4)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_m, block_n", [(64, 64), (128, 64)])
def test_gpu_bf16_large_tiles(block_m, block_n):
    """Compiled kernel, bf16 (tensor-core dots, p rounded to bf16 before p·v), long packed
    sequences."""
    lens, prefix_lens = [1, 100, 257, 513], [0, 15, 16, 300]
    q, k, v, cu_q, cu_k = _packed(lens, lens, 8, 2, 128, dtype=torch.bfloat16, seed=13,
                                  device="cuda")
    kc, vc, bt, ctx, prefixes = _paged_prefix(prefix_lens, 2, 128, block_size=16,
                                              dtype=torch.bfloat16,
                                              device="cuda")
    for kw in ({}, dict(block_tables=bt, k_cache=kc, v_cache=vc, context_lens=ctx)):
        # total, H, D
        out = flash_attention(q, k, v, cu_q, cu_k, block_m=block_m, block_n=block_n, **kw)
        torch.cuda.synchronize()
        assert _err(out, flash_attention_ref(q, k, v, cu_q, cu_k, **kw), scaled=True) <= 2e-2
        assert _err(out, _sdpa_oracle(q, k, v, cu_q, cu_k, True, prefixes if kw else None),
                    scaled=True) <= 2e-2
