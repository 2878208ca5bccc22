"""GLM-4 against transformers' Glm4ForCausalLM (tests/family_oracle.py): logits, cached decode and
the engine's greedy tokens; RoPE on adjacent pairs, the partial rotation, the sandwich's output
norms and the q/k/v biases each dropped as a negative control; the fused gate/up split shown exact
by a transformers 4-style config (top-level partial_rotary_factor); refused fields named; saving
refused by name."""

from __future__ import annotations

import json

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
from testdata import tiny_hf_checkpoint

from nanoserve.errors import ConfigError
from nanoserve.models.family import family_of
from nanoserve.models.hf_config import config_from_hf
from nanoserve.models.layers import apply_rope

# half of each head rotated (the class default), q/k/v biases (default), GQA, head_dim 16 (not
# hidden / heads = 12), tied head
GLM4 = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=256,
            rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
            rope_parameters=dict(rope_type="default", rope_theta=700.0,
                                 partial_rotary_factor=0.5))


@pytest.fixture(scope="module")
def glm4(tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp("glm4"),
                             transformers.Glm4Config(**GLM4), seed=13)


def test_config_maps_onto_existing_fields(glm4):
    cfg = load(glm4[0])[1]
    assert (cfg.block, cfg.rotary_dim, cfg.qkv_bias, cfg.o_bias) == ("sandwich", 8, True, False)
    assert not (cfg.norm_unit_offset or cfg.embed_scale or cfg.mlp_bias)


def test_logits_and_cached_decode_match_hf(glm4):
    assert_logits_match(*glm4)


def test_engine_greedy_matches_hf(glm4):
    assert_engine_matches_hf(*glm4)


def test_full_rotation_untied_transformers_4_config_matches_hf(tmp_path):
    """A whole head rotated, no biases, untied; config.json rewritten as transformers 4 wrote it
    (rope_theta and partial_rotary_factor at the top level)."""
    transformers.logging.set_verbosity_error()
    config = dict(GLM4, attention_bias=False, tie_word_embeddings=False,
                  rope_parameters=dict(rope_type="default", rope_theta=900.0,
                                       partial_rotary_factor=1.0))
    hf = tiny_hf_checkpoint(transformers.Glm4Config(**config), tmp_path, seed=14)
    written = json.loads((tmp_path / "config.json").read_text())
    written.pop("rope_parameters")
    written.update(rope_theta=900.0, partial_rotary_factor=1.0)
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert load(tmp_path)[1].rotary_dim == 16
    assert_logits_match(tmp_path, hf, steps=4)


@pytest.mark.parametrize("drop", ["adjacent_pairs", "partial", "output_norms", "qkv_bias"])
def test_each_glm4_mechanism_matters(glm4, drop):
    """Negative control: each of GLM-4's changes undone moves the logits past TOL."""
    path, hf = glm4
    model, cfg = load(path)
    for layer in model.model.layers:
        if drop == "adjacent_pairs":
            layer.self_attn.rotate = apply_rope
        elif drop == "partial":  # adjacent pairs over the whole head
            layer.self_attn.rotate = whole_head_adjacent
        elif drop == "output_norms":
            layer.post_attention_layernorm.weight.data.fill_(1.0)
            layer.post_feedforward_layernorm.weight.data.fill_(1.0)
        else:
            layer.self_attn.q_proj.bias.data.zero_()
            layer.self_attn.k_proj.bias.data.zero_()
    assert logits_delta(model, cfg, hf) > TOL


def whole_head_adjacent(x, cos, sin):
    """Adjacent pairs over every dim of the head, with the rotated dims' frequencies spread."""
    from nanoserve.models.families._llama_shaped import apply_rope_adjacent

    return apply_rope_adjacent(x, cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1))


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("glm4"))


def _hf_dict(**changes):
    cfg = transformers.Glm4Config(**GLM4).to_dict()
    cfg["architectures"] = ["Glm4ForCausalLM"]
    return {**cfg, **changes}


@pytest.mark.parametrize("changes, named", [
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.2)),
     "partial_rotary_factor=0.2"),  # 3 of 16 dims: no whole pairs
    (dict(sliding_window=8), "sliding_window=8"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types="),
    (dict(rope_parameters=dict(rope_type="mrope", rope_theta=1e4)), "'mrope'"),
])
def test_refused_fields_are_named(changes, named):
    with pytest.raises(ConfigError, match=named):
        config_from_hf(_hf_dict(**changes))


def test_saving_is_refused_by_name(glm4, tmp_path):
    from nanoserve.models.loader import save_checkpoint

    model, _ = load(glm4[0])
    with pytest.raises(ConfigError, match="saving a glm4 checkpoint is not supported"):
        save_checkpoint(model, tmp_path)
