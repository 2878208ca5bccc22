"""MLA's decode kernel over a paged latent cache (kernels/mla_decode.py) against its torch reference
and against the expanded form (docs/TESTING.md §D).

The outside oracle is standard attention: per head, keys [W_UK[h] · c_j ; k_pe_j] and values
W_UV[h] · c_j expanded from the cached latents, then F.scaled_dot_product_attention with the
expanded head's scale. The kernel sees only the absorbed query q_lat = W_UK[h]ᵀ q_nope and returns
o_lat, to which W_UV is applied afterwards (kernels/mla_decode_ref.py). Each sequence's blocks are
drawn at random from a larger pool whose every other slot is NaN, so a read one slot too far
shows. Lengths 1, BS − 1, BS, BS + 1 and 100 cross pages and key tiles; head counts below, at and
over one head block. Negative controls: RoPE applied to the cached latent (the rotation absorption
cannot survive), the scale left out, and a block table shifted by one block all miss the oracle
by far. Runs in Triton's interpreter without CUDA (conftest sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from nanoserve.kernels.mla_decode import mla_decode
from nanoserve.kernels.mla_decode_ref import absorb_query, expand_output, mla_decode_ref

BS = 8  # page size
LENS = [1, BS - 1, BS, BS + 1, 100]
POOL = 64  # blocks in the pool; LENS use 18 of them


def _latent_cache(lens, r, d_rope, dtype=torch.float32, index_dtype=torch.int32, seed=0):
    """A NaN-poisoned pool [pool, BS, 1, r + d_rope] holding random latents and RoPE keys for `lens`
    tokens per sequence at random blocks, its block tables and lengths."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in lens]
    width = max(need) + 1  # one padding column at least
    pool = max(POOL, 2 * sum(need))
    perm = torch.randperm(pool, generator=g)
    used, spare = perm[: sum(need)].split(need), perm[sum(need):]
    table = spare[torch.randint(len(spare), (len(lens), width), generator=g)]  # padding: NaN blocks
    for b, blocks in enumerate(used):
        table[b, : len(blocks)] = blocks
    cache = torch.full((pool, BS, 1, r + d_rope), float("nan"), dtype=dtype)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[b, pos // BS] * BS + pos % BS  # n
        cache.view(-1, r + d_rope)[slots] = torch.randn(n, r + d_rope, generator=g).to(dtype)
    return cache, table.to(index_dtype), torch.tensor(lens, dtype=index_dtype)


def _weights(H, r, d_nope, d_v, seed):
    """W_UK [H, d_nope, r] and W_UV [H, d_v, r], scaled so that expanded keys have unit size."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H, d_nope, r, generator=g) / math.sqrt(r),
            torch.randn(H, d_v, r, generator=g) / math.sqrt(r))


def _expanded_oracle(q_nope, q_pe, cache, table, lens, w_uk, w_uv, scale):
    """Standard attention: each head's K and V expanded from the latents, then SDPA (fp32)."""
    r = w_uk.shape[2]
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = table[b, pos // BS].long() * BS + pos % BS  # n
        c, k_pe = cache.flatten(0, 2)[slots].float().split([r, q_pe.shape[2]], dim=-1)
        k_nope = torch.einsum("hdr,nr->hnd", w_uk, c)  # H, n, d_nope
        k = torch.cat([k_nope, k_pe[None].expand(len(w_uk), -1, -1)], dim=-1)  # H, n, d_qk
        v = torch.einsum("hvr,nr->hnv", w_uv, c)  # H, n, d_v
        q = torch.cat([q_nope[b], q_pe[b]], dim=-1).float()[:, None]  # H, 1, d_qk
        out.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[:, 0])  # H, d_v
    return torch.stack(out)  # B, H, d_v


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


def _case(lens, H, r, d_rope, d_nope=16, d_v=12, dtype=torch.float32, seed=0,
          index_dtype=torch.int32):
    cache, table, lens_t = _latent_cache(lens, r, d_rope, dtype, index_dtype, seed)
    w_uk, w_uv = _weights(H, r, d_nope, d_v, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    q_nope = torch.randn(len(lens), H, d_nope, generator=g)  # B, H, d_nope
    q_pe = torch.randn(len(lens), H, d_rope, generator=g)  # B, H, d_rope
    scale = 1 / math.sqrt(d_nope + d_rope)
    return dict(q_nope=q_nope, q_pe=q_pe, cache=cache, table=table, lens=lens_t, w_uk=w_uk,
                w_uv=w_uv, scale=scale, dtype=dtype)


def _absorbed(c, decode=mla_decode, cache=None, table=None, scale=None):
    """W_UV · decode(W_UK-absorbed query) over the case's pool (or the one given)."""
    q_lat = absorb_query(c["q_nope"], c["w_uk"]).to(c["dtype"])
    o_lat = decode(q_lat, c["q_pe"].to(c["dtype"]), c["cache"] if cache is None else cache,
                   c["table"] if table is None else table, c["lens"],
                   c["scale"] if scale is None else scale)
    return expand_output(o_lat.float(), c["w_uv"]), o_lat


def _oracle(c, cache=None):
    return _expanded_oracle(c["q_nope"], c["q_pe"], c["cache"] if cache is None else cache,
                            c["table"], c["lens"], c["w_uk"], c["w_uv"], c["scale"])


# ----------------------------------------------------------------------------- against both forms
@pytest.mark.parametrize("H", [4, 16, 20])  # under one head block, one, two (the second padded)
@pytest.mark.parametrize("r,d_rope", [(32, 8), (24, 6)])  # powers of two, and padded ones
def test_mla_decode_fp32_matches_expanded_attention_and_reference(H, r, d_rope):
    c = _case(LENS, H, r, d_rope, seed=H + r)
    want = _oracle(c)
    got, o_lat = _absorbed(c)
    ref, o_ref = _absorbed(c, mla_decode_ref)
    assert o_lat.shape == (len(LENS), H, r) and o_lat.dtype == torch.float32
    assert _err(got, want) <= 1e-4
    assert _err(ref, want) <= 1e-4
    assert _err(o_lat, o_ref) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mla_decode_16bit_int64_tables(dtype):
    c = _case(LENS, 8, 32, 8, dtype=dtype, seed=3, index_dtype=torch.int64)
    got, o_lat = _absorbed(c)
    _, o_ref = _absorbed(c, mla_decode_ref)
    assert o_lat.dtype == dtype
    assert _err(o_lat, o_ref) <= 2e-2
    assert _err(got, _oracle(c)) <= 3e-2


def test_deepseek_v3_shapes_r512_rope64():
    """DeepSeek-V3's latent (r = 512, d_rope = 64, d_nope = d_v = 128) at 16 heads, bf16: the sizes
    the compile matrix builds for (benchmarks/bench_kernels_compile.py, case mla_decode)."""
    c = _case([5, 40], 16, 512, 64, d_nope=128, d_v=128, dtype=torch.bfloat16, seed=5)
    got, o_lat = _absorbed(c)
    _, o_ref = _absorbed(c, mla_decode_ref)
    assert _err(o_lat, o_ref) <= 2e-2
    assert _err(got, _oracle(c)) <= 3e-2


# ----------------------------------------------------------------------------- negative controls
def _rope_on_latent(cache, table, lens, r, base=10.0):
    """The pool with each latent rotated by its token's position (RoPE over pairs of the r values):
    what a writer that roped the whole compressed KV, not just k_pe, would cache."""
    cache = cache.clone()
    flat = cache.view(-1, cache.shape[-1])
    inv_freq = base ** (-torch.arange(0, r, 2).float() / r)  # r / 2
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        slots = table[b, pos // BS].long() * BS + pos % BS
        angle = pos[:, None].float() * inv_freq  # n, r / 2
        x1, x2 = flat[slots, 0:r:2], flat[slots, 1:r:2]
        flat[slots, 0:r:2] = x1 * angle.cos() - x2 * angle.sin()
        flat[slots, 1:r:2] = x1 * angle.sin() + x2 * angle.cos()
    return cache


def test_rope_applied_to_the_latent_is_caught():
    """Rotating c by its position changes the expanded keys by a position-dependent matrix that no
    absorbed query can undo: the absorbed decode over a roped pool misses the oracle."""
    c = _case([30, 100], 4, 32, 8, seed=9)
    roped = _rope_on_latent(c["cache"], c["table"], c["lens"], 32)
    want = _oracle(c)
    assert _err(_absorbed(c)[0], want) <= 1e-4
    assert _err(_absorbed(c, cache=roped)[0], want) > 0.05


def test_a_missing_scale_is_caught():
    c = _case([30, 100], 4, 32, 8, seed=10)
    c["q_nope"], c["q_pe"] = 3 * c["q_nope"], 3 * c["q_pe"]  # scores of a few units
    want = _oracle(c)
    assert _err(_absorbed(c)[0], want) <= 1e-4
    assert _err(_absorbed(c, scale=1.0)[0], want) > 0.05


def test_shifted_block_table_is_caught():
    """Logical block i reading block i + 1's page: the page read last holds stale finite latents,
    as a freed block would."""
    lens = [3 * BS, 5 * BS]
    c = _case(lens, 4, 32, 8, seed=11)
    want = _oracle(c)
    shifted = c["table"].clone()
    for b, n in enumerate(lens):
        need = n // BS
        c["cache"][c["table"][b, need]] = torch.randn(BS, 1, 40)
        shifted[b, :need] = c["table"][b, 1:need + 1]
    bad = _absorbed(c, table=shifted)[0]
    assert torch.isfinite(bad).all() and _err(bad, want) > 0.1
    assert _err(_absorbed(c)[0], want) <= 1e-4


# ----------------------------------------------------------------------------- refused inputs
def test_inputs_are_checked():
    c = _case([5], 4, 32, 8)
    q_lat, q_pe = absorb_query(c["q_nope"], c["w_uk"]), c["q_pe"]
    args = (c["table"], c["lens"])
    with pytest.raises(ValueError, match=r"r \+ d_rope = 40"):
        mla_decode(q_lat, q_pe, c["cache"][..., :36], *args, 0.2)
    with pytest.raises(ValueError, match="sm_scale"):
        mla_decode(q_lat, q_pe, c["cache"], *args, None)
    with pytest.raises(ValueError, match="share one of"):
        mla_decode(q_lat.half(), q_pe, c["cache"], *args, 0.2)
    with pytest.raises(ValueError, match=r"context_lens must lie in 1 \.\. 16"):
        mla_decode(q_lat, q_pe, c["cache"], c["table"], torch.tensor([17], dtype=torch.int32), 0.2)
