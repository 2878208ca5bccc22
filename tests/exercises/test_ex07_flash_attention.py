"""Exercise 7: a FlashAttention kernel in Triton (nanoserve/kernels/flash_attention.py:
flash_attention).

Oracles: torch's scaled_dot_product_attention, one sequence at a time with an explicit bottom-right
causal mask and kv heads repeated for GQA (not our code), and for the paged prefix also the
package's flash_attention_ref. The SDPA oracle never sees the paged pool: it gets each prefix in
logical order, as the test wrote it into scattered blocks of a NaN-filled pool. Tolerances
(docs/TESTING.md §D): fp32 ≤ 1e-4, since the kernel and torch add the same fp32 products in
different orders (the reference lands near 1e-6); fp16 inputs 1e-2 (both compute in fp32; the gap is
the output's rounding to 11 bits). Lengths are mostly not multiples of the 16-wide interpreter tile
(16 itself fills one tile exactly), and 33 spans three tiles.

Known-wrong variants at the end: one small Triton kernel in this file whose flags switch one bug on
(no causal mask, an unmasked diagonal tile, no rescaling of the accumulator, GQA heads tiled,
top-left alignment); for the paged prefix, the reference fed a prefix one slot too long or a block
table read one entry off. Each must fail the checks that guard it; the kernel with every flag right,
and the reference handed the right prefix, pass them all.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from explain import expect, expect_close, explained_failure
from nanoserve.kernels.flash_attention import flash_attention as reference_flash_attention
from nanoserve.kernels.flash_attention import flash_attention_ref

REFERENCE = "nanoserve.kernels.flash_attention"
EXERCISE = "flash_attention"
pytestmark = pytest.mark.ex07

FP32_TOL = 1e-4
FP16_TOL = 1e-2


# ----------------------------------------------------------------------------- inputs and the
# oracle
def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # B+1


def _packed(lens_q, lens_k, H, Hkv, D=16, dtype=torch.float32, seed=0):
    """Random packed q [Σlq, H, D], k, v [Σlk, Hkv, D] and their cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), H, D, generator=g).to(dtype)  # total_q, H, D
    k = torch.randn(sum(lens_k), Hkv, D, generator=g).to(dtype)  # total_k, Hkv, D
    v = torch.randn(sum(lens_k), Hkv, D, generator=g).to(dtype)  # total_k, Hkv, D
    return q, k, v, _cu(lens_q), _cu(lens_k)


def _paged_prefix(prefix_lens, Hkv, D, block_size, seed=1):
    """A NaN-filled pool with each sequence's prefix written through a random block table.

    Returns (paged kwargs, prefixes) with prefixes[b] = (k, v) [P, Hkv, D] in logical order. Slots
    past P (the rest of the last block, unused blocks, one padding entry per table row) stay NaN.
    """
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-p // block_size) for p in prefix_lens) + 1  # +1: a padding entry per row
    num_blocks = 4 * len(prefix_lens) * max_blocks  # a pool larger than needed
    # num_blocks, block_size, Hkv, D
    k_cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"))
    v_cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"))
    tables = torch.randperm(num_blocks, generator=g)[: len(prefix_lens) * max_blocks]
    tables = tables.view(len(prefix_lens), max_blocks).to(torch.int32)  # B, max_blocks
    prefixes = []
    for b, P in enumerate(prefix_lens):
        pk, pv = torch.randn(2, P, Hkv, D, generator=g).unbind(0)  # P, Hkv, D each
        t = torch.arange(P)  # P
        slots = tables[b, t // block_size].long() * block_size + t % block_size  # P
        k_cache.view(-1, Hkv, D)[slots] = pk
        v_cache.view(-1, Hkv, D)[slots] = pv
        prefixes.append((pk, pv))
    paged = dict(block_tables=tables, k_cache=k_cache, v_cache=v_cache,
                 context_lens=torch.tensor(prefix_lens, dtype=torch.int32))
    return paged, prefixes


def _sdpa(q, k, v, cu_q, cu_k, causal=True, prefixes=None):
    """Per sequence F.scaled_dot_product_attention in fp32; query i of Lq sees keys 0 .. S − Lq +
    i."""
    out = torch.zeros(q.shape)  # total_q, H, D
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].float()  # Lq, H, D
        kb, vb = k[cu_k[b]:cu_k[b + 1]].float(), v[cu_k[b]:cu_k[b + 1]].float()  # Lk, Hkv, D
        if prefixes is not None:
            kb, vb = torch.cat([prefixes[b][0], kb]), torch.cat([prefixes[b][1], vb])  # S, Hkv, D
        Lq, S = qb.shape[0], kb.shape[0]
        if Lq == 0:
            continue
        kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)  # S, H, D
        # Lq, S
        mask = torch.arange(S)[None, :] <= torch.arange(S - Lq, S)[:, None] if causal else None
        o = F.scaled_dot_product_attention(qb.transpose(0, 1), kb.transpose(0, 1),
                                           vb.transpose(0, 1),
                                           attn_mask=mask)  # H, Lq, D
        out[cu_q[b]:cu_q[b + 1]] = o.transpose(0, 1)
    return out


