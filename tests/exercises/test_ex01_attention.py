"""Exercise 1: causal attention with a KV cache, and a sliding window (nanoserve/models/layers.py:
causal_mask, naive_attention).

Oracles: a truth table written by hand, and torch's scaled_dot_product_attention (not our code).
The decode tests are the KV-cache contract: queries at positions p..p+T-1 over keys 0..p+T-1 must
give the rows of full causal attention.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from explain import expect_close, expect_equal, explained_failure

REFERENCE = "nanoserve.models.layers"
EXERCISE = "layers"
pytestmark = pytest.mark.ex01
BTHD = "b, t, h, d"  # how a failure names an element of an attention output


def _qkv(B=2, T=7, H=4, Hkv=4, D=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(dtype)
    k, v = (torch.randn(B, T, Hkv, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _sdpa(q, k, v, mask=None):
    """torch's attention: [B, T, H, D] layout in and out, GQA by repeating kv heads."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2)


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_mask_truth_table(impl):
    m = impl.causal_mask(torch.tensor([[0, 2], [3, 4]]), 5)
    want = torch.tensor([[[1, 0, 0, 0, 0], [1, 1, 1, 0, 0]],
                         [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]], dtype=torch.bool)
    expect_equal(m, want[:, None], "causal_mask(q_positions=[[0, 2], [3, 4]], S=5), keys 0..4 "
                 "(1 = visible)", rows=("query", "queries"), dims="b, 1, t")


def check_prefill_equals_sdpa(impl, H=4, Hkv=4):
    q, k, v = _qkv(H=H, Hkv=Hkv)
    expect_close(impl.naive_attention(q, k, v), _sdpa(q, k, v),
                 f"naive_attention(q, k, v), a prefill of 7 tokens, {H} heads over {Hkv} kv heads, "
                 "against torch's SDPA", atol=1e-5, dims=BTHD)


def check_decode_with_cache_equals_full(impl, H=6, Hkv=2):
    """Prefill 4 tokens, then 3 decode steps of one query each over the growing cache."""
    q, k, v = _qkv(B=2, T=7, H=H, Hkv=Hkv)
    full = _sdpa(q, k, v)
    prefill = impl.naive_attention(q[:, :4], k[:, :4], v[:, :4], torch.arange(4).expand(2, 4))
    expect_close(prefill, full[:, :4], "a prefill of 4 tokens (q_positions 0..3)", atol=1e-5,
                 dims=BTHD)
    for t in range(4, 7):
        step = impl.naive_attention(q[:, t:t + 1], k[:, :t + 1], v[:, :t + 1],
                                    torch.full((2, 1), t))
        expect_close(step, full[:, t:t + 1],
                     f"a decode step: one query at q_positions {t} over the cached keys 0..{t}, "
                     f"against row {t} of full causal attention", atol=1e-5, dims=BTHD)


def check_ragged_positions(impl):
    """Rows of one batch at different positions over one key tensor (padding after each row's
    keys)."""
    q, k, v = _qkv(B=2, T=2, H=2, Hkv=2)
    k, v = (torch.cat([t, t, t, t], dim=1) for t in (k, v))  # S = 8
    pos = torch.tensor([[3, 4], [6, 7]])
    out = impl.naive_attention(q, k, v, pos)
    mask = torch.arange(8)[None, None, :] <= pos[:, :, None]  # B, T, S   built here, independently
    expect_close(out, _sdpa(q, k, v, mask[:, None]),
                 "two rows at different positions, q_positions=[[3, 4], [6, 7]], over 8 keys",
                 atol=1e-5, dims=BTHD)


def check_window_truth_table(impl):
    """Sliding window 2: each query sees itself and the one key before it."""
    m = impl.causal_mask(torch.tensor([[0, 2], [3, 4]]), 5, window=2)
    want = torch.tensor([[[1, 0, 0, 0, 0], [0, 1, 1, 0, 0]],
                         [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]], dtype=torch.bool)
    expect_equal(m, want[:, None], "causal_mask(q_positions=[[0, 2], [3, 4]], S=5, window=2), "
                 "keys 0..4 (1 = visible)", rows=("query", "queries"), dims="b, 1, t")


def check_window_attention_equals_sdpa(impl):
    """A window of 3 over a prefill of 7 and over decode queries at positions 5 and 6."""
    q, k, v = _qkv(B=2, T=7, H=6, Hkv=2)
    kpos, qpos = torch.arange(7)[None, :], torch.arange(7)[:, None]
    mask = (kpos <= qpos) & (kpos > qpos - 3)  # T, S   built here, independently
    full = _sdpa(q, k, v, mask)
    expect_close(impl.naive_attention(q, k, v, window=3), full,
                 "naive_attention(..., window=3), a prefill of 7 tokens", atol=1e-5, dims=BTHD)
    decode = impl.naive_attention(q[:, 5:], k, v, torch.tensor([[5, 6], [5, 6]]), window=3)
    expect_close(decode, full[:, 5:], "window=3, queries at q_positions [5, 6] over keys 0..6",
                 atol=1e-5, dims=BTHD)


