"""EXAONE 4.0 against transformers' Exaone4ForCausalLM (tests/family_oracle.py): logits, cached
decode and the engine's greedy tokens far past the window, with sliding layers (RoPE) and global
layers (NoPE), and without a window (every layer global, with RoPE); NoPE and the window each
dropped as a negative control; layer_types from sliding_window_pattern as transformers fills it;
refused fields named; a saved checkpoint read back by transformers."""

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

# window 6 in layers 0 and 2, layer 1 global without RoPE; llama3 RoPE scaling (as released), GQA,
# head_dim 16 (not hidden / heads = 12)
EXAONE4 = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=256,
               rms_norm_eps=1e-6, sliding_window=6, tie_word_embeddings=True,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               rope_parameters=dict(rope_type="llama3", rope_theta=1000.0, factor=8.0,
                                    low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=32))
# EXAONE 4.0 1.2B's layout: no window, every layer global and rotating
NO_WINDOW = dict(EXAONE4, sliding_window=None, layer_types=["full_attention"] * 3,
                 tie_word_embeddings=False,
                 rope_parameters=dict(rope_type="default", rope_theta=500.0))


@pytest.fixture(scope="module")
def exaone4(tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp("exaone4"),
                             transformers.Exaone4Config(**EXAONE4), seed=9)


def test_config_maps_onto_existing_fields(exaone4):
    cfg = load(exaone4[0])[1]
    assert (cfg.block, cfg.qk_norm, cfg.no_rope_layers) == ("post_norm", "per_head", [1])
    assert cfg.layer_window(0) == 6 and cfg.layer_window(1) is None
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.norm_scale_fp32)


def test_logits_and_cached_decode_match_hf(exaone4):
    assert_logits_match(*exaone4)


def test_engine_greedy_matches_hf(exaone4):
    assert_engine_matches_hf(*exaone4)


def test_without_a_window_every_layer_rotates(tmp_path):
    transformers.logging.set_verbosity_error()
    hf = tiny_hf_checkpoint(transformers.Exaone4Config(**NO_WINDOW), tmp_path, seed=10)
    cfg = load(tmp_path)[1]
    assert cfg.no_rope_layers is None and cfg.sliding_window is None
    assert_logits_match(tmp_path, hf, steps=4)


@pytest.mark.parametrize("drop", ["nope", "window"])
def test_each_exaone4_mechanism_matters(exaone4, drop):
    """Negative control: RoPE in the global layer too, or no window, moves the logits past TOL."""
    path, hf = exaone4
    model, cfg = load(path)
    for layer in model.model.layers:
        if drop == "nope":
            layer.rope = "global"
        else:
            layer.self_attn.window = None
    assert logits_delta(model, cfg, hf) > TOL


def _hf_dict(config=EXAONE4, **changes):
    cfg = transformers.Exaone4Config(**config).to_dict()
    cfg["architectures"] = ["Exaone4ForCausalLM"]
    return {**cfg, **changes}


def test_layer_types_from_the_pattern_as_transformers_fills_them():
    config = dict(EXAONE4, num_hidden_layers=6, sliding_window_pattern=3, layer_types=None)
    hf = _hf_dict(config)
    ours = config_from_hf({**hf, "layer_types": None})
    assert ours.layer_types == hf["layer_types"] and ours.no_rope_layers == [2, 5]


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("exaone4"))


@pytest.mark.parametrize("changes, named", [
    (dict(layer_types=None, sliding_window_pattern="LLLG"), "sliding_window_pattern='LLLG'"),
    (dict(sliding_window=None), "sliding_window=None"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     "partial_rotary_factor=0.5"),
])
def test_refused_fields_are_named(changes, named):
    with pytest.raises(ConfigError, match=named):
        config_from_hf(_hf_dict(**changes))


def test_saved_checkpoint_reads_back_in_transformers(exaone4, tmp_path):
    assert_saved_checkpoint_reads_back(*exaone4, tmp_path)
