"""Exercise 24: MLA's absorbed decode (nanoserve/kernels/mla_decode_ref.py: absorb_query,
mla_decode_ref, expand_output).

Oracles: the naive expanded form, standard attention (F.scaled_dot_product_attention) over keys
[W_UK[h] · c_j ; k_pe_j] and values W_UV[h] · c_j expanded per head from the cached latents;
24.1 by its defining property (q_lat · c = q_nope · W_UK[h] c for any latent c); 24.2 alone with
W_UV the identity (then the expanded output is o_lat itself) and the absorbed query computed here;
24.3 by a loop of matrix-vector products. The pool's blocks are drawn at random from a larger one
whose every other slot is NaN; lengths 1, BS − 1, BS, BS + 1 and 40 in one ragged batch.

Known-wrong variants, each failing: RoPE applied to the latent keys, the scale left out, a scale of
1/√r in place of the one passed, the RoPE key left out, the newest key dropped, W_UK reshaped
where it must be transposed, W_UV reshaped likewise. (Applying W_UV to every key's latent before
the weighted sum is *not* wrong — the product is linear — and is checked to pass.)
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from explain import expect, expect_close, explained_failure

REFERENCE = "nanoserve.kernels.mla_decode_ref"
EXERCISE = "mla"
pytestmark = pytest.mark.ex24

BS = 4  # page size
LENS = [1, BS - 1, BS, BS + 1, 40]
H, R, D_ROPE, D_NOPE, D_V = 3, 12, 4, 6, 5  # d_v ≠ r and d_nope ≠ r: a swapped axis shows


def _pool(lens, dtype=torch.float32, seed=0):
    """A NaN-poisoned latent pool [pool, BS, 1, R + D_ROPE], block tables, lengths."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in lens]
    pool = 2 * sum(need) + 4
    perm = torch.randperm(pool, generator=g)
    used, spare = perm[: sum(need)].split(need), perm[sum(need):]
    table = spare[torch.randint(len(spare), (len(lens), max(need) + 1), generator=g)]
    for b, blocks in enumerate(used):
        table[b, : len(blocks)] = blocks
    cache = torch.full((pool, BS, 1, R + D_ROPE), float("nan"))
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[b, pos // BS] * BS + pos % BS
        cache.view(-1, R + D_ROPE)[slots] = torch.randn(n, R + D_ROPE, generator=g)
    return cache.to(dtype), table.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def _case(lens=LENS, seed=0):
    cache, table, lens_t = _pool(lens, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    return SimpleNamespace(
        cache=cache, table=table, lens=lens_t,
        q_nope=2 * torch.randn(len(lens), H, D_NOPE, generator=g),  # scores of a few units
        q_pe=2 * torch.randn(len(lens), H, D_ROPE, generator=g),
        w_uk=torch.randn(H, D_NOPE, R, generator=g) / math.sqrt(R),
        w_uv=torch.randn(H, D_V, R, generator=g) / math.sqrt(R),
        scale=1 / math.sqrt(D_NOPE + D_ROPE))


def _expanded(c, w_uv=None):
    """Standard attention over keys and values expanded per head from the latents (fp32)."""
    w_uv = c.w_uv if w_uv is None else w_uv
    out = []
    for b, n in enumerate(c.lens.tolist()):
        pos = torch.arange(n)
        slots = c.table[b, pos // BS].long() * BS + pos % BS
        lat, k_pe = c.cache.flatten(0, 2)[slots].float().split([R, D_ROPE], dim=-1)
        k = torch.cat([torch.einsum("hdr,nr->hnd", c.w_uk, lat),
                       k_pe[None].expand(H, -1, -1)], dim=-1)  # H, n, d_nope + d_rope
        v = torch.einsum("hvr,nr->hnv", w_uv, lat)  # H, n, d_v
        q = torch.cat([c.q_nope[b], c.q_pe[b]], dim=-1)[:, None]  # H, 1, d_nope + d_rope
        out.append(F.scaled_dot_product_attention(q, k, v, scale=c.scale)[:, 0])
    return torch.stack(out)  # B, H, d_v


# ----------------------------------------------------------------------------- checks (shared with
# the variants)
def check_absorbed_query_scores(impl):
    c = _case()
    latents = torch.randn(7, R, generator=torch.Generator().manual_seed(3))  # any 7 latents
    q_lat = impl.absorb_query(c.q_nope, c.w_uk)
    case = f"absorb_query(q_nope [5, {H}, {D_NOPE}], w_uk [{H}, {D_NOPE}, {R}])"
    expect(_shaped(q_lat, (5, H, R)), case, f"q_lat of shape (5, {H}, {R})",
           tuple(getattr(q_lat, "shape", ())) or type(q_lat).__name__)
    keys = torch.einsum("hdr,nr->hnd", c.w_uk, latents)  # H, 7, d_nope: expanded keys
    want = torch.einsum("bhd,hnd->bhn", c.q_nope, keys)  # the expanded scores
    got = torch.einsum("bhr,nr->bhn", q_lat, latents)  # the absorbed scores
    expect_close(got, want, f"{case}: q_lat · c against q_nope · (W_UK c) for 7 random latents",
                 atol=1e-5, dims="b, h, latent")


def _shaped(t, shape) -> bool:
    return isinstance(t, torch.Tensor) and tuple(t.shape) == shape


def check_decode_alone(impl):
    """W_UV = identity: the expanded output is o_lat; q_lat absorbed here, not by impl."""
    c = _case()
    q_lat = torch.einsum("bhd,hdr->bhr", c.q_nope, c.w_uk)
    got = impl.mla_decode_ref(q_lat, c.q_pe, c.cache, c.table, c.lens, c.scale)
    want = _expanded(c, w_uv=torch.eye(R).expand(H, R, R))
    expect_close(got, want, f"mla_decode_ref(lengths {LENS}, blocks of {BS}, r {R}, d_rope "
                 f"{D_ROPE}, {H} heads, NaN in every unused slot) vs expanded attention with W_UV "
                 "= identity", atol=1e-5, dims="b, h, r")


def check_decode_dtype(impl):
    c = _case([BS + 1, 9], seed=4)
    q_lat = torch.einsum("bhd,hdr->bhr", c.q_nope, c.w_uk).bfloat16()
    got = impl.mla_decode_ref(q_lat, c.q_pe.bfloat16(), c.cache.bfloat16(), c.table, c.lens,
                              c.scale)
    case = "mla_decode_ref on bfloat16 inputs"
    if not (isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16):
        raise AssertionError(f"{case}: expected a bfloat16 o_lat, got "
                             f"{getattr(got, 'dtype', type(got).__name__)}")
    want = _expanded(c, w_uv=torch.eye(R).expand(H, R, R))
    expect_close(got.float(), want, case, atol=5e-2, dims="b, h, r")


def check_expand_output(impl):
    g = torch.Generator().manual_seed(5)
    o_lat, w_uv = torch.randn(4, H, R, generator=g), torch.randn(H, D_V, R, generator=g)
    want = torch.stack([torch.stack([w_uv[h] @ o_lat[b, h] for h in range(H)])
                        for b in range(4)])  # 4, H, d_v
    expect_close(impl.expand_output(o_lat, w_uv), want, f"expand_output(o_lat [4, {H}, {R}], "
                 f"w_uv [{H}, {D_V}, {R}]) vs W_UV[h] · o_lat[b, h], head by head", atol=1e-5,
                 dims="b, h, d_v")


def check_whole_decode_against_expanded(impl):
    c = _case(seed=6)
    q_lat = impl.absorb_query(c.q_nope, c.w_uk)
    o_lat = impl.mla_decode_ref(q_lat, c.q_pe, c.cache, c.table, c.lens, c.scale)
    expect_close(impl.expand_output(o_lat, c.w_uv), _expanded(c),
                 f"absorb, decode, expand (lengths {LENS}) vs standard attention over K and V "
                 "expanded per head", atol=1e-5, dims="b, h, d_v")


# ----------------------------------------------------------------------------- the tests
def test_ex24_1_the_absorbed_query_gives_the_expanded_scores(impl):
    check_absorbed_query_scores(impl)


def test_ex24_2_latent_attention_over_the_paged_pool(impl):
    check_decode_alone(impl)


def test_ex24_2_keeps_the_dtype(impl):
    check_decode_dtype(impl)


def test_ex24_3_each_head_expands_its_output(impl):
    check_expand_output(impl)


def test_ex24_absorbed_decode_equals_expanded_attention(impl):
    check_whole_decode_against_expanded(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _rope(x, pos, base=10.0):
    """RoPE over pairs (x[2i], x[2i + 1]) of each row, row n at position pos[n]."""
    angle = pos[:, None].float() * base ** (-torch.arange(0, x.shape[-1], 2).float()
                                             / x.shape[-1])
    x1, x2 = x[:, 0::2], x[:, 1::2]
    return torch.stack([x1 * angle.cos() - x2 * angle.sin(),
                        x1 * angle.sin() + x2 * angle.cos()], dim=-1).flatten(1)


def _mla(rope_latent=False, scale="given", with_pe=True, drop_last=False, uk_reshaped=False,
         uv_reshaped=False, uv_before_sum=False):
    """The three functions, with one mistake switched on (or, uv_before_sum, a right variant
    computed another way)."""

    def absorb_query(q_nope, w_uk):
        if uk_reshaped:  # wrong: [H, d_nope, r] read as [H, r, d_nope]
            w = w_uk.reshape(w_uk.shape[0], w_uk.shape[2], w_uk.shape[1])
            return torch.einsum("bhd,hrd->bhr", q_nope, w)
        return torch.einsum("bhd,hdr->bhr", q_nope, w_uk)

    def weights(q_lat, q_pe, kv_cache, block_tables, n, b, sm_scale):
        r, bs = q_lat.shape[-1], kv_cache.shape[1]
        pos = torch.arange(n - 1 if drop_last else n)
        slots = block_tables[b, pos // bs].long() * bs + pos % bs
        c, k_pe = kv_cache.flatten(0, 2)[slots].float().split([r, kv_cache.shape[-1] - r], -1)
        keys = _rope(c, pos) if rope_latent else c  # wrong: a rotation on the latent
        s = q_lat[b].float() @ keys.T
        if with_pe:
            s = s + q_pe[b].float() @ k_pe.T
        factor = {"given": sm_scale, "none": 1.0, "sqrt_r": 1 / math.sqrt(r)}[scale]
        return (s * factor).softmax(-1), c

    def mla_decode_ref(q_lat, q_pe, kv_cache, block_tables, context_lens, sm_scale):
        out = torch.empty_like(q_lat)
        for b, n in enumerate(context_lens.tolist()):
            p, c = weights(q_lat, q_pe, kv_cache, block_tables, n, b, sm_scale)
            out[b] = (p @ c).to(q_lat.dtype)
        return out

    def expand_output(o_lat, w_uv):
        if uv_reshaped:  # wrong: [H, d_v, r] read as [H, r, d_v]
            w = w_uv.reshape(w_uv.shape[0], w_uv.shape[2], w_uv.shape[1])
            return torch.einsum("bhr,hrv->bhv", o_lat, w)
        return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)

    return SimpleNamespace(absorb_query=absorb_query, mla_decode_ref=mla_decode_ref,
                           expand_output=expand_output)


def _uv_before_sum_decode(c):
    """A right variant: W_UV applied to each key's latent, then the weighted sum (linear, so
    equal to summing first)."""
    right = _mla()
    out = []
    for b, n in enumerate(c.lens.tolist()):
        q_lat = right.absorb_query(c.q_nope, c.w_uk)
        pos = torch.arange(n)
        slots = c.table[b, pos // BS].long() * BS + pos % BS
        lat, k_pe = c.cache.flatten(0, 2)[slots].split([R, D_ROPE], -1)
        p = ((q_lat[b] @ lat.T + c.q_pe[b] @ k_pe.T) * c.scale).softmax(-1)  # H, n
        values = torch.einsum("hvr,nr->hnv", c.w_uv, lat)  # each head's values, expanded
        out.append(torch.einsum("hn,hnv->hv", p, values))
    return torch.stack(out)


DECODE = [check_decode_alone, check_whole_decode_against_expanded]
WRONG = {
    "RoPE applied to the latent keys": (_mla(rope_latent=True), DECODE),
    "the scale left out": (_mla(scale="none"), DECODE),
    "1/√r in place of the scale passed": (_mla(scale="sqrt_r"), DECODE),
    "the RoPE key left out of the scores": (_mla(with_pe=False), DECODE),
    "the newest key dropped": (_mla(drop_last=True), DECODE),
    "W_UK reshaped, not transposed": (_mla(uk_reshaped=True),
                                      [check_absorbed_query_scores,
                                       check_whole_decode_against_expanded]),
    "W_UV reshaped, not transposed": (_mla(uv_reshaped=True),
                                      [check_expand_output, check_whole_decode_against_expanded]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex24_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex24_the_checks_pass_on_a_right_variant_built_the_same_way():
    right = _mla()
    for check in (check_absorbed_query_scores, check_decode_alone, check_decode_dtype,
                  check_expand_output, check_whole_decode_against_expanded):
        check(right)
    c = _case(seed=6)
    expect_close(_uv_before_sum_decode(c), _expanded(c), "W_UV before the weighted sum",
                 atol=1e-5)
