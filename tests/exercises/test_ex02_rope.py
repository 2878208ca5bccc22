"""Exercise 2: rotary position embeddings (nanoserve/models/layers.py: rope_inv_freq, rope_cos_sin,
rotate_half, apply_rope).

Oracles: Hugging Face transformers' own Llama rotary code (LlamaRotaryEmbedding, rotate_half,
apply_rotary_pos_emb; not our code), small cases worked by hand, and two properties of a rotation:
it keeps a vector's norm, and the score q·k of a query at m and a key at n depends on m − n only.

The properties are not enough on their own. Three of the known-wrong variants below (neighbour
pairs, the sin sign flipped, positions off by one) are rotations too and keep both properties; only
the comparison with the layout HF checkpoints were trained with catches them.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from explain import expect, expect_close, explained_failure
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import rotate_half as hf_rotate_half

from nanoserve.models.config import ModelConfig, llama3_rope_inv_freq

REFERENCE = "nanoserve.models.layers"
EXERCISE = "layers"
pytestmark = pytest.mark.ex02

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          # short original context: all three of llama3's bands are used
          "original_max_position_embeddings": 64}
# name: (head_dim, rope_theta, rope_scaling)
CASES = {
    "default": (16, 10000.0, None),
    "theta 500000, head_dim 64": (64, 500000.0, None),
    "linear x4": (24, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    "llama3": (32, 500000.0, LLAMA3),
}


def _configs(case: str) -> tuple[ModelConfig, LlamaRotaryEmbedding]:
    """nanoserve's ModelConfig and HF's rotary module for the same model (4 heads, 2 kv heads)."""
    head_dim, theta, scaling = CASES[case]
    cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=4 * head_dim, n_layers=1, n_heads=4,
                      n_kv_heads=2,
                      intermediate_size=16, max_position_embeddings=512, rope_theta=theta,
                      rope_scaling=dict(scaling) if scaling else None)
    hf = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=head_dim,
                     max_position_embeddings=512, rope_theta=theta,
                     rope_scaling=dict(scaling) if scaling else None)
    return cfg, LlamaRotaryEmbedding(hf)


def _hf_cos_sin(rotary: LlamaRotaryEmbedding, positions: torch.Tensor, dtype=torch.float32):
    """HF's cos and sin, [B, T, D] each, with the heads axis added: [B, T, 1, D]."""
    cos, sin = rotary(torch.empty(0, dtype=dtype), positions)
    return cos[:, :, None], sin[:, :, None]


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# Ragged rows: row 0 is a prompt at 0..6, row 1 decodes further on (a cache of 250 tokens).
POSITIONS = torch.stack([torch.arange(0, 7), torch.arange(250, 257)])  # B=2, T=7


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_inv_freq_by_hand(impl):
    cfg, _ = _configs("default")  # D = 16, base 10000: θ_i = 10000^(-i/8)
    inv_freq = impl.rope_inv_freq(cfg)
    case = "rope_inv_freq(head_dim 16, rope_theta 10000)"
    expect(inv_freq.dtype == torch.float32, case, "float32", inv_freq.dtype)
    want = torch.tensor([10000.0 ** (-i / 8) for i in range(8)])  # 1, 0.316, 0.1, ..., 10000^(-7/8)
    expect_close(inv_freq, want, case, atol=0, rtol=1e-6)


def check_inv_freq_matches_hf(impl, case):
    cfg, rotary = _configs(case)
    inv_freq = impl.rope_inv_freq(cfg)
    what = f"rope_inv_freq(head_dim {cfg.head_dim}, rope_scaling {cfg.rope_scaling}) against HF's"
    expect(inv_freq.dtype == torch.float32, what, "float32", inv_freq.dtype)
    expect_close(inv_freq, rotary.inv_freq, what, atol=0, rtol=1e-6, dims="i")


def check_cos_sin_matches_hf(impl):
    for case in ("default", "llama3"):
        cfg, rotary = _configs(case)
        cos, sin = impl.rope_cos_sin(rotary.inv_freq, POSITIONS, torch.float32)
        hf_cos, hf_sin = _hf_cos_sin(rotary, POSITIONS)
        # float32 angles near 256 rad carry rounding ~1e-5: allow that much, and nothing like one
        # position (~1)
        what = (f"rope_cos_sin({case} frequencies, positions [[0..6], [250..256]]) against HF's")
        expect_close(cos, hf_cos, f"cos of {what}", atol=5e-5, dims="b, t, 1, d")
        expect_close(sin, hf_sin, f"sin of {what}", atol=5e-5, dims="b, t, 1, d")
    # by hand: position 0 is no rotation; position 1 turns pair i by θ_i, and pairs (i, i + D/2)
    # share it
    # D = 4
    cos, sin = impl.rope_cos_sin(torch.tensor([1.0, 0.5]), torch.tensor([[0, 1]]), torch.float32)
    expect_close(cos[0, :, 0], torch.tensor([[1.0] * 4, [math.cos(1), math.cos(0.5)] * 2]),
                 "cos of rope_cos_sin([1, 0.5], positions [[0, 1]])", atol=1e-5)
    expect_close(sin[0, :, 0], torch.tensor([[0.0] * 4, [math.sin(1), math.sin(0.5)] * 2]),
                 "sin of rope_cos_sin([1, 0.5], positions [[0, 1]])", atol=1e-5)


