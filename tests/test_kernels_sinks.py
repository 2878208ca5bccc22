"""Attention sinks (gpt-oss) in every attention implementation, against transformers' own.

The outside reference is transformers' `eager_attention_forward` of models/gpt_oss (scores, plus
the sink logit as one more column, softmax, the column dropped), per sequence in fp32 over the keys
gathered in logical order. Checked against it: the torch reference (`layers.reference_attention`,
and `layers.attention`, which takes it with sinks), the paged references of the kernels, the C
decode kernel, and the Triton kernels in the interpreter (conftest sets TRITON_INTERPRET=1):
paged decode with 1 split and with splits that do not divide the context (the sink must count once,
in split 0 only), and flash prefill over a NaN-poisoned paged prefix with a sliding window.
Negative controls: each implementation with the sinks left out misses the oracle by far, and so
does the sink counted in every split.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from nanoserve.kernels.flash_attention import flash_attention, flash_attention_ref
from nanoserve.kernels.paged_attention import (
    paged_attention,
    paged_attention_ref,
    paged_attention_split,
)
from nanoserve.kernels.split_kv import merge_splits
from test_kernels_flash import _packed, _paged_prefix
from test_kernels_paged import BS, _paged_cache
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from nanoserve.models.layers import attention, causal_mask, reference_attention

TOL = 1e-4
H = 4


def _sinks(seed: int = 3, n: int = H) -> torch.Tensor:
    """Sink logits on the scores' scale and beyond: some heads give the sink most of the weight."""
    return 2.0 * torch.randn(n, generator=torch.Generator().manual_seed(seed))


def hf_oracle(q, k, v, sinks, window=None, scale=None):
    """One sequence through transformers' GptOss eager attention: q [Lq, H, D] are the last Lq of
    the S keys k, v [S, Hkv, D] (bottom-right causal, the `window` newest keys) -> [Lq, H, D]."""
    Lq, S, D = q.shape[0], k.shape[0], q.shape[-1]
    q_pos = torch.arange(S - Lq, S)  # Lq
    k_pos = torch.arange(S)  # S
    visible = k_pos[None, :] <= q_pos[:, None]  # Lq, S
    if window:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    mask = torch.zeros(Lq, S).masked_fill(~visible, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks.float(),
                             training=False)
    out, _ = eager_attention_forward(module, q.float().transpose(0, 1)[None],
                                     k.float().transpose(0, 1)[None],
                                     v.float().transpose(0, 1)[None], mask[None, None],
                                     scaling=scale or 1 / math.sqrt(D))
    return out[0]  # Lq, H, D


def _err(a, b) -> float:
    diff = (a.float() - b.float()).abs()
    return float("nan") if diff.isnan().any() else diff.max().item()


def _wrong(err: float) -> bool:
    return math.isnan(err) or err > 1e-2


# ----------------------------------------------------------------------------- torch
@pytest.mark.parametrize("window", [None, 5])
def test_torch_attention_with_sinks_matches_transformers(window):
    g = torch.Generator().manual_seed(0)
    T, Hkv, D = 13, 2, 16
    q = torch.randn(1, T, H, D, generator=g)  # B, T, H, D
    k, v = torch.randn(2, 1, T, Hkv, D, generator=g)  # B, T, Hkv, D each
    sinks = _sinks()
    want = hf_oracle(q[0], k[0], v[0], sinks, window)
    positions = torch.arange(T)[None]  # 1, T
    assert _err(reference_attention(q, k, v, positions, window, sinks=sinks)[0], want) <= TOL
    assert _err(attention(q, k, v, positions, window, sinks=sinks)[0], want) <= TOL
    # negative control: the sinks left out
    assert _wrong(_err(attention(q, k, v, positions, window)[0], want))
    assert causal_mask(positions, T, window).shape == (1, 1, T, T)


