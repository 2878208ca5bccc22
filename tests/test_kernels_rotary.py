"""RoPE from a table in one kernel (kernels/rotary.py) against layers.apply_rope, its plain-torch
reference, in the interpreter.

The table is the model's own: layers.rope_cos_sin over every position, as the fused Llama model
builds it. q and k come as views of one QKV projection's output (strided rows), with GQA, at
random positions. fp32 and fp16: bit for bit equal to apply_rope (the kernel rounds each product
and the sum as torch does). bf16: within one unit in the last place for each of the three
roundings (of the pair's magnitude: a rotated value may cancel to near 0), because Triton's
interpreter converts to bfloat16 by truncation (a GPU rounds to nearest;
tests/test_kernels_norm.py shows it). Partial RoPE (Phi-3's 3/4 of each head) leaves the
rest of the head as it was. With the K/V store: exactly the real tokens' slots are written (the
rest of a NaN pool stays NaN), padding (slot −1) is skipped but its query still rotated. Controls:
positions off by one, and sin with the wrong sign, miss.
"""

from __future__ import annotations

import pytest
import torch
from nanoserve.kernels.rotary import (
    rotary_embedding,
    rotary_embedding_ref,
    rotary_embedding_store_kv,
)

from nanoserve.models.layers import rope_cos_sin

P, N, H, HKV = 40, 7, 6, 2


def _table(rot_dim: int, dtype):
    """cos, sin [P, R/2] as models/triton_layers.py builds them."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(P)[None], dtype)  # 1, P, 1, R
    half = rot_dim // 2
    return cos[0, :, 0, :half].contiguous(), sin[0, :, 0, :half].contiguous()


def _qkv(D: int, dtype, seed: int = 0):
    """q [N, H, D], k, v [N, HKV, D]: views of one projection's output, and positions [N]."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(N, (H + 2 * HKV) * D, generator=g) * 2).to(dtype)
    q = qkv[:, :H * D].view(N, H, D)
    k = qkv[:, H * D:(H + HKV) * D].view(N, HKV, D)
    v = qkv[:, (H + HKV) * D:].view(N, HKV, D)
    return q, k, v, torch.randint(0, P, (N,), generator=g)


def _ulps(got, want, x, rot_dim: int):
    """The largest difference in units of the last place of the pair each value is made from
    (|x_i| + |x_i+R/2|, which bounds both products: the result itself may cancel to near 0)."""
    half = rot_dim // 2
    pair = x[..., :half].float().abs() + x[..., half:rot_dim].float().abs()
    scale = torch.cat((pair, pair, x[..., rot_dim:].float().abs()), dim=-1)
    ulp = scale.clamp(min=torch.finfo(want.dtype).tiny) * torch.finfo(want.dtype).eps
    return ((got.float() - want.float()).abs() / ulp).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D,rot_dim", [(16, 16), (64, 64), (32, 24)])
def test_rotation_equals_apply_rope(dtype, D, rot_dim):
    cos, sin = _table(rot_dim, dtype)
    q, k, _, positions = _qkv(D, dtype)
    want_q, want_k = rotary_embedding_ref(q, k, positions, cos, sin)
    got_q, got_k = rotary_embedding(q, k, positions, cos, sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape and got_q.is_contiguous()
    if dtype == torch.bfloat16:
        assert _ulps(got_q, want_q, q, rot_dim) <= 3 and _ulps(got_k, want_k, k, rot_dim) <= 3
    else:
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    if rot_dim < D:  # the unrotated dimensions as they were
        assert torch.equal(got_q[..., rot_dim:], q[..., rot_dim:])
    # controls: positions one off; sin with the wrong sign (rotating the other way)
    off_q, _ = rotary_embedding(q, k, (positions + 1) % P, cos, sin)
    back_q, _ = rotary_embedding(q, k, positions, cos, -sin)
    for wrong in (off_q, back_q):
        assert (wrong.float() - want_q.float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_store_writes_exactly_the_real_tokens_slots(dtype):
    D = 32
    cos, sin = _table(D, dtype)
    q, k, v, positions = _qkv(D, dtype, seed=1)
    k_cache = torch.full((6, 4, HKV, D), float("nan"), dtype=dtype)  # 24 slots
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.tensor([3, -1, 0, 5, 23, 9, -1])  # two padding rows
    got_q = rotary_embedding_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
    want_q, want_k = rotary_embedding_ref(q, k, positions, cos, sin)
    assert torch.equal(got_q, want_q)  # padding's queries too
    real = slots >= 0
    assert torch.equal(k_cache.view(-1, HKV, D)[slots[real]], want_k[real])
    assert torch.equal(v_cache.view(-1, HKV, D)[slots[real]], v[real])
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[slots[real]] = False
    assert k_cache.view(-1, HKV, D)[untouched].isnan().all()
    assert v_cache.view(-1, HKV, D)[untouched].isnan().all()


def test_bad_arguments_are_refused_by_name():
    cos, sin = _table(16, torch.float32)
    q, k, v, positions = _qkv(16, torch.float32)
    pool = torch.zeros(2, 4, HKV, 16)
    with pytest.raises(ValueError, match="q must be"):
        rotary_embedding(q[0], k, positions, cos, sin)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32 alike"):
        rotary_embedding(q, k.half(), positions, cos, sin)
    with pytest.raises(ValueError, match="R ≤ head_dim"):
        rotary_embedding(q, k, positions, torch.cat([cos, cos], 1), torch.cat([sin, sin], 1))
    with pytest.raises(ValueError, match="q's dtype"):
        rotary_embedding(q, k, positions, cos.half(), sin.half())
    with pytest.raises(ValueError, match="positions must lie in 0 .. 39"):
        rotary_embedding(q, k, positions + P, cos, sin)
    with pytest.raises(ValueError, match="positions must be int32/int64"):
        rotary_embedding(q, k, positions.float(), cos, sin)
    with pytest.raises(ValueError, match="slots outside"):
        rotary_embedding_store_kv(q, k, v, positions, cos, sin, pool, pool,
                                  torch.full((N,), 8))
    with pytest.raises(ValueError, match="8-bit pools"):
        rotary_embedding_store_kv(q, k, v, positions, cos, sin, pool.half(), pool.half(),
                                  torch.zeros(N, dtype=torch.long))