# ----------------------------------------------------------------------------- checks (shared with
# the variants)
THD = "token, head, d"  # how a failure names an element of an output


def check_one_sequence(impl, L=33, causal=True, H=2):
    q, k, v, cu_q, cu_k = _packed([L], [L], H, H, seed=L + causal)
    out = impl.flash_attention(q, k, v, cu_q, cu_k, causal=causal)  # L, H, D
    case = f"flash_attention(one sequence of {L} tokens, {H} heads, causal={causal}) against SDPA"
    expect(out.dtype == q.dtype, case, q.dtype, out.dtype)
    expect_close(out, _sdpa(q, k, v, cu_q, cu_k, causal), case, atol=FP32_TOL, dims=THD)


def check_half_precision(impl):
    q, k, v, cu_q, cu_k = _packed([33], [33], 2, 2, dtype=torch.float16, seed=2)
    out = impl.flash_attention(q, k, v, cu_q, cu_k)  # 33, H, D
    case = "flash_attention(one float16 sequence of 33 tokens) against SDPA"
    expect(out.dtype == torch.float16, case, torch.float16, out.dtype)
    expect_close(out, _sdpa(q, k, v, cu_q, cu_k), case, atol=FP16_TOL, dims=THD)


def check_gqa(impl, group=2, causal=True):
    """H = 4 query heads over 4 // group kv heads: head h reads kv head h // group."""
    q, k, v, cu_q, cu_k = _packed([33], [33], 4, 4 // group, seed=10 + group)
    out = impl.flash_attention(q, k, v, cu_q, cu_k, causal=causal)  # 33, H, D
    expect_close(out, _sdpa(q, k, v, cu_q, cu_k, causal), f"flash_attention(33 tokens, 4 query "
                 f"heads over {4 // group} kv heads, causal={causal}) against SDPA",
                 atol=FP32_TOL, dims=THD)


def check_packed(impl, causal=True):
    """Five sequences back to back, one of them empty, GQA 4:2."""
    lens = [1, 7, 0, 17, 33]
    q, k, v, cu_q, cu_k = _packed(lens, lens, 4, 2, seed=20 + causal)
    out = impl.flash_attention(q, k, v, cu_q, cu_k, causal=causal)  # total, H, D
    expect_close(out, _sdpa(q, k, v, cu_q, cu_k, causal), f"flash_attention(sequences of {lens} "
                 f"tokens packed, 4 heads over 2, causal={causal}) against SDPA", atol=FP32_TOL,
                 dims=THD)


def check_bottom_right(impl):
    """Lq < Lk: the queries are the last Lq tokens. Lq = 16, Lk = 17: the last query of the tile
    sees key 16, the first key of the next key tile (an off-by-one in the causal loop bound drops
    it)."""
    q, k, v, cu_q, cu_k = _packed([5, 1, 16, 3], [12, 9, 17, 40], 4, 2, seed=30)
    out = impl.flash_attention(q, k, v, cu_q, cu_k)  # total_q, H, D
    expect_close(out, _sdpa(q, k, v, cu_q, cu_k), "flash_attention(queries [5, 1, 16, 3] over keys "
                 "[12, 9, 17, 40]: the queries are the last tokens) against SDPA", atol=FP32_TOL,
                 dims=THD)


def check_strided_views(impl):
    """q, k, v as views of one fused qkv buffer (rows of 32), head dim 24: columns 24..31 hold NaN,
    so a head-dim load without its mask poisons the output."""
    H, Hkv, D, lens = 4, 2, 24, [7, 17]
    qkv = torch.full((sum(lens), H + 2 * Hkv, 32), float("nan"))  # total, H + 2·Hkv, 32
    qkv[..., :D] = torch.randn(sum(lens), H + 2 * Hkv, D,
                               generator=torch.Generator().manual_seed(40))
    q, k, v = qkv[..., :D].split([H, Hkv, Hkv], dim=1)  # total, H | Hkv | Hkv, D   (not contiguous)
    cu = _cu(lens)
    out = impl.flash_attention(q, k, v, cu, cu)  # total, H, D
    expect_close(out, _sdpa(q, k, v, cu, cu), "flash_attention(q, k, v as strided views of one qkv "
                 "buffer, head dim 24 with NaN in columns 24..31) against SDPA", atol=FP32_TOL,
                 dims=THD)


def check_paged_prefix(impl, block_size=4, causal=True):
    """Prefixes of 0, bs − 1, bs and bs + 1 tokens in a NaN-poisoned pool, then 5, 1, 17 and 8 new
    tokens."""
    new_lens = [5, 1, 17, 8]
    q, k, v, cu_q, cu_k = _packed(new_lens, new_lens, 4, 2, seed=50 + block_size)
    paged, prefixes = _paged_prefix(
        [0, block_size - 1, block_size, block_size + 1], 2, 16, block_size
    )
    out = impl.flash_attention(q, k, v, cu_q, cu_k, causal, None, **paged)  # total_q, H, D
    case = (f"flash_attention(new tokens {new_lens} after paged prefixes of 0, {block_size - 1}, "
            f"{block_size}, {block_size + 1} in a NaN-poisoned pool, blocks of {block_size})")
    expect_close(out, _sdpa(q, k, v, cu_q, cu_k, causal, prefixes), f"{case} against SDPA "
                 "(a NaN: a slot past a prefix was read)", atol=FP32_TOL, dims=THD)
    expect_close(out, flash_attention_ref(q, k, v, cu_q, cu_k, causal, None, **paged),
                 f"{case} against flash_attention_ref", atol=FP32_TOL, dims=THD)


def check_chunked_prefill(impl):
    """A 37-token prompt prefilled in chunks of 13, 16 and 8 (block size 8): each chunk attends to
    the cache written by the chunks before it, and the outputs together equal attention over the
    whole prompt."""
    T, Hkv, D, bs, chunks = 37, 2, 16, 8, [13, 16, 8]
    q, k, v, cu, _ = _packed([T], [T], 4, Hkv, seed=60)
    whole = _sdpa(q, k, v, cu, cu)  # T, H, D
    k_cache = torch.full((8, bs, Hkv, D), float("nan"))  # num_blocks, bs, Hkv, D
    v_cache = torch.full((8, bs, Hkv, D), float("nan"))
    # 1, max_blocks   scattered blocks
    table = torch.tensor([[6, 1, 4, 7, 2, 0]], dtype=torch.int32)
    outs, P = [], 0
    for n in chunks:
        new = slice(P, P + n)
        outs.append(impl.flash_attention(q[new], k[new], v[new], _cu([n]), _cu([n]), True, None, table,
                                         # n, H, D
                                         k_cache, v_cache, torch.tensor([P], dtype=torch.int32)))
        # write this chunk's keys into the cache, as the engine does after a step
        t = torch.arange(P, P + n)
        slots = table[0, t // bs].long() * bs + t % bs  # n
        k_cache.view(-1, Hkv, D)[slots], v_cache.view(-1, Hkv, D)[slots] = k[new], v[new]
        P += n
    expect_close(torch.cat(outs), whole, "a 37-token prompt prefilled in chunks of 13, 16 and 8 "
                 "over a paged cache, against attention over the whole prompt", atol=FP32_TOL,
                 dims=THD)


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("L", [1, 16, 33])
def test_ex07_1_one_sequence_causal_equals_sdpa(impl, L):
    check_one_sequence(impl, L)


def test_ex07_1_one_sequence_not_causal_equals_sdpa(impl):
    check_one_sequence(impl, 33, causal=False)


def test_ex07_1_half_precision_in_half_precision_out(impl):
    check_half_precision(impl)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_ex07_2_grouped_query_attention_equals_sdpa(impl, group):
    check_gqa(impl, group)


def test_ex07_2_grouped_query_attention_not_causal(impl):
    check_gqa(impl, 4, causal=False)


@pytest.mark.parametrize("causal", [True, False])
def test_ex07_3_packed_variable_lengths_equal_sdpa(impl, causal):
    check_packed(impl, causal)


def test_ex07_3_fewer_queries_than_keys_are_bottom_right_aligned(impl):
    check_bottom_right(impl)


def test_ex07_3_strided_views_and_head_dim_24(impl):
    check_strided_views(impl)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_ex07_4_paged_prefix_from_a_poisoned_pool(impl, causal, block_size):
    check_paged_prefix(impl, block_size, causal)


def test_ex07_4_chunked_prefill_equals_the_whole_prompt(impl):
    check_chunked_prefill(impl)


# ----------------------------------------------------------------------------- known-wrong variants
@triton.jit
def _variant_kernel(Q, K, V, O, cu_q, cu_k, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ot, stride_oh, qk_scale, H, group, head_dim,
                    CAUSAL: tl.constexpr, MASK: tl.constexpr, RESCALE: tl.constexpr,
                    HEADS: tl.constexpr,
                    ALIGN: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    # packed sequences, GQA, causal; no paged prefix. Head dims have stride 1 (the wrapper checks).
    start_m = tl.program_id(0) * BLOCK
    b, h = tl.program_id(1) // H, tl.program_id(1) % H
    kvh = h // group if HEADS == "grouped" else h % (H // group)  # "tiled": kv head h % Hkv
    q_start, k_start = tl.load(cu_q + b), tl.load(cu_k + b)
    Lq, Lk = tl.load(cu_q + b + 1) - q_start, tl.load(cu_k + b + 1) - k_start
    if start_m >= Lq:
        return
    offs_m = start_m + tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok, d_ok = offs_m < Lq, offs_d < head_dim  # BLOCK, BLOCK_D
    first = Lk - Lq if ALIGN == "bottom-right" else 0  # position of query 0 ("top-left": 0)
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # BLOCK, BLOCK_D
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)  # BLOCK
    l_i = tl.zeros([BLOCK], tl.float32)  # BLOCK
    acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)  # BLOCK, BLOCK_D
    hi = Lk
    if CAUSAL and MASK != "none":  # stop after the key tile holding the tile's last query
        hi = tl.minimum(Lk, first + start_m + BLOCK)
    for start_n in range(0, hi, BLOCK):
        j = start_n + offs_n  # BLOCK
        kv_mask = (j < Lk)[:, None] & d_ok[None, :]  # BLOCK, BLOCK_D
        k = tl.load(K + (k_start + j)[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)  # BLOCK, BLOCK_D
        v = tl.load(V + (k_start + j)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)  # BLOCK, BLOCK_D
        valid = (j < Lk)[None, :] & m_ok[:, None]  # BLOCK, BLOCK
        # MASK "diagonal" skips this: only the loop bound, the diagonal tile unmasked
        if CAUSAL and MASK == "full":
            valid = valid & (j[None, :] <= (first + offs_m)[:, None])
        # BLOCK, BLOCK   log2 units
        s = tl.where(valid, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # BLOCK
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past the end see no key
        alpha = tl.exp2(m_i - m_safe)  # BLOCK
        p = tl.exp2(s - m_safe[:, None])  # BLOCK, BLOCK
        l_i = l_i * alpha + tl.sum(p, 1)
        if RESCALE:
            acc = acc * alpha[:, None]
        acc = acc + tl.dot(p, v)  # BLOCK, BLOCK_D
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # BLOCK, BLOCK_D
    tl.store(O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _variant(mask="full", rescale=True, heads="grouped", align="bottom-right"):
    def flash_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True, sm_scale=None,
                        block_tables=None,
                        k_cache=None, v_cache=None, context_lens=None, *, block_m=None,
                        block_n=None):
        if block_tables is not None or not q.stride(2) == k.stride(2) == v.stride(2) == 1:
            # not an AssertionError
            raise ValueError("the variants take no paged prefix, and head dims of stride 1")
        H, D = q.shape[1:]
        out = torch.empty_like(q)  # total_q, H, D
        B = cu_seqlens_q.numel() - 1
        grid = (triton.cdiv(int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()), 16), B * H)
        _variant_kernel[grid](q, k, v, out, cu_seqlens_q, cu_seqlens_k, *q.stride()[:2],
                              *k.stride()[:2],
                              *v.stride()[:2], *out.stride()[:2], math.log2(math.e) / math.sqrt(D),
                              H, H // k.shape[1], D, CAUSAL=causal, MASK=mask, RESCALE=rescale,
                              HEADS=heads,
                              ALIGN=align, BLOCK=16, BLOCK_D=max(16, triton.next_power_of_2(D)))
        return out
    return SimpleNamespace(flash_attention=flash_attention)


def _misread_prefix(wrong_lens=lambda c: c, wrong_table=lambda t: t):
    """The reference kernel handed a wrong prefix length or block table: what a kernel with that bug
    reads."""
    def flash_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True, sm_scale=None,
                        block_tables=None,
                        k_cache=None, v_cache=None, context_lens=None, **tiles):
        return reference_flash_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, sm_scale,
                                         wrong_table(block_tables), k_cache, v_cache,
                                         wrong_lens(context_lens), **tiles)
    return SimpleNamespace(flash_attention=flash_attention)


