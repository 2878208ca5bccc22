"""StableLM against transformers' StableLmForCausalLM (tests/family_oracle.py): logits, cached
decode and the engine's greedy tokens for the sequential block with per-head q/k LayerNorms and for
the parallel residual; the parallel residual, the rotary fraction, the LayerNorm biases and the
per-head q/k LayerNorm each undone as a negative control; RoPE scaling refused by name; a PEFT LoRA
adapter (HF's module names are the model's) matches PEFT; quantization and tensor parallelism
refuse by name."""

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

# sequential, GQA, q/k/v biases, a LayerNorm per head of q and k, half of each head rotated
STABLELM = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=257, max_position_embeddings=256,
                layer_norm_eps=1e-3, use_qkv_bias=True, qk_layernorm=True,
                rope_parameters=dict(rope_type="default", rope_theta=500.0,
                                     partial_rotary_factor=0.5))
# the parallel residual from one norm, a tied head, another activation
STABLELM_B = dict(STABLELM, use_parallel_residual=True, qk_layernorm=False, use_qkv_bias=False,
                  tie_word_embeddings=True, hidden_act="gelu")


def _checkpoint(tmp_path_factory, name, fields, seed):
    return family_checkpoint(tmp_path_factory.mktemp(name),
                             transformers.StableLmConfig(**fields), seed=seed)


@pytest.fixture(scope="module")
def stablelm(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "stablelm", STABLELM, seed=8)


@pytest.fixture(scope="module")
def stablelm_b(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "stablelm_b", STABLELM_B, seed=9)


def test_logits_and_cached_decode_match_hf(stablelm, stablelm_b):
    assert_logits_match(*stablelm)
    assert_logits_match(*stablelm_b)


def test_engine_greedy_matches_hf(stablelm, stablelm_b):
    assert_engine_matches_hf(*stablelm)
    assert_engine_matches_hf(*stablelm_b, backends=("cpu",))


def test_config_reads_what_was_asked(stablelm, stablelm_b):
    _, cfg = load(stablelm[0])
    assert (cfg.arch, cfg.rotary_dim, cfg.rope_theta, cfg.norm_eps) == ("stablelm", 8, 500.0, 1e-3)
    assert cfg.family_options.qk_norm == "per_head" and cfg.qkv_bias and not cfg.o_bias
    _, cfg_b = load(stablelm_b[0])
    assert cfg_b.family_options.parallel_residual and cfg_b.family_options.shared_norm


@pytest.mark.parametrize("undo", ["parallel_residual", "rotary_fraction", "layernorm_bias",
                                  "per_head_norm", "qk_layernorm"])
def test_each_mechanism_matters(stablelm, stablelm_b, undo):
    """Negative control: each mechanism undone in the loaded model moves the logits past TOL."""
    path, hf = stablelm_b if undo == "parallel_residual" else stablelm
    model, cfg = load(path)
    layers = model.model.layers
    with torch.no_grad():
        if undo == "parallel_residual":
            for layer in layers:
                layer.parallel_residual = False
        elif undo == "rotary_fraction":
            model.model.inv_freq = {"global": rope_inv_freq(replace(cfg, partial_rotary_factor=1))}
        elif undo == "layernorm_bias":
            for layer in layers:
                layer.input_layernorm.bias.zero_()
                layer.post_attention_layernorm.bias.zero_()
        elif undo == "per_head_norm":  # every head given the heads' mean weight
            for layer in layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.copy_(norm.weight.mean(0, keepdim=True).expand_as(norm.weight))
        else:
            for layer in layers:
                layer.self_attn.head_norm = None
    assert logits_delta(model, cfg, hf) > TOL


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("stablelm"))


def test_rope_scaling_is_refused_by_name():
    cfg = transformers.StableLmConfig(**STABLELM).to_dict()
    cfg.update(architectures=["StableLmForCausalLM"],
               rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=500.0))
    with pytest.raises(ConfigError, match="rope_parameters.rope_type='linear'"):
        config_from_hf(cfg)


def test_peft_lora_adapter_matches_peft(stablelm, tmp_path):
    """HF's module names are the model's, so PEFT adapters apply as they are."""
    from lora_helpers import make_peft_adapter

    from nanoserve.lora import apply_lora, load_lora_adapter

    path, hf = stablelm
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


def test_quantization_and_tensor_parallel_refuse_by_name(stablelm):
    assert_own_layout_refused(stablelm[0])
