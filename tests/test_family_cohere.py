"""Cohere (Command-R) against transformers' CohereForCausalLM (tests/family_oracle.py): logits,
cached decode and the engine's greedy tokens, with and without the per-head q/k LayerNorm; the
parallel residual, the interleaved RoPE, the LayerNorm's mean subtraction, the logit scale and the
q/k LayerNorm each undone as a negative control; RoPE scaling refused by name; a PEFT LoRA adapter
matches PEFT; quantization and tensor parallelism refuse by name."""

from __future__ import annotations

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
from nanoserve.models.layers import RMSNorm, apply_rope

# GQA, head_dim 16 (not hidden / heads = 12), q/k/v/o biases, per-head q/k LayerNorm, logits × 0.4
COHERE = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=256,
              layer_norm_eps=1e-3, logit_scale=0.4, attention_bias=True, use_qk_norm=True,
              rope_parameters=dict(rope_type="default", rope_theta=500.0))
# no q/k norm, no biases, an untied head, another activation, head_dim = hidden / heads
COHERE_B = dict(COHERE, use_qk_norm=False, attention_bias=False, tie_word_embeddings=False,
                hidden_act="gelu", head_dim=12)


def _checkpoint(tmp_path_factory, name, fields, seed):
    return family_checkpoint(tmp_path_factory.mktemp(name),
                             transformers.CohereConfig(**fields), seed=seed)


@pytest.fixture(scope="module")
def cohere(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "cohere", COHERE, seed=12)


@pytest.fixture(scope="module")
def cohere_b(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "cohere_b", COHERE_B, seed=13)


def test_logits_and_cached_decode_match_hf(cohere, cohere_b):
    assert_logits_match(*cohere)
    assert_logits_match(*cohere_b)


def test_engine_greedy_matches_hf(cohere):
    assert_engine_matches_hf(*cohere)


def test_config_reads_what_was_asked(cohere, cohere_b):
    _, cfg = load(cohere[0])
    assert (cfg.arch, cfg.head_dim, cfg.rope_theta, cfg.norm_eps) == ("cohere", 16, 500.0, 1e-3)
    options = cfg.family_options
    assert options.logit_scale == 0.4 and options.qk_norm == "per_head" and not options.norm_bias
    _, cfg_b = load(cohere_b[0])
    assert cfg_b.family_options.qk_norm is None and not cfg_b.tie_word_embeddings


def test_layernorms_have_no_bias(cohere):
    model, _ = load(cohere[0])
    norms = [model.model.norm, *(layer.input_layernorm for layer in model.model.layers)]
    assert all(norm.bias is None for norm in norms)


@pytest.mark.parametrize("undo", ["parallel_residual", "interleaved_rope", "mean_subtraction",
                                  "logit_scale", "qk_norm"])
def test_each_mechanism_matters(cohere, undo):
    """Negative control: each mechanism undone in the loaded model moves the logits past TOL."""
    path, hf = cohere
    model, cfg = load(path)
    layers = model.model.layers
    with torch.no_grad():
        if undo == "parallel_residual":
            for layer in layers:
                layer.parallel_residual = False
        elif undo == "interleaved_rope":  # Llama's (i, i + d/2) pairs
            for layer in layers:
                layer.self_attn.rotate = apply_rope
        elif undo == "mean_subtraction":  # an RMSNorm with the same weights
            for layer in layers:
                rms = RMSNorm(cfg.hidden_size, cfg.norm_eps)
                rms.weight.copy_(layer.input_layernorm.weight)
                layer.input_layernorm = rms
        elif undo == "logit_scale":
            from dataclasses import replace

            model.config.family_options = replace(cfg.family_options, logit_scale=1.0)
        else:
            for layer in layers:
                layer.self_attn.head_norm = None
    assert logits_delta(model, cfg, hf) > TOL


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("cohere"))


def test_rope_scaling_and_a_bad_logit_scale_are_refused_by_name():
    cfg = transformers.CohereConfig(**COHERE).to_dict()
    cfg.update(architectures=["CohereForCausalLM"])
    scaled = dict(cfg, rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=500.0))
    with pytest.raises(ConfigError, match="rope_parameters.rope_type='linear'"):
        config_from_hf(scaled)
    with pytest.raises(ConfigError, match="logit_scale=0.0"):
        config_from_hf(dict(cfg, logit_scale=0.0))


def test_peft_lora_adapter_matches_peft(cohere, tmp_path):
    """HF's module names are the model's, so PEFT adapters apply as they are (q and k included:
    the interleaved RoPE is computed, not folded into a permutation of their rows)."""
    from lora_helpers import make_peft_adapter

    from nanoserve.lora import apply_lora, load_lora_adapter

    path, hf = cohere
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model, adapter_dir = make_peft_adapter(hf, tmp_path / "adapter", targets)
    model, cfg = load(path)
    ids = torch.arange(3, 27)[None]
    with torch.no_grad():
        want = peft_model(ids).logits
        base = hf(ids).logits
        apply_lora(model, load_lora_adapter(adapter_dir, cfg))
        got = model(ids)
    assert (got - want).abs().max().item() <= TOL
    assert (want - base).abs().max().item() > 100 * TOL  # the control: the adapter matters


def test_quantization_and_tensor_parallel_refuse_by_name(cohere):
    assert_own_layout_refused(cohere[0])