def check_cos_sin_dtype(impl):
    _, rotary = _configs("default")
    for dtype in (torch.float16, torch.bfloat16):
        cos, sin = impl.rope_cos_sin(rotary.inv_freq, POSITIONS, dtype)
        hf_cos, hf_sin = _hf_cos_sin(rotary, POSITIONS, dtype)
        what = f"rope_cos_sin(..., dtype={dtype})"
        expect(cos.dtype == sin.dtype == dtype, what, dtype, (cos.dtype, sin.dtype))
        expect_close(cos, hf_cos, f"cos of {what}", atol=1e-2, dims="b, t, 1, d")
        expect_close(sin, hf_sin, f"sin of {what}", atol=1e-2, dims="b, t, 1, d")


def check_rotate_half(impl):
    expect_close(impl.rotate_half(torch.tensor([1.0, 2, 3, 4, 5, 6])),
                 torch.tensor([-4.0, -5, -6, 1, 2, 3]), "rotate_half([1, 2, 3, 4, 5, 6])", atol=0)
    x = _randn(2, 3, 4, 16)
    expect_close(impl.rotate_half(x), hf_rotate_half(x), "rotate_half(random [2, 3, 4, 16])",
                 atol=0, dims="b, t, h, d")


def check_apply_rope_matches_hf(impl):
    """apply_rope alone, on HF's cos and sin (so a bug in rope_cos_sin cannot hide here)."""
    _, rotary = _configs("default")
    x = _randn(2, 7, 3, 16)  # B, T, H, D
    cos, sin = _hf_cos_sin(rotary, POSITIONS)
    want, _ = apply_rotary_pos_emb(x, x, cos[:, :, 0], sin[:, :, 0], unsqueeze_dim=2)
    out = impl.apply_rope(x, cos, sin)
    expect_close(out, want, "apply_rope(random [2, 7, 3, 16], HF's cos and sin) against HF's",
                 atol=1e-6, dims="b, t, h, d")


def check_apply_rope_half_precision(impl):
    _, rotary = _configs("default")
    x = _randn(2, 7, 3, 16).half()
    cos, sin = _hf_cos_sin(rotary, POSITIONS, torch.float16)
    want, _ = apply_rotary_pos_emb(x, x, cos[:, :, 0], sin[:, :, 0], unsqueeze_dim=2)
    out = impl.apply_rope(x, cos, sin)
    expect(out.dtype == torch.float16, "apply_rope(float16 x)", torch.float16, out.dtype)
    expect_close(out.float(), want.float(), "apply_rope(float16 x) against HF's", atol=1e-2,
                 dims="b, t, h, d")


def check_end_to_end_matches_hf(impl):
    """Your three functions together against HF's pipeline: queries with 4 heads, keys with 2 (GQA),
    ragged rows."""
    for case in ("default", "llama3"):
        cfg, rotary = _configs(case)
        D = cfg.head_dim
        q, k = _randn(2, 7, 4, D, seed=1), _randn(2, 7, 2, D, seed=2)
        cos, sin = impl.rope_cos_sin(impl.rope_inv_freq(cfg), POSITIONS, torch.float32)
        hf_cos, hf_sin = rotary(q, POSITIONS)
        want_q, want_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin, unsqueeze_dim=2)
        what = f"{case} RoPE, positions [[0..6], [250..256]], end to end against HF's"
        expect_close(impl.apply_rope(q, cos, sin), want_q, f"queries, {what}", atol=2e-4,
                     dims="b, t, h, d")
        expect_close(impl.apply_rope(k, cos, sin), want_k, f"keys, {what}", atol=2e-4,
                     dims="b, t, h, d")


def check_rotation_properties(impl):
    """Norms are kept; q·k depends on the offset m − n only, and does change with it."""
    cfg, _ = _configs("default")
    inv_freq = impl.rope_inv_freq(cfg)

    def rope_at(x, m):  # x [D] placed at position m
        cos, sin = impl.rope_cos_sin(inv_freq, torch.tensor([[m]]), torch.float32)
        return impl.apply_rope(x[None, None, None], cos, sin)[0, 0, 0]

    x = _randn(2, 7, 3, 16, seed=3)
    cos, sin = impl.rope_cos_sin(inv_freq, POSITIONS, torch.float32)
    expect_close(impl.apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1),
                 "the norm of each rotated head (a rotation keeps it)", atol=0, rtol=1e-5,
                 dims="b, t, h")
    q, k = _randn(16, seed=4), _randn(16, seed=5)
    for offset in (0, 3, 40):
        scores = torch.stack([rope_at(q, n + offset) @ rope_at(k, n) for n in (0, 1, 9, 100, 300)])
        expect_close(scores, scores[0].expand(5), f"q·k at offset {offset}, at positions n = 0, "
                     "1, 9, 100, 300 (it depends on the offset only)", atol=1e-3)
    change = abs(rope_at(q, 3) @ rope_at(k, 0) - rope_at(q, 0) @ rope_at(k, 0))
    expect(change > 0.1, "q·k at offsets 3 and 0", "a change above 0.1", f"{float(change):.3g}")


