"""GPT-NeoX / Pythia against transformers' GPTNeoXForCausalLM (tests/family_oracle.py): logits,
cached decode and the engine's greedy tokens for the parallel and the sequential residual; the
parallel residual, the rotary fraction, the LayerNorm biases and the per-head q|k|v layout each
undone as a negative control; RoPE scaling and a stray head_dim refused by name; quantization and
tensor parallelism refused by name."""

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

# parallel residual, half of each head rotated (not the class's 0.25), biases, another RoPE base
NEOX = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=257, max_position_embeddings=256, layer_norm_eps=1e-3,
            rope_parameters=dict(rope_type="default", rope_theta=500.0, partial_rotary_factor=0.5))
# the sequential residual, no attention biases, a tied head, the tanh GELU
NEOX_B = dict(NEOX, use_parallel_residual=False, attention_bias=False, tie_word_embeddings=True,
              hidden_act="gelu_new")


def _checkpoint(tmp_path_factory, name, fields, seed):
    return family_checkpoint(tmp_path_factory.mktemp(name),
                             transformers.GPTNeoXConfig(**fields), seed=seed)


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "neox", NEOX, seed=3)


@pytest.fixture(scope="module")
def neox_b(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "neox_b", NEOX_B, seed=4)


def test_logits_and_cached_decode_match_hf(neox, neox_b):
    assert_logits_match(*neox)
    assert_logits_match(*neox_b)


def test_engine_greedy_matches_hf(neox):
    assert_engine_matches_hf(*neox)


def test_sequential_engine_greedy_matches_hf(neox_b):
    assert_engine_matches_hf(*neox_b, backends=("torch",))


def test_config_reads_what_was_asked(neox, neox_b):
    _, cfg = load(neox[0])
    assert (cfg.arch, cfg.rotary_dim, cfg.rope_theta, cfg.norm_eps) == ("gpt_neox", 8, 500.0, 1e-3)
    assert cfg.family_options.parallel_residual and cfg.qkv_bias and not cfg.tie_word_embeddings
    _, cfg_b = load(neox_b[0])
    assert not cfg_b.family_options.parallel_residual and cfg_b.tie_word_embeddings


def test_transformers_4_rope_names_are_read():
    """Pythia's config.json says rotary_pct and rotary_emb_base at the top level."""
    legacy = dict(NEOX, rotary_pct=0.25, rotary_emb_base=2000, architectures=["GPTNeoXForCausalLM"])
    del legacy["rope_parameters"]
    hf = transformers.GPTNeoXConfig(**legacy).rope_parameters
    cfg = config_from_hf(legacy)
    assert (cfg.partial_rotary_factor, cfg.rope_theta) == (hf["partial_rotary_factor"],
                                                           hf["rope_theta"]) == (0.25, 2000)


@pytest.mark.parametrize("undo", ["parallel_residual", "rotary_fraction", "layernorm_bias",
                                  "qkv_layout"])
def test_each_mechanism_matters(neox, undo):
    """Negative control: each mechanism undone in the loaded model moves the logits past TOL."""
    path, hf = neox
    model, cfg = load(path)
    layers = model.model.layers
    with torch.no_grad():
        if undo == "parallel_residual":
            for layer in layers:
                layer.parallel_residual = False
        elif undo == "rotary_fraction":  # every dim of each head rotated
            model.model.inv_freq = {"global": rope_inv_freq(replace(cfg, partial_rotary_factor=1))}
        elif undo == "layernorm_bias":
            for name, p in model.named_parameters():
                if "layernorm.bias" in name or name == "model.norm.bias":
                    p.zero_()
        else:  # q|k|v read as three blocks of rows instead of per head
            fused = hf.gpt_neox.layers[0].attention.query_key_value.weight
            attn = layers[0].self_attn
            for proj, rows in zip((attn.q_proj, attn.k_proj, attn.v_proj), fused.chunk(3)):
                proj.weight.copy_(rows)
    assert logits_delta(model, cfg, hf) > TOL


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("gpt_neox"))


def _hf_dict(**changes):
    cfg = transformers.GPTNeoXConfig(**NEOX).to_dict()
    cfg.update(changes, architectures=["GPTNeoXForCausalLM"])
    return cfg


def test_rope_scaling_is_refused_by_name():
    rope = dict(rope_type="linear", factor=2.0, rope_theta=500.0, partial_rotary_factor=0.5)
    with pytest.raises(ConfigError, match="rope_parameters.rope_type='linear'"):
        config_from_hf(_hf_dict(rope_parameters=rope))


def test_a_head_dim_the_attention_ignores_is_refused_by_name():
    with pytest.raises(ConfigError, match="head_dim=32"):
        config_from_hf(_hf_dict(head_dim=32))


def test_quantization_and_tensor_parallel_refuse_by_name(neox):
    assert_own_layout_refused(neox[0])


def test_saving_is_refused_by_name(neox, tmp_path):
    from nanoserve.models.loader import save_checkpoint

    model, _ = load(neox[0])
    with pytest.raises(ConfigError, match="saving a gpt_neox checkpoint is not supported"):
        save_checkpoint(model, tmp_path)
