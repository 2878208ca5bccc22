"""ModelConfig from HF config.json: transformers 4.x and 5.x spellings give the same config."""

from __future__ import annotations

import pytest

from nanoserve import ConfigError
from nanoserve.models.config import GPT2_PRESETS, ModelConfig, gpt2_config

LLAMA_BASE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                  hidden_size=2048,
                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=8192,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True)
SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def test_transformers_4_and_5_rope_forms_agree():
    v4 = ModelConfig.from_hf({**LLAMA_BASE, "rope_theta": 500000.0, "rope_scaling": dict(SCALING)})
    v5 = ModelConfig.from_hf({**LLAMA_BASE, "rope_parameters": {**SCALING, "rope_theta": 500000.0}})
    assert v4 == v5
    assert (
        v5.rope_theta == 500000.0 and v5.rope_scaling["rope_type"] == "llama3"
        and v5.n_kv_heads == 8
    )


def test_default_rope_parameters_mean_no_scaling():
    v5 = ModelConfig.from_hf({**LLAMA_BASE,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    assert v5.rope_scaling is None and v5.rope_theta == 10000.0


def test_qwen2_gets_qkv_bias_only():
    cfg = ModelConfig.from_hf({**LLAMA_BASE, "architectures": ["Qwen2ForCausalLM"],
                               "model_type": "qwen2"})
    assert cfg.qkv_bias and not cfg.o_bias


def test_unsupported_rope_type_is_named():
    with pytest.raises(ConfigError, match="unsupported rope scaling 'mrope'"):
        ModelConfig.from_hf({**LLAMA_BASE, "rope_scaling": {"rope_type": "mrope", "factor": 4.0}})


def test_longrope_without_its_factors_is_named():
    longrope = {"rope_type": "longrope", "factor": 4.0}
    with pytest.raises(ConfigError, match="no 'short_factor'"):
        ModelConfig.from_hf({**LLAMA_BASE, "rope_scaling": longrope})
    # the control: with its factors the same config loads
    factors = {"short_factor": [1.0] * 32, "long_factor": [2.0] * 32}  # head_dim 64 / 2
    cfg = ModelConfig.from_hf({**LLAMA_BASE, "rope_scaling": {**longrope, **factors}})
    assert cfg.rope_scaling["short_factor"] == [1.0] * 32


@pytest.mark.parametrize("name", sorted(GPT2_PRESETS))
def test_released_gpt2_sizes_have_their_parameter_counts(name):
    # 124M / 355M / 774M / 1558M as published (tied head, 1024 positions)
    expected = {"gpt2": 124.4e6, "gpt2-medium": 354.8e6, "gpt2-large": 774.0e6,
                "gpt2-xl": 1557.6e6}[name]
    assert gpt2_config(name).num_parameters() == pytest.approx(expected, rel=2e-3)