WRONG = {
    "no causal mask": (_variant(mask="none"), [check_one_sequence, check_gqa]),
    # right below the diagonal, wrong on it: every causal check has a diagonal tile
    "loop stops at the diagonal tile, which goes "
    "unmasked": (_variant(mask="diagonal"), [check_one_sequence]),
    "accumulator not rescaled when the max grows": (_variant(rescale=False),
                                                    [check_one_sequence, check_packed]),
    "GQA heads tiled (h % Hkv), not grouped": (_variant(heads="tiled"), [check_gqa]),
    # passes every check with Lq = Lk: only fewer queries than keys show it
    "causal mask aligned top-left": (_variant(align="top-left"), [check_bottom_right]),
    # a kernel that reads t <= P, one slot too many: the NaN behind each prefix leaks in
    "prefix one token too long": (_misread_prefix(wrong_lens=lambda c: c + 1),
                                  [check_paged_prefix]),
    # a kernel that reads block_tables[b, t // block_size + 1]: the next block, or the NaN padding
    # entry
    "block index off by one": (_misread_prefix(wrong_table=lambda t: t.roll(-1, dims=1)),
                               [check_paged_prefix]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex07_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex07_the_checks_pass_on_a_right_variant_built_the_same_way():
    """The variants differ from these in one flag or one argument each, so their failures are that
    place's."""
    right = _variant()
    for check in (check_one_sequence, check_half_precision, check_gqa, check_packed,
                  check_bottom_right,
                  check_strided_views):
        check(right)
    check_paged_prefix(_misread_prefix())
