"""Granite 3 against transformers' GraniteForCausalLM (tests/family_oracle.py): logits, cached
decode and the engine's greedy tokens, with each multiplier dropped as a negative control."""

from __future__ import annotations

import pytest
import transformers
from family_oracle import (
    TOL,
    assert_engine_matches_hf,
    assert_every_field_classified,
    assert_logits_match,
    family_checkpoint,
    load,
    logits_delta,
)

from nanoserve.errors import ConfigError
from nanoserve.models.family import family_of
from nanoserve.models.hf_config import config_from_hf

# multipliers far from 1, GQA, biases on the projections
GRANITE = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=257, max_position_embeddings=256,
               embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2,
               logits_scaling=2.5, attention_bias=True, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp("granite"),
                             transformers.GraniteConfig(**GRANITE), seed=5)


def test_logits_and_cached_decode_match_hf(granite):
    assert_logits_match(*granite)


def test_engine_greedy_matches_hf(granite):
    assert_engine_matches_hf(*granite)


@pytest.mark.parametrize("drop", ["embedding", "residual", "attention", "logits"])
def test_each_multiplier_matters(granite, drop):
    """Negative control: with one multiplier back at Llama's value the logits move past TOL."""
    from dataclasses import replace

    path, hf = granite
    model, cfg = load(path)
    options = cfg.family_options
    if drop == "embedding":
        model.config.family_options = replace(options, embedding_multiplier=1.0)
    elif drop == "residual":
        for layer in model.model.layers:
            layer.residual_multiplier = 1.0
    elif drop == "attention":
        for layer in model.model.layers:
            layer.self_attn.scale = None
    else:
        model.config.family_options = replace(options, logits_scaling=1.0)
    assert logits_delta(model, cfg, hf) > TOL


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("granite"))


def test_a_bad_multiplier_is_refused_by_name():
    cfg = transformers.GraniteConfig(**dict(GRANITE, logits_scaling=0.0)).to_dict()
    cfg["architectures"] = ["GraniteForCausalLM"]
    with pytest.raises(ConfigError, match="logits_scaling=0.0"):
        config_from_hf(cfg)


def test_saving_a_granite_checkpoint_is_refused_by_name(granite, tmp_path):
    from nanoserve.models.loader import save_checkpoint

    model, cfg = load(granite[0])
    assert cfg.hf_model_type == "granite" and cfg.attn_scale == 0.2
    with pytest.raises(ConfigError, match="saving a granite checkpoint is not supported"):
        save_checkpoint(model, tmp_path)
