"""OLMo 3 against transformers' Olmo3ForCausalLM (tests/family_oracle.py): logits, cached decode and
the engine's greedy tokens far past the window; the window and the sliding layers' own RoPE each
dropped as a negative control; the ambiguous RoPE spellings refused by name; a saved checkpoint read
back by transformers."""

from __future__ import annotations

import pytest
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
from nanoserve.models.family import family_of
from nanoserve.models.hf_config import config_from_hf

# window 6 in layers 0 and 2, YaRN on the full-attention layer only, another base for the sliding
# ones, GQA, biases, head_dim 16 (not hidden / heads = 12)
ROPE = dict(full_attention=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                original_max_position_embeddings=64),
            sliding_attention=dict(rope_type="default", rope_theta=300.0))
OLMO3 = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=256,
             attention_bias=True, rms_norm_eps=1e-6, sliding_window=6,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters=ROPE)


@pytest.fixture(scope="module")
def olmo3(tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp("olmo3"),
                             transformers.Olmo3Config(**OLMO3), seed=6)


def test_config_reads_windows_and_both_ropes(olmo3):
    cfg = load(olmo3[0])[1]
    assert (cfg.block, cfg.qk_norm, cfg.sliding_window) == ("post_norm", "whole", 6)
    assert cfg.layer_window(1) is None and cfg.layer_window(2) == 6
    assert cfg.local_rope_theta == 300.0 and cfg.rope_scaling["rope_type"] == "yarn"


def test_logits_and_cached_decode_match_hf(olmo3):
    assert_logits_match(*olmo3)


def test_engine_greedy_matches_hf(olmo3):
    assert_engine_matches_hf(*olmo3)


def test_default_layer_types_match_hf(tmp_path):
    """Without layer_types, every fourth layer is global; the class's RoPE defaults."""
    transformers.logging.set_verbosity_error()
    config = dict(OLMO3, num_hidden_layers=4, layer_types=None, rope_parameters=None,
                  tie_word_embeddings=True, attention_bias=False)
    hf = tiny_hf_checkpoint(transformers.Olmo3Config(**config), tmp_path, seed=7)
    assert load(tmp_path)[1].layer_types[3] == "full_attention"
    assert_logits_match(tmp_path, hf, steps=4)


@pytest.mark.parametrize("drop", ["window", "local_rope"])
def test_each_olmo3_mechanism_matters(olmo3, drop):
    """Negative control: the window off, or the sliding layers rotated with the full layers' YaRN
    RoPE, moves the logits past TOL."""
    path, hf = olmo3
    model, cfg = load(path)
    for layer in model.model.layers:
        if drop == "window":
            layer.self_attn.window = None
        elif layer.rope == "local":
            layer.rope = "global"
    assert logits_delta(model, cfg, hf) > TOL


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("olmo3"))


def _hf_dict(**changes):
    cfg = transformers.Olmo3Config(**OLMO3).to_dict()
    cfg["architectures"] = ["Olmo3ForCausalLM"]
    return {**cfg, **changes}


@pytest.mark.parametrize("changes, named", [
    (dict(rope_parameters=None, rope_theta=1000.0), "rope_theta=1000.0"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4)), "rope_parameters="),
    (dict(rope_parameters=dict(ROPE, sliding_attention=dict(rope_type="linear", factor=2.0))),
     "rope_parameters.sliding_attention="),
    (dict(sliding_window=None), "sliding_window=None"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
])
def test_refused_fields_are_named(changes, named):
    with pytest.raises(ConfigError, match=named):
        config_from_hf(_hf_dict(**changes))


def test_saved_checkpoint_reads_back_in_transformers(olmo3, tmp_path):
    assert_saved_checkpoint_reads_back(*olmo3, tmp_path)
