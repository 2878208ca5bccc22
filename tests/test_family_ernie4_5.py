"""ERNIE 4.5 against transformers' Ernie4_5ForCausalLM (tests/family_oracle.py): logits, cached
decode and the engine's greedy tokens; RoPE on adjacent pairs checked against a written-out rotation
and dropped as a negative control (Llama's pairs instead), and the biases dropped as another;
refused fields named; a saved checkpoint read back by transformers."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from family_oracle import (
    TOL,
    assert_engine_matches_hf,
    assert_every_field_classified,
    assert_logits_match,
    assert_saved_checkpoint_reads_back,
    family_checkpoint,
    load,
    logits_delta,
)
from testdata import tiny_hf_checkpoint

from nanoserve.errors import ConfigError
from nanoserve.models.families._llama_shaped import apply_rope_adjacent
from nanoserve.models.family import family_of
from nanoserve.models.hf_config import config_from_hf
from nanoserve.models.layers import apply_rope, rope_cos_sin

# biases everywhere, GQA, head_dim 16 (not hidden / heads = 12), untied head
ERNIE = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=256,
             use_bias=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_parameters=dict(rope_type="default", rope_theta=300.0))


@pytest.fixture(scope="module")
def ernie(tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp("ernie4_5"),
                             transformers.Ernie4_5Config(**ERNIE), seed=11)


def test_adjacent_pairs_by_definition():
    """(x_2i, x_2i+1) turned by p·θ_i, written out one pair at a time; the dims past R unchanged."""
    D, R = 8, 6
    x = torch.randn(1, 3, 2, D, generator=torch.Generator().manual_seed(0))
    inv_freq = 1.0 / 10.0 ** (torch.arange(0, R, 2).float() / R)
    cos, sin = rope_cos_sin(inv_freq, torch.arange(3)[None], x.dtype)
    want = x.clone()
    for p in range(3):
        for i in range(R // 2):
            a = p * inv_freq[i].item()
            even, odd = x[0, p, :, 2 * i], x[0, p, :, 2 * i + 1]
            want[0, p, :, 2 * i] = even * math.cos(a) - odd * math.sin(a)
            want[0, p, :, 2 * i + 1] = odd * math.cos(a) + even * math.sin(a)
    assert torch.allclose(apply_rope_adjacent(x, cos, sin), want, atol=1e-6)
    assert not torch.allclose(apply_rope(x, cos, sin), want, atol=1e-3)  # Llama's pairs differ


def test_logits_and_cached_decode_match_hf(ernie):
    assert_logits_match(*ernie)


def test_engine_greedy_matches_hf(ernie):
    assert_engine_matches_hf(*ernie)


def test_the_triton_path_leaves_adjacent_pairs_unfused(ernie):
    """The fused Triton layers rotate Llama's pairs: an AdjacentPairsModel body is not fused."""
    from nanoserve.models.triton_layers import use_triton_layers

    assert use_triton_layers(load(ernie[0])[0])["fused_llama_layers"] == 0


def test_defaults_and_tied_head_match_hf(tmp_path):
    """Without use_bias and with the class's tied head and RoPE base."""
    transformers.logging.set_verbosity_error()
    config = {k: v for k, v in ERNIE.items() if k not in ("use_bias", "tie_word_embeddings",
                                                          "rope_parameters")}
    hf = tiny_hf_checkpoint(transformers.Ernie4_5Config(**config), tmp_path, seed=12)
    cfg = load(tmp_path)[1]
    assert cfg.tie_word_embeddings and not cfg.mlp_bias and cfg.rope_theta == 500000.0
    assert_logits_match(tmp_path, hf, steps=4)


@pytest.mark.parametrize("drop", ["adjacent_pairs", "biases"])
def test_each_ernie_mechanism_matters(ernie, drop):
    """Negative control: Llama's RoPE pairs, or the biases zeroed, move the logits past TOL."""
    path, hf = ernie
    model, cfg = load(path)
    for layer in model.model.layers:
        if drop == "adjacent_pairs":
            layer.self_attn.rotate = apply_rope
        else:
            for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
                linear.bias.data.zero_()
    assert logits_delta(model, cfg, hf) > TOL


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("ernie4_5"))


def _hf_dict(**changes):
    cfg = transformers.Ernie4_5Config(**ERNIE).to_dict()
    cfg["architectures"] = ["Ernie4_5ForCausalLM"]
    return {**cfg, **changes}


@pytest.mark.parametrize("changes, named", [
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     "partial_rotary_factor=0.5"),
    (dict(sliding_window=8), "sliding_window=8"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types="),
    (dict(hidden_act="tanh"), "hidden_act='tanh'"),
])
def test_refused_fields_are_named(changes, named):
    with pytest.raises(ConfigError, match=named):
        config_from_hf(_hf_dict(**changes))


def test_saved_checkpoint_reads_back_in_transformers(ernie, tmp_path):
    assert_saved_checkpoint_reads_back(*ernie, tmp_path)


def test_a_model_with_biases_on_some_projections_only_is_refused_on_saving(ernie, tmp_path):
    from nanoserve.models.loader import save_checkpoint

    model, _ = load(ernie[0])
    model.config.mlp_bias = False
    with pytest.raises(ConfigError, match="no ernie4_5 config.json describes this model: mlp_bias"):
        save_checkpoint(model, tmp_path)
