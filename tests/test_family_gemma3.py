"""Gemma 3 as released (Gemma3ForConditionalGeneration) against transformers' own multimodal class
on text-only input ids (tests/family_oracle.py): logits, cached decode and the engine's greedy
tokens past the window, from both checkpoint layouts (transformers 4.50's `language_model.model.*`,
which transformers 5 still writes, and transformers 5's module names `model.language_model.*`); the
vision tower's tensors dropped with a log line; the renaming shown necessary (negative control);
disagreeing tie flags refused by name; saving refused by name."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from family_oracle import (
    TOL,
    assert_engine_matches_hf,
    assert_every_field_classified,
    assert_logits_match,
    load,
    logits_delta,
)
from safetensors import safe_open
from safetensors.torch import save_file
from testdata import tiny_hf_checkpoint

from nanoserve.errors import CheckpointError, ConfigError
from nanoserve.models.family import family_of
from nanoserve.models.hf_config import config_from_hf

# the language model: window 6 in layers 0 and 2, q/k norms, a soft-capped head, GQA, biases
TEXT = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=256,
            sliding_window=6, query_pre_attn_scalar=20, final_logit_softcapping=5.0,
            attention_bias=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=5000.0),
                                 sliding_attention=dict(rope_type="default", rope_theta=100.0)))
VISION = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
              num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
GEMMA3 = dict(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
              boi_token_index=254, eoi_token_index=255, image_token_index=256)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    path = tmp_path_factory.mktemp("gemma3")
    hf = tiny_hf_checkpoint(transformers.Gemma3Config(**GEMMA3), path, seed=8)
    assert isinstance(hf, transformers.Gemma3ForConditionalGeneration)
    return path, hf


@pytest.fixture(scope="module")
def gemma3_v5_names(gemma3, tmp_path_factory):
    """The same model saved under transformers 5's module names (model.language_model.*)."""
    path, hf = gemma3
    out = tmp_path_factory.mktemp("gemma3_v5")
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.tiktoken"):
        if (path / name).exists():
            (out / name).write_bytes((path / name).read_bytes())
    return out, hf


def _tensor_names(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def test_the_two_layouts_are_what_they_claim(gemma3, gemma3_v5_names):
    legacy = _tensor_names(gemma3[0])
    v5 = _tensor_names(gemma3_v5_names[0])
    assert any(k.startswith("language_model.model.layers.") for k in legacy)
    assert any(k.startswith("model.language_model.layers.") for k in v5)
    assert any(k.startswith("model.vision_tower.") for k in v5)


def test_logits_and_cached_decode_match_hf(gemma3):
    assert_logits_match(*gemma3)


def test_transformers_5_names_match_hf(gemma3_v5_names):
    assert_logits_match(*gemma3_v5_names, steps=4)


def test_engine_greedy_matches_hf(gemma3):
    assert_engine_matches_hf(*gemma3)


def test_vision_tensors_are_dropped_with_a_log_line(gemma3, caplog):
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        model, cfg = load(gemma3[0])
    assert "vision tower" in caplog.text and cfg.hf_model_type == "gemma3"
    assert not any("vision" in name for name, _ in model.named_parameters())
    assert cfg.local_rope_theta == 100.0 and cfg.qk_norm == "per_head"


def test_the_text_configs_final_softcap_is_not_applied(gemma3):
    """Negative control: Gemma3ForConditionalGeneration's head ignores final_logit_softcapping
    (here 5.0); nanoserve capping the logits as Gemma3ForCausalLM does moves them past TOL."""
    path, hf = gemma3
    model, cfg = load(path)
    assert cfg.final_softcap is None
    model.config.final_softcap = 5.0
    assert logits_delta(model, cfg, hf) > TOL


def test_without_the_renaming_the_language_model_is_missing(gemma3, monkeypatch):
    """Negative control: the family's renaming switched off, the checkpoint does not load."""
    from nanoserve.models.families import gemma3 as module

    monkeypatch.setattr(module, "rename_language_model", lambda key: key)
    with pytest.raises(CheckpointError, match="missing tensor 'model.embed_tokens.weight'"):
        load(gemma3[0])


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("gemma3"))


def _hf_dict(text=None, **changes):
    cfg = transformers.Gemma3Config(**GEMMA3).to_dict()
    cfg["architectures"] = ["Gemma3ForConditionalGeneration"]
    cfg["text_config"].update(text or {})
    return {**cfg, **changes}


def test_untied_head_is_read_from_the_top_level():
    assert not config_from_hf(_hf_dict(dict(tie_word_embeddings=False),
                                       tie_word_embeddings=False)).tie_word_embeddings


@pytest.mark.parametrize("text, changes, named", [
    (dict(tie_word_embeddings=False), {}, "text_config.tie_word_embeddings=False"),
    ({}, dict(text_config=None), "text_config=None"),
    (dict(use_bidirectional_attention=True), {}, "use_bidirectional_attention=True"),
    (dict(rope_parameters=dict(TEXT["rope_parameters"],
                               sliding_attention=dict(rope_type="linear", factor=2.0))),
     {}, "sliding_attention="),
])
def test_refused_fields_are_named(text, changes, named):
    with pytest.raises(ConfigError, match=named):
        config_from_hf(_hf_dict(text, **changes))


def test_saving_is_refused_by_name(gemma3, tmp_path):
    from nanoserve.models.loader import save_checkpoint

    model, _ = load(gemma3[0])
    with pytest.raises(ConfigError, match="saving a gemma3 checkpoint is not supported"):
        save_checkpoint(model, tmp_path)


def test_image_token_ids_are_ordinary_tokens_without_images(gemma3):
    """An id inside the vocabulary that Gemma 3 calls an image placeholder is, without an image,
    embedded as itself by both."""
    path, hf = gemma3
    model, _ = load(path)
    ids = torch.tensor([[5, 254, 200, 255, 9]])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4
