"""Phi-2 against transformers' PhiForCausalLM (tests/family_oracle.py): logits, cached decode and
the engine's greedy tokens, with and without the q/k LayerNorm; the parallel residual, the rotary
fraction, the LayerNorm biases, the LM head's bias and the q/k LayerNorm each undone as a negative
control; RoPE scaling refused by name; quantization and tensor parallelism refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers
from family_oracle import (
    TOL,
    assert_engine_matches_hf,
    assert_every_field_classified,
    assert_logits_match,
    assert_own_layout_refused,
    family_checkpoint,
    load,
    logits_delta,
)

from nanoserve.errors import ConfigError
from nanoserve.models.family import family_of
from nanoserve.models.hf_config import config_from_hf
from nanoserve.models.layers import rope_inv_freq

# GQA, three quarters of each head rotated, q/k LayerNorm, another epsilon and RoPE base
PHI = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=257, max_position_embeddings=256,
           layer_norm_eps=1e-3, qk_layernorm=True,
           rope_parameters=dict(rope_type="default", rope_theta=500.0, partial_rotary_factor=0.75))
# no q/k LayerNorm, a tied head (its bias still its own), the exact GELU
PHI_B = dict(PHI, qk_layernorm=False, tie_word_embeddings=True, hidden_act="gelu",
             num_key_value_heads=4)


def _checkpoint(tmp_path_factory, name, fields, seed):
    return family_checkpoint(tmp_path_factory.mktemp(name),
                             transformers.PhiConfig(**fields), seed=seed)


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "phi", PHI, seed=6)


@pytest.fixture(scope="module")
def phi_b(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "phi_b", PHI_B, seed=7)


def test_logits_and_cached_decode_match_hf(phi, phi_b):
    assert_logits_match(*phi)
    assert_logits_match(*phi_b)


def test_engine_greedy_matches_hf(phi):
    assert_engine_matches_hf(*phi)


def test_config_reads_what_was_asked(phi, phi_b):
    _, cfg = load(phi[0])
    assert (cfg.arch, cfg.rotary_dim, cfg.rope_theta, cfg.norm_eps) == ("phi", 12, 500.0, 1e-3)
    assert cfg.family_options.qk_norm == "shared" and cfg.n_kv_heads == 2
    _, cfg_b = load(phi_b[0])
    assert cfg_b.family_options.qk_norm is None and cfg_b.tie_word_embeddings


def test_transformers_4_rope_names_are_read():
    legacy = dict(PHI, partial_rotary_factor=0.25, rope_theta=2000.0,
                  architectures=["PhiForCausalLM"])
    del legacy["rope_parameters"]
    hf = transformers.PhiConfig(**legacy).rope_parameters
    cfg = config_from_hf(legacy)
    assert (cfg.partial_rotary_factor, cfg.rope_theta) == (hf["partial_rotary_factor"],
                                                           hf["rope_theta"]) == (0.25, 2000.0)


@pytest.mark.parametrize("undo", ["parallel_residual", "rotary_fraction", "layernorm_bias",
                                  "lm_head_bias", "qk_layernorm"])
def test_each_mechanism_matters(phi, undo):
    """Negative control: each mechanism undone in the loaded model moves the logits past TOL."""
    path, hf = phi
    model, cfg = load(path)
    layers = model.model.layers
    with torch.no_grad():
        if undo == "parallel_residual":  # the MLP reads ln(x + attn) instead
            for layer in layers:
                layer.parallel_residual = False
        elif undo == "rotary_fraction":
            model.model.inv_freq = {"global": rope_inv_freq(replace(cfg, partial_rotary_factor=1))}
        elif undo == "layernorm_bias":
            for layer in layers:
                layer.input_layernorm.bias.zero_()
            model.model.norm.bias.zero_()
        elif undo == "lm_head_bias":
            model.lm_head.bias.zero_()
        else:
            for layer in layers:
                layer.self_attn.head_norm = None
    assert logits_delta(model, cfg, hf) > TOL


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("phi"))


def test_rope_scaling_is_refused_by_name():
    cfg = transformers.PhiConfig(**PHI).to_dict()
    cfg.update(architectures=["PhiForCausalLM"],
               rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=500.0))
    with pytest.raises(ConfigError, match="rope_parameters.rope_type='dynamic'"):
        config_from_hf(cfg)


def test_quantization_and_tensor_parallel_refuse_by_name(phi):
    assert_own_layout_refused(phi[0])