def test_the_sink_takes_weight_from_every_key():
    """A sink far above every score leaves the output near 0; far below, it is plain attention."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 1, 6, 2, 8, generator=g)
    plain = reference_attention(q, k, v)
    assert _err(reference_attention(q, k, v, sinks=torch.full((2,), -1e4)), plain) <= 1e-6
    assert reference_attention(q, k, v, sinks=torch.full((2,), 60.0)).abs().max() <= 1e-6


# ----------------------------------------------------------------------------- paged decode
def _decode_oracle(q, k_cache, v_cache, table, lens, sinks, window=None):
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = table[b, pos // BS].long() * BS + pos % BS  # n
        keys, values = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]  # n, Hkv, D
        out.append(hf_oracle(q[b][None], keys, values, sinks, window)[0])  # H, D
    return torch.stack(out)  # B, H, D


LENS = [1, BS - 1, BS, BS + 1, 100]


@pytest.mark.parametrize("window", [None, 9])
def test_c_decode_kernel_with_sinks(window):
    from nanoserve.kernels.cpu_paged_attention import cpu_kernel_problem, paged_attention_cpu

    if cpu_kernel_problem(32):
        pytest.skip(cpu_kernel_problem(32))
    q, kc, vc, table, lens = _paged_cache(LENS, 2, 32, seed=4)
    sinks = _sinks()
    want = _decode_oracle(q, kc, vc, table, lens, sinks, window)
    assert _err(paged_attention_ref(q, kc, vc, table, lens, None, window, None, sinks), want) <= TOL
    got = paged_attention_cpu(q, kc, vc, table, lens, window=window, sinks=sinks)
    assert _err(got, want) <= TOL
    assert _wrong(_err(paged_attention_cpu(q, kc, vc, table, lens, window=window), want))


@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("window", [None, 9])
def test_triton_paged_decode_with_sinks(num_splits, window):
    """Splits that do not divide the context, and more splits than tiles (empty tail splits)."""
    q, kc, vc, table, lens = _paged_cache(LENS, 2, 32, seed=5)
    sinks = _sinks(4)
    want = _decode_oracle(q, kc, vc, table, lens, sinks, window)
    got = paged_attention(q, kc, vc, table, lens, num_splits=num_splits, window=window,
                          sinks=sinks)
    assert _err(got, want) <= TOL
    # negative control: the sinks left out
    assert _wrong(_err(paged_attention(q, kc, vc, table, lens, num_splits=num_splits,
                                       window=window), want))


def test_the_sink_counts_in_one_split_only():
    """Negative control: seeding every split with the sink (as if each split owned it) and merging
    counts it num_splits times, and misses."""
    q, kc, vc, table, lens = _paged_cache(LENS, 2, 32, seed=6)
    sinks = _sinks(5)
    want = _decode_oracle(q, kc, vc, table, lens, sinks)
    part, lse = paged_attention_split(q, kc, vc, table, lens, None, 4, sinks=sinks)
    assert _err(merge_splits(part, lse), want) <= TOL
    # each split's partial with the sink in its own denominator: weight e^lse_s / (e^lse_s + e^sink)
    plain_part, plain_lse = paged_attention_split(q, kc, vc, table, lens, None, 4)
    sink = sinks[None, :, None]  # 1, H, 1
    nonempty = plain_lse > float("-inf")
    own = torch.where(nonempty, plain_lse - torch.logaddexp(plain_lse, sink), -math.inf)
    wrong_part = plain_part * own.exp()[..., None]  # B, H, S, D
    wrong_lse = torch.where(nonempty, torch.logaddexp(plain_lse, sink), -math.inf)
    assert _wrong(_err(merge_splits(wrong_part, wrong_lse), want))


# ----------------------------------------------------------------------------- flash prefill
@pytest.mark.parametrize("window", [None, 4, 9])
def test_triton_flash_with_sinks_and_paged_prefix(window):
    """Prefixes 0, 3, 4, 13 from a NaN-poisoned pool, then 5, 1, 17, 8 new tokens, GQA 2."""
    prefix_lens, new_lens = [0, 3, 4, 13], [5, 1, 17, 8]
    q, k, v, cu_q, cu_k = _packed(new_lens, new_lens, H, 2, 32, seed=9)
    kc, vc, bt, ctx, prefixes = _paged_prefix(prefix_lens, 2, 32, 4)
    sinks = _sinks(6)
    want = torch.zeros_like(q)
    for b in range(len(new_lens)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = torch.cat([prefixes[b][0], k[rows]])  # P + L, Hkv, D
        values = torch.cat([prefixes[b][1], v[rows]])
        want[rows] = hf_oracle(q[rows], keys, values, sinks, window)
    args = (q, k, v, cu_q, cu_k, True, None, bt, kc, vc, ctx)
    ref = flash_attention_ref(*args, window=window, sinks=sinks)
    assert _err(ref, want) <= TOL
    assert _err(flash_attention(*args, window=window, sinks=sinks), want) <= TOL
    # negative control: the sinks left out
    assert _wrong(_err(flash_attention(*args, window=window), want))


def test_flash_with_sinks_gives_zero_where_no_key_is_seen():
    """More queries than keys (bottom-right alignment): the first queries see nothing, and with a
    sink as without one their output is 0."""
    q, k, v, cu_q, cu_k = _packed([5], [2], H, 2, 32, seed=10)
    out = flash_attention(q, k, v, cu_q, cu_k, True, sinks=_sinks(7))
    assert out[:3].abs().max() == 0
    assert _err(out, flash_attention_ref(q, k, v, cu_q, cu_k, True, sinks=_sinks(7))) <= TOL


def test_sinks_are_checked_by_shape():
    q, k, v, cu_q, cu_k = _packed([3], [3], H, 2, 32)
    with pytest.raises(ValueError, match=r"one logit per query head, \[4\]"):
        flash_attention(q, k, v, cu_q, cu_k, True, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="sinks must be None or a float tensor"):
        flash_attention(q, k, v, cu_q, cu_k, True, sinks=torch.zeros(4, dtype=torch.int64))