# ----------------------------------------------------------------------------- the tests
def test_ex02_1_inverse_frequencies_by_hand(impl):
    check_inv_freq_by_hand(impl)


@pytest.mark.parametrize("case", list(CASES))
def test_ex02_1_inverse_frequencies_match_hf(impl, case):
    check_inv_freq_matches_hf(impl, case)


def test_ex02_2_cos_sin_match_hf_on_ragged_positions(impl):
    check_cos_sin_matches_hf(impl)


def test_ex02_2_cos_sin_in_the_requested_dtype(impl):
    check_cos_sin_dtype(impl)


def test_ex02_3_rotate_half(impl):
    check_rotate_half(impl)


def test_ex02_4_apply_rope_matches_hf(impl):
    check_apply_rope_matches_hf(impl)


def test_ex02_4_half_precision_in_half_precision_out(impl):
    check_apply_rope_half_precision(impl)


def test_ex02_4_queries_and_keys_end_to_end_match_hf(impl):
    check_end_to_end_matches_hf(impl)


def test_ex02_4_a_rotation_keeps_norms_and_sees_relative_positions(impl):
    check_rotation_properties(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _inv_freq(cfg):
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        return inv_freq / scaling["factor"]
    if scaling.get("rope_type") == "llama3":
        return llama3_rope_inv_freq(inv_freq, scaling)
    return inv_freq


def _rope(pairs="half", sin_sign=1, position_offset=0, negate=True):
    """A RoPE implementation; the arguments put one bug each in a known place."""
    def rope_cos_sin(inv_freq, positions, dtype):
        angles = (positions + position_offset)[..., None].float() * inv_freq  # B, T, D/2
        if pairs == "half":
            # B, T, D: [a_0 .. a_{D/2-1}, a_0 .. a_{D/2-1}]
            angles = torch.cat((angles, angles), dim=-1)
        else:  # wrong for HF checkpoints: [a_0, a_0, a_1, a_1, ...] for pairs (2i, 2i+1)
            angles = angles.repeat_interleave(2, dim=-1)
        return angles.cos().to(dtype)[:, :, None], angles.sin().to(dtype)[:, :, None]

    def rotate_half(x):
        sign = -1 if negate else 1
        if pairs == "half":
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((sign * x2, x1), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((sign * x2, x1), dim=-1).flatten(-2)

    def apply_rope(x, cos, sin):
        return x * cos + sin_sign * rotate_half(x) * sin

    return SimpleNamespace(rope_inv_freq=_inv_freq, rope_cos_sin=rope_cos_sin,
                           rotate_half=rotate_half,
                           apply_rope=apply_rope)


WRONG = {
    "neighbour pairs (2i, 2i+1), llama2.c's layout": (_rope(pairs="interleaved"),
                                                      [check_rotate_half, check_cos_sin_matches_hf,
                                                       check_end_to_end_matches_hf]),
    "sin sign flipped (rotates backwards)": (_rope(sin_sign=-1),
                                             [check_apply_rope_matches_hf,
                                              check_end_to_end_matches_hf]),
    "positions off by one": (_rope(position_offset=1),
                             [check_cos_sin_matches_hf, check_end_to_end_matches_hf]),
    "rotate_half without the minus (not a rotation)": (_rope(negate=False),
                                                       [check_rotate_half,
                                                        check_apply_rope_matches_hf,
                                                        check_rotation_properties]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex02_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex02_properties_alone_would_accept_the_wrong_layouts():
    """Why HF is the oracle: neighbour pairs, the backwards rotation and shifted positions are
    rotations too."""
    for name in ("neighbour pairs (2i, 2i+1), llama2.c's layout",
                 "sin sign flipped (rotates backwards)",
                 "positions off by one"):
        check_rotation_properties(WRONG[name][0])


def test_ex02_the_checks_pass_on_a_right_variant_built_the_same_way():
    """The mutants differ from this one in exactly one place, so their failures are that place's."""
    right = _rope()
    check_inv_freq_by_hand(right)
    for case in CASES:
        check_inv_freq_matches_hf(right, case)
    for check in (check_cos_sin_matches_hf, check_cos_sin_dtype, check_rotate_half,
                  check_apply_rope_matches_hf,
                  check_apply_rope_half_precision, check_end_to_end_matches_hf,
                  check_rotation_properties):
        check(right)
