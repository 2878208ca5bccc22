"""Paged decode attention and store_kv against plain torch and SDPA (docs/TESTING.md §D).

Each sequence's blocks are drawn at random from a much larger pool whose every other slot
(unused blocks, the unused tail of each last block, the table's padding columns) is NaN: a
kernel that reads one slot too many returns NaN. The oracle is independent of the module's
reference: gather through the table, then F.scaled_dot_product_attention(enable_gqa=True).
Split-KV runs with split counts that do not divide the length, one split, and more splits than
tiles (empty tail splits). Negative controls: a block table shifted by one block and a merge
that ignores the LSE weights must both miss by a wide margin. Runs in Triton's interpreter
without CUDA (conftest sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from nanoserve.kernels.paged_attention import (
    paged_attention,
    paged_attention_ref,
    paged_attention_split,
)
from nanoserve.kernels.split_kv import BLOCK_N, choose_num_splits, merge_splits, merge_splits_ref
from nanoserve.kernels.store_kv import store_kv, store_kv_ref

BS = 8  # page size: lengths 1, BS−1, BS, BS+1 and 100 cross many page and tile (BLOCK_N) boundaries
LENS = [1, BS - 1, BS, BS + 1, 100]
POOL = 64  # blocks in the pool; the batch above uses 18 of them
H = 4  # query heads


def _paged_cache(
    lens, n_kv_heads, head_dim, dtype=torch.float32, index_dtype=torch.int32, seed=0, n_heads=H
):
    """q and NaN-poisoned pools holding random K/V for `lens` tokens per sequence at random
    blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in lens]
    width = max(need) + 1  # one padding column at least
    pool = max(POOL, 2 * sum(need))  # at least half the pool stays unused (NaN)
    perm = torch.randperm(pool, generator=g)
    used, spare = perm[: sum(need)].split(need), perm[sum(need):]  # spare blocks stay NaN
    # padding → poisoned blocks
    table = spare[torch.randint(len(spare), (len(lens), width), generator=g)]
    for b, blocks in enumerate(used):
        table[b, : len(blocks)] = blocks
    k_cache = torch.full((pool, BS, n_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[b, pos // BS] * BS + pos % BS  # n
        k_cache.view(-1, n_kv_heads, head_dim)[slots] = torch.randn(
            n, n_kv_heads, head_dim, generator=g
        ).to(dtype)
        v_cache.view(-1, n_kv_heads, head_dim)[slots] = torch.randn(
            n, n_kv_heads, head_dim, generator=g
        ).to(dtype)
    q = torch.randn(len(lens), n_heads, head_dim, generator=g).to(dtype)  # B, H, D
    return q, k_cache, v_cache, table.to(index_dtype), torch.tensor(lens, dtype=index_dtype)


def _sdpa_oracle(q, k_cache, v_cache, table, lens, scale=None, window=None):
    """Gather each sequence's K/V in logical order (its `window` newest only), then SDPA with
    enable_gqa (fp32)."""
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(max(n - window, 0) if window else 0, n)
        slots = table[b, pos // BS].long() * BS + pos % BS  # n
        k = k_cache.flatten(0, 1)[slots].float().transpose(0, 1)[None]  # 1, Hkv, n, D
        v = v_cache.flatten(0, 1)[slots].float().transpose(0, 1)[None]  # 1, Hkv, n, D
        qb = q[b].float()[None, :, None]  # 1, H, 1, D
        # H, D
        out.append(F.scaled_dot_product_attention(qb, k, v, scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(out)  # B, H, D


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


# ----------------------------------------------------------------------------- store_kv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_kv_heads,head_dim", [(2, 64), (3, 12)])
def test_store_kv_writes_real_tokens_only(dtype, n_kv_heads, head_dim):
    pools = [torch.full((POOL, BS, n_kv_heads, head_dim), float("nan"),
                        dtype=dtype) for _ in range(4)]
    slots = torch.tensor([17, -1, 3, 200, -1, 511, 64])  # −1: padding
    k = torch.randn(len(slots), n_kv_heads, head_dim).to(dtype)
    v = torch.randn(len(slots), n_kv_heads, head_dim).to(dtype)
    store_kv(k, v, pools[0], pools[1], slots)
    store_kv_ref(k, v, pools[2], pools[3], slots)
    for got, want in [(pools[0], pools[2]), (pools[1], pools[3])]:
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
        flat = got.flatten(0, 1)  # slots, Hkv, D
        assert not flat[slots[slots >= 0]].isnan().any()
        assert flat.isnan().all(dim=(1, 2)).sum() == POOL * BS - 5  # every other slot still NaN
    assert torch.equal(pools[0].flatten(0, 1)[511], k[5])


# ----------------------------------------------------------------------------- decode attention
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_paged_attention_fp32_matches_sdpa(group, head_dim):
    q, kc, vc, table, lens = _paged_cache(LENS, H // group, head_dim, seed=group)
    want = _sdpa_oracle(q, kc, vc, table, lens)
    out = paged_attention(q, kc, vc, table, lens)
    ref = paged_attention_ref(q, kc, vc, table, lens)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _err(out, want) <= 1e-4
    assert _err(ref, want) <= 1e-4


@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_attention_fp16_int64_tables(head_dim):
    q, kc, vc, table, lens = _paged_cache(LENS, 2, head_dim, dtype=torch.float16,
                                          index_dtype=torch.int64)
    want = _sdpa_oracle(q, kc, vc, table, lens)
    out = paged_attention(q, kc, vc, table, lens, num_splits=3)
    assert out.dtype == torch.float16
    assert _err(out, want) <= 1e-2
    assert _err(paged_attention_ref(q, kc, vc, table, lens), want) <= 1e-2


def test_odd_head_dim_and_group_with_custom_scale():
    """head_dim 12 and 3 query heads per kv head: both padded inside the kernel, masked on store."""
    q, kc, vc, table, lens = _paged_cache([BS + 3, 30], 1, 12, n_heads=3)
    want = _sdpa_oracle(q, kc, vc, table, lens, scale=0.3)
    assert _err(paged_attention(q, kc, vc, table, lens, sm_scale=0.3, num_splits=2), want) <= 1e-4


# ----------------------------------------------------------------------------- split-KV
# 3 divides no length; 16 > the 4 tiles of 100 keys
@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_split_kv_matches_sdpa_and_one_split(num_splits):
    q, kc, vc, table, lens = _paged_cache(LENS, 2, 64, seed=7)
    want = _sdpa_oracle(q, kc, vc, table, lens)
    one = paged_attention(q, kc, vc, table, lens, num_splits=1)
    out = paged_attention(q, kc, vc, table, lens, num_splits=num_splits)
    assert _err(out, want) <= 1e-4
    assert _err(out, one) <= 1e-5

    part, lse = paged_attention_split(q, kc, vc, table, lens, num_splits=num_splits)
    assert part.shape == (*q.shape[:2], num_splits, 64) and lse.shape == (*q.shape[:2], num_splits)
    for b, n in enumerate(LENS):  # splits past the context are neutral: lse −inf, output 0
        split_len = math.ceil(math.ceil(n / num_splits) / BLOCK_N) * BLOCK_N
        empty = torch.arange(num_splits) * split_len >= n
        assert torch.isneginf(lse[b][:, empty]).all() and torch.isfinite(lse[b][:, ~empty]).all()
        assert (part[b][:, empty] == 0).all()
    if num_splits == 16:
        assert torch.isneginf(lse[4, :, 4:]).all()  # 100 keys = 4 tiles: splits 4..15 are empty
    assert _err(merge_splits(part, lse), merge_splits_ref(part, lse)) <= 1e-6
    assert _err(merge_splits(part, lse), out) <= 1e-6


# one key; inside a page; a page; > every length
@pytest.mark.parametrize("window", [1, 5, BS, 3 * BS + 1, 200])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_sliding_window_reads_only_the_window(window, num_splits):
    """Each query sees its `window` newest keys. The blocks wholly before the window are NaN (the
    engine gives them back to the pool, another sequence may write them), so reading one would
    show."""
    q, kc, vc, table, lens = _paged_cache(LENS, 2, 64, seed=11)
    want = _sdpa_oracle(q, kc, vc, table, lens, window=window)
    for b, n in enumerate(LENS):
        # freed: before the window's first block
        kc[table[b, :max(n - window, 0) // BS].long()] = float("nan")
    out = paged_attention(q, kc, vc, table, lens, num_splits=num_splits, window=window)
    assert _err(out, want) <= 1e-4
    assert _err(paged_attention_ref(q, kc, vc, table, lens, window=window), want) <= 1e-5
    if window < 100:  # negative control: the same pools without the window read the freed blocks
        assert torch.isnan(paged_attention(q, kc, vc, table, lens, num_splits=num_splits)[-1]).any()


@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
def test_soft_capped_scores(softcap):
    """Gemma 2: scores x -> c·tanh(x / c) before the softmax, with its own scale and a window; the
    oracle caps scores it computed itself. Negative control: the uncapped kernel differs."""
    q, kc, vc, table, lens = _paged_cache(LENS, 2, 64, seed=13)
    q = q * 4  # scores of several units, where the cap bends them
    want = []
    for b, n in enumerate(LENS):
        pos = torch.arange(max(n - 9, 0), n)
        slots = table[b, pos // BS].long() * BS + pos % BS
        # L, H, D
        k, v = (c.flatten(0, 1)[slots].float().repeat_interleave(2, dim=1) for c in (kc, vc))
        x = torch.einsum("hd,lhd->hl", q[b].float(), k) * 0.2
        want.append(torch.einsum("hl,lhd->hd", (softcap * torch.tanh(x / softcap)).softmax(-1), v))
    want = torch.stack(want)  # B, H, D
    for splits in (1, 3):
        out = paged_attention(q, kc, vc, table, lens, sm_scale=0.2, num_splits=splits, window=9,
                              softcap=softcap)
        assert _err(out, want) <= 1e-4
    assert _err(paged_attention(q, kc, vc, table, lens, sm_scale=0.2, window=9), want) > 1e-3


# ----------------------------------------------------------------------------- negative controls
def test_shifted_block_table_is_caught():
    """A table off by one block (logical block i reads the page of block i + 1) must miss by far.

    The padding page it then reads last holds stale but finite K/V, as a freed block would: a
    NaN there would fail any comparison. (Decode attention cannot see the order of its keys, so
    a permuted table would pass: the shift must change which keys are read.)
    """
    lens = [3 * BS, 5 * BS]  # whole pages: a last page's unused NaN tail would move into view
    q, kc, vc, table, lens_t = _paged_cache(lens, 2, 64, seed=3)
    want = _sdpa_oracle(q, kc, vc, table, lens_t)
    shifted = table.clone()
    for b, n in enumerate(lens):
        need = -(-n // BS)
        stale = table[b, need]
        kc[stale], vc[stale] = torch.randn_like(kc[stale]), torch.randn_like(vc[stale])
        shifted[b, :need] = table[b, 1 : need + 1]
    bad = paged_attention(q, kc, vc, shifted, lens_t)
    assert torch.isfinite(bad).all() and _err(bad, want) > 0.1
    assert _err(paged_attention(q, kc, vc, table, lens_t), want) <= 1e-4


def test_merge_without_lse_weights_is_caught():
    """Plain average of split outputs: wrong whenever splits hold different amounts of attention."""
    q, kc, vc, table, lens = _paged_cache([40, 100], 2, 64, seed=4)  # splits of 32+8 and 64+36 keys
    want = _sdpa_oracle(q, kc, vc, table, lens)
    part, lse = paged_attention_split(q, kc, vc, table, lens, num_splits=2)
    assert torch.isfinite(lse).all()  # no empty split: the average is over real partials
    assert _err(part.mean(dim=2), want) > 0.1
    assert _err(merge_splits(part, lse), want) <= 1e-4


# ----------------------------------------------------------------------------- validation,
# heuristic
def test_validation_errors():
    q, kc, vc, table, lens = _paged_cache([5, 9], 2, 64)
    args = (q, kc, vc, table, lens)
    bad = {
        "multiple of kv heads": (q[:, :3], kc, vc, table, lens),
        r"q must be \[B, H, 64\]": (q[..., :32], kc, vc, table, lens),
        "dtype": (q.half(), kc, vc, table, lens),
        "block_tables must be": (q, kc, vc, table.float(), lens),
        "context_lens must be int": (q, kc, vc, table, lens[:1]),
        r"context_lens must lie in 1 \.\. 24": (q, kc, vc, table,
                                                torch.tensor([5, 25], dtype=torch.int32)),
        "context_lens must lie": (q, kc, vc, table, torch.tensor([0, 9], dtype=torch.int32)),
        "block ids outside": (q, kc, vc, torch.where(table == table[1, 1], POOL, table), lens),
        "k_cache, v_cache": (q, kc, vc[:, :4], table, lens),
    }
    for message, bad_args in bad.items():
        with pytest.raises(ValueError, match=message):
            paged_attention(*bad_args)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(*args, num_splits=0)
    with pytest.raises(ValueError, match="slot_mapping holds"):
        store_kv(kc[0, :2], vc[0, :2], kc, vc, torch.tensor([0, POOL * BS]))
    with pytest.raises(ValueError, match="k, v must be"):
        store_kv(kc[0, :2, :1], vc[0, :2, :1], kc, vc, torch.tensor([0, 1]))


def test_choose_num_splits():
    if not torch.cuda.is_available():
        assert choose_num_splits(1, 8, 4096) == 1  # CPU: no SMs to fill
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 33  # ⌈2 · 132 / 8⌉: two waves of programs
    # by length: 4096 / 32 keys / 4 tiles a split
    assert choose_num_splits(1, 8, 4096, num_sms=132) == 32
    # 512 programs already fill 132 SMs twice
    assert choose_num_splits(64, 8, 4096, num_sms=132) == 1
    assert choose_num_splits(1, 8, 256, num_sms=132) == 2  # 8 tiles: ≥ 4 tiles per split
    assert choose_num_splits(1, 1, 1 << 20, num_sms=132) == 64  # capped


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_cuda():
    lens = [1, 15, 16, 17, 100, 1000, 3000]
    q, kc, vc, table, lens_t = _paged_cache(lens, 2, 128, dtype=torch.bfloat16)
    q, kc, vc, table, lens_t = (t.cuda() for t in (q, kc, vc, table, lens_t))
    want = _sdpa_oracle(q.cpu(), kc.cpu(), vc.cpu(), table.cpu(), lens_t.cpu()).cuda()
    for num_splits in [1, 4, choose_num_splits(len(lens), 2, max(lens))]:
        out = paged_attention(q, kc, vc, table, lens_t, num_splits=num_splits)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    slots = torch.tensor([3, -1, 70], device="cuda")
    k = torch.randn(3, 2, 128, device="cuda", dtype=torch.bfloat16)
    store_kv(k, k, kc, vc, slots)
    assert torch.equal(kc.flatten(0, 1)[70], k[2])


@pytest.mark.parametrize("triton_version, numpy_version, bad", [
    ("3.6.0", "2.4.6", True), ("3.4.0", "2.4.0", True),  # their interpreter breaks on NumPy >= 2.4
    ("3.6.0", "2.3.5", False), ("3.8.0", "2.4.6", False), ("3.9.0", "2.4.6", False),
    ("3.10.0+git1", "3.0.0", False),
])
def test_an_interpreter_that_cannot_run_the_kernels_is_named(triton_version, numpy_version, bad):
    from nanoserve.kernels import interpreter_version_problem

    problem = interpreter_version_problem(triton_version, numpy_version)
    assert (problem is not None) == bad
    if bad:
        assert f"Triton {triton_version}" in problem and f"NumPy {numpy_version}" in problem