def check_dtype_kept(impl):
    q, k, v = _qkv(dtype=torch.float16)
    out = impl.naive_attention(q, k, v)
    assert out.dtype == torch.float16, f"float16 q, k, v: expected float16 out, got {out.dtype}"
    expect_close(out.float(), _sdpa(q, k, v), "float16 inputs", atol=2e-3, dims=BTHD)


# ----------------------------------------------------------------------------- the tests
def test_ex01_1_causal_mask_truth_table(impl):
    check_mask_truth_table(impl)


def test_ex01_2_attention_without_cache_equals_sdpa(impl):
    check_prefill_equals_sdpa(impl)


def test_ex01_2_grouped_query_attention_equals_sdpa(impl):
    check_prefill_equals_sdpa(impl, H=6, Hkv=2)


def test_ex01_2_decode_over_a_kv_cache_equals_full_attention(impl):
    check_decode_with_cache_equals_full(impl)


def test_ex01_2_ragged_positions_in_one_batch(impl):
    check_ragged_positions(impl)


def test_ex01_2_half_precision_in_half_precision_out(impl):
    check_dtype_kept(impl)


def test_ex01_3_sliding_window_truth_table(impl):
    check_window_truth_table(impl)


def test_ex01_3_sliding_window_attention_equals_sdpa(impl):
    check_window_attention_equals_sdpa(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _attention(mask_fn, kv_heads="interleave"):
    def naive_attention(q, k, v, q_positions=None, window=None):
        B, T, H, D = q.shape
        if q_positions is None:
            q_positions = torch.arange(T).expand(B, T)
        group = H // k.shape[2]
        if kv_heads == "interleave":
            k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        else:  # wrong: head h reads kv head h % Hkv
            k, v = (t.repeat(1, 1, group, 1) for t in (k, v))
        s = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) / math.sqrt(D)
        s = s.masked_fill(~mask_fn(q_positions, k.shape[1], window), float("-inf"))
        return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v.float()).to(q.dtype)
    return naive_attention


def _mask(compare, window_edge=lambda kpos, qpos, w: kpos > qpos - w):
    def causal_mask(qp, S, window=None):
        kpos, qpos = torch.arange(S)[None, None, :], qp[:, :, None]
        visible = compare(kpos, qpos)
        return (visible if window is None else visible & window_edge(kpos, qpos, window))[:, None]
    return causal_mask


NO_MASK = _mask(lambda kpos, qpos: torch.ones_like(kpos <= qpos))
STRICT = _mask(lambda kpos, qpos: kpos < qpos)  # off by one: a query does not see itself
RIGHT = _mask(lambda kpos, qpos: kpos <= qpos)
# forgets the cache: positions restart at 0
FROM_ZERO = _mask(lambda kpos, qpos: kpos <= qpos - qpos[:, :1])
# window + 1 keys
WIDE = _mask(lambda kpos, qpos: kpos <= qpos, lambda kpos, qpos, w: kpos >= qpos - w)
# the window ignored
NO_WINDOW = _mask(lambda kpos, qpos: kpos <= qpos, lambda kpos, qpos, w: kpos >= 0)
WRONG = {
    "no causal mask": (SimpleNamespace(causal_mask=NO_MASK, naive_attention=_attention(NO_MASK)),
                       [check_mask_truth_table, check_prefill_equals_sdpa]),
    "mask off by one (no self)": (SimpleNamespace(causal_mask=STRICT,
                                                  naive_attention=_attention(STRICT)),
                                  [check_mask_truth_table, check_prefill_equals_sdpa]),
    "positions relative to the chunk": (SimpleNamespace(causal_mask=FROM_ZERO,
                                                        naive_attention=_attention(FROM_ZERO)),
                                        [check_decode_with_cache_equals_full,
                                         check_ragged_positions]),
    "GQA heads tiled, not grouped": (SimpleNamespace(causal_mask=RIGHT,
                                                     naive_attention=_attention(RIGHT, "tile")),
                                     [check_decode_with_cache_equals_full]),
    "window one key too wide": (SimpleNamespace(causal_mask=WIDE, naive_attention=_attention(WIDE)),
                                [check_window_truth_table, check_window_attention_equals_sdpa]),
    "window ignored": (SimpleNamespace(causal_mask=NO_WINDOW,
                                       naive_attention=_attention(NO_WINDOW)),
                       [check_window_truth_table, check_window_attention_equals_sdpa]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex01_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex01_the_checks_pass_on_a_right_variant_built_the_same_way():
    """The mutants differ from this one in exactly one place, so their failures are that place's."""
    right = SimpleNamespace(causal_mask=RIGHT, naive_attention=_attention(RIGHT))
    for check in (check_mask_truth_table, check_prefill_equals_sdpa,
                  check_decode_with_cache_equals_full,
                  check_ragged_positions, check_dtype_kept, check_window_truth_table,
                  check_window_attention_equals_sdpa):
        check(right)
