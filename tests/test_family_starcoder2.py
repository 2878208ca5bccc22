"""StarCoder2 against transformers' Starcoder2ForCausalLM (tests/family_oracle.py): logits, cached
decode and the engine's greedy tokens far past a sliding window of 6; the window, the LayerNorm
biases and the MLP's GELU each undone as a negative control; RoPE scaling refused by name;
quantization and tensor parallelism refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
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

# GQA, head_dim 16 (not hidden / heads = 12), biases, a window of 6, the tied head (class default)
STARCODER2 = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=256,
                  norm_epsilon=1e-3, sliding_window=6,
                  rope_parameters=dict(rope_type="default", rope_theta=500.0))
# no window, no projection biases, an untied head, the exact GELU
STARCODER2_B = dict(STARCODER2, sliding_window=None, use_bias=False, tie_word_embeddings=False,
                    hidden_act="gelu")


def _checkpoint(tmp_path_factory, name, fields, seed):
    return family_checkpoint(tmp_path_factory.mktemp(name),
                             transformers.Starcoder2Config(**fields), seed=seed)


@pytest.fixture(scope="module")
def starcoder2(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "starcoder2", STARCODER2, seed=10)


@pytest.fixture(scope="module")
def starcoder2_b(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "starcoder2_b", STARCODER2_B, seed=11)


def test_logits_and_cached_decode_match_hf(starcoder2, starcoder2_b):
    assert_logits_match(*starcoder2)
    assert_logits_match(*starcoder2_b)


def test_engine_greedy_matches_hf_past_the_window(starcoder2):
    assert_engine_matches_hf(*starcoder2)


def test_config_reads_what_was_asked(starcoder2, starcoder2_b):
    _, cfg = load(starcoder2[0])
    assert (cfg.arch, cfg.head_dim, cfg.sliding_window, cfg.norm_eps) == ("starcoder2", 16, 6, 1e-3)
    assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias and cfg.tie_word_embeddings
    _, cfg_b = load(starcoder2_b[0])
    assert cfg_b.sliding_window is None and not cfg_b.mlp_bias and not cfg_b.tie_word_embeddings


@pytest.mark.parametrize("undo", ["sliding_window", "layernorm_bias", "gelu"])
def test_each_mechanism_matters(starcoder2, undo):
    """Negative control: each mechanism undone in the loaded model moves the logits past TOL
    (logits_delta's 24 tokens run past the window of 6)."""
    path, hf = starcoder2
    model, cfg = load(path)
    layers = model.model.layers
    with torch.no_grad():
        for layer in layers:
            if undo == "sliding_window":
                layer.self_attn.window = None
            elif undo == "layernorm_bias":
                layer.input_layernorm.bias.zero_()
                layer.post_attention_layernorm.bias.zero_()
            else:
                layer.mlp.act = F.silu
    assert logits_delta(model, cfg, hf) > TOL


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("starcoder2"))


def test_rope_scaling_is_refused_by_name():
    cfg = transformers.Starcoder2Config(**STARCODER2).to_dict()
    cfg.update(architectures=["Starcoder2ForCausalLM"],
               rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=500.0))
    with pytest.raises(ConfigError, match="rope_parameters.rope_type='yarn'"):
        config_from_hf(cfg)


def test_quantization_and_tensor_parallel_refuse_by_name(starcoder2):
    assert_own_layout_refused(starcoder2[0])
