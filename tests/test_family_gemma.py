"""Gemma 1 against transformers' GemmaForCausalLM (tests/family_oracle.py): logits, cached decode
and the engine's greedy tokens; (1 + w) norms, √d embeddings and GeGLU each dropped as a negative
control; the activation's two names, windows and bidirectional attention refused by name; a saved
checkpoint read back by transformers."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
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
from nanoserve.models.layers import RMSNorm

# GQA, head_dim 16 (not hidden / heads = 12), biases, GeGLU (the class default), tied head
GEMMA = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=256,
             attention_bias=True, rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default",
                                                                          rope_theta=500.0))
# untied head, linear RoPE scaling, another activation
GEMMA_B = dict(GEMMA, tie_word_embeddings=False, attention_bias=False, hidden_act="gelu",
               rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1000.0))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp("gemma"),
                             transformers.GemmaConfig(**GEMMA), seed=3)


def test_logits_and_cached_decode_match_hf(gemma):
    assert_logits_match(*gemma)


def test_untied_scaled_rope_checkpoint_matches_hf(tmp_path):
    transformers.logging.set_verbosity_error()
    hf = tiny_hf_checkpoint(transformers.GemmaConfig(**GEMMA_B), tmp_path, seed=4)
    assert_logits_match(tmp_path, hf, steps=4)
    assert load(tmp_path)[1].hidden_act == "gelu_pytorch_tanh"  # "gelu" read as transformers 5


def test_engine_greedy_matches_hf(gemma):
    assert_engine_matches_hf(*gemma)


def test_engine_greedy_on_the_triton_path_matches_hf(gemma):
    """Gemma 1 is a pre-norm body, so on the Triton path (here the interpreter) its layers run
    fused, with the (1 + w) norms and the √d embedding scale inside TritonLlamaModel; 12 tokens
    keep the interpreter's run short."""
    from nanoserve.models.triton_layers import use_triton_layers

    assert use_triton_layers(load(gemma[0])[0])["fused_llama_layers"] == 2
    assert_engine_matches_hf(*gemma, backends=("triton",), max_tokens=12)


@pytest.mark.parametrize("drop", ["unit_offset", "embed_scale", "geglu"])
def test_each_gemma_mechanism_matters(gemma, drop):
    """Negative control: each of Gemma's changes to Llama switched off moves the logits past TOL."""
    path, hf = gemma
    model, cfg = load(path)
    if drop == "unit_offset":
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.unit_offset = False
    elif drop == "embed_scale":
        model.model.embed_scale = None
    else:
        for layer in model.model.layers:
            layer.mlp.act = F.silu
    assert logits_delta(model, cfg, hf) > TOL


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("gemma"))


def _hf_dict(**changes):
    cfg = transformers.GemmaConfig(**GEMMA).to_dict()
    cfg["architectures"] = ["GemmaForCausalLM"]
    return {**cfg, **changes}


@pytest.mark.parametrize("changes, named", [
    (dict(hidden_act="gelu", hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(sliding_window=8), "sliding_window=8"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types="),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.5)),
     "partial_rotary_factor=0.5"),
])
def test_refused_fields_are_named(changes, named):
    with pytest.raises(ConfigError, match=named):
        config_from_hf(_hf_dict(**changes))


def test_agreeing_activation_names_load():
    cfg = config_from_hf(_hf_dict(hidden_act="gelu", hidden_activation="gelu_pytorch_tanh"))
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.head_dim == 16


def test_saved_checkpoint_reads_back_in_transformers(gemma, tmp_path):
    assert_saved_checkpoint_reads_back(*gemma, tmp_path)
