"""gpt-oss against transformers' GptOssForCausalLM (tests/family_oracle.py): logits, cached decode
and the engine's greedy tokens past the sliding window, on every attention backend; negative
controls: the sinks ignored, the SwiGLU's clamp removed, the experts' gate/up columns read as
halves instead of interleaved, each moves the logits past TOL.

The checkpoints are tiny random ones with everything HF's init leaves at 0 or 1 randomised (the
experts' biases, the sinks), and expert weights large enough that the clamp acts (swiglu_limit is
lowered too, so a good share of gate and up values lie past it).
"""

from __future__ import annotations

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
from testdata import tiny_hf_checkpoint

from nanoserve.errors import ConfigError
from nanoserve.models.family import family_of
from nanoserve.models.hf_config import config_from_hf

YARN = dict(rope_type="yarn", factor=4.0, beta_fast=8.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=16, rope_theta=10000.0)
# GQA, a window of 6 in the sliding layers (0 and 2), biases, top 2 of 4 experts, YaRN
GPT_OSS = dict(hidden_size=64, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=256,
               sliding_window=6, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-4,
               swiglu_alpha=1.3, swiglu_limit=1.5, rope_parameters=YARN)
# the other values: no biases, a tied head, a head_dim that is not hidden / heads, own layer types
VARIANT = dict(GPT_OSS, attention_bias=False, tie_word_embeddings=True, head_dim=24,
               layer_types=["full_attention", "sliding_attention", "sliding_attention"],
               num_experts_per_tok=3, sliding_window=7)


def _checkpoint(path, fields: dict, seed: int):
    """A random GptOss checkpoint with its sinks N(0, 1), expert biases N(0, 0.1) and expert weights
    × 40, saved to `path` (testdata.tiny_hf_checkpoint randomises only '.bias' and 1-D weights)."""
    hf = tiny_hf_checkpoint(transformers.GptOssConfig(**fields), path, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("_proj_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.mul_(40.0)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, _checkpoint(path, GPT_OSS, seed=7)


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    path = tmp_path_factory.mktemp("gpt_oss_variant")
    return path, _checkpoint(path, VARIANT, seed=8)


def test_the_clamp_acts_in_the_test_checkpoint(gpt_oss):
    """The negative control below means something only if gate / up values pass the limit."""
    path, hf = gpt_oss
    ids = torch.randint(0, 257, (1, 24), generator=torch.Generator().manual_seed(0))
    seen = []
    experts = hf.model.layers[0].mlp.experts
    hook = experts.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        hf(ids)
    hook.remove()
    gate_up = seen[0] @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > GPT_OSS["swiglu_limit"]).float().mean() > 0.2


def test_logits_and_cached_decode_match_hf(gpt_oss):
    assert_logits_match(*gpt_oss, prompt_len=10, steps=14)


def test_variant_logits_and_cached_decode_match_hf(variant):
    assert_logits_match(*variant, prompt_len=10, steps=14)


def test_engine_greedy_matches_hf(gpt_oss):
    assert_engine_matches_hf(*gpt_oss, backends=("torch", "cpu"))


@pytest.mark.slow
def test_engine_greedy_matches_hf_on_triton(gpt_oss):
    """The Triton kernels (in the interpreter here) with sinks: flash prefill, paged decode."""
    assert_engine_matches_hf(*gpt_oss, backends=("triton",))


def test_sinks_matter(gpt_oss):
    """Negative control: attention without the sink logits misses HF."""
    path, hf = gpt_oss
    model, cfg = load(path)
    for layer in model.model.layers:
        layer.self_attn.sinks = None
    assert logits_delta(model, cfg, hf) > TOL


def test_the_clamp_matters(gpt_oss):
    """Negative control: the SwiGLU without its clamp misses HF."""
    path, hf = gpt_oss
    model, cfg = load(path)
    for layer in model.model.layers:
        layer.mlp.experts.limit = float("inf")
    assert logits_delta(model, cfg, hf) > TOL


def test_gate_and_up_are_interleaved(gpt_oss):
    """Negative control: reading gate_up_proj as [gate | up] halves instead of alternate columns
    misses HF. (The loaded tensors are re-laid so that the model's interleaved reading sees the
    halves: column 2i ← column i, column 2i + 1 ← column I + i.)"""
    path, hf = gpt_oss
    model, cfg = load(path)
    with torch.no_grad():
        for layer in model.model.layers:
            for t in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.gate_up_proj_bias):
                gate, up = t.chunk(2, dim=-1)  # ..., I each
                t.copy_(torch.stack([gate, up], dim=-1).flatten(-2))  # ..., 2I
    assert logits_delta(model, cfg, hf) > TOL


def test_config_reads_every_mechanism(gpt_oss, variant):
    _, cfg = load(gpt_oss[0])
    assert cfg.arch == "gpt_oss" and cfg.layer_types == ["sliding_attention", "full_attention",
                                                         "sliding_attention"]
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert (cfg.family_options.swiglu_alpha, cfg.family_options.swiglu_limit) == (1.3, 1.5)
    assert cfg.qkv_bias and cfg.o_bias and cfg.num_experts == 4
    _, other = load(variant[0])
    assert not other.qkv_bias and other.tie_word_embeddings and other.head_dim == 24


def test_every_transformers_field_is_classified():
    assert_every_field_classified(family_of("gpt_oss"))


def _hf_dict(**changes) -> dict:
    cfg = transformers.GptOssConfig(**GPT_OSS).to_dict()
    cfg["architectures"] = ["GptOssForCausalLM"]
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("changes, match", [
    (dict(quantization_config={"quant_method": "mxfp4"}),
     "quantization_config.quant_method='mxfp4'"),
    (dict(sliding_window=None), "sliding_window=None"),
    (dict(layer_types=["full_attention", "local"]), "layer_types="),
    (dict(swiglu_limit=0.0), "swiglu_limit=0.0"),
    (dict(swiglu_alpha=-1.0), "swiglu_alpha=-1.0"),
    (dict(rope_parameters=dict(YARN, partial_rotary_factor=0.5)),
     "partial_rotary_factor=0.5"),
])
def test_what_cannot_be_computed_is_refused_by_name(changes, match):
    with pytest.raises(ConfigError, match=match):
        config_from_hf(_hf_dict(**changes))


def test_released_config_keys_read(tmp_path):
    """The released config.json's transformers-4 spelling (rope_scaling + rope_theta, no
    rope_parameters) reads to the same RoPE as transformers 5's."""
    v5 = config_from_hf(_hf_dict())
    v4 = _hf_dict(rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"},
                  rope_theta=10000.0, experts_per_token=2, initial_context_length=16)
    del v4["rope_parameters"]
    old = config_from_hf(v4)
    assert old.rope_scaling == v5.rope_scaling and old.rope_theta == v5.rope_theta


def test_num_experts_is_read_as_transformers_reads_it():
    """transformers' alias num_experts sets num_local_experts (GptOssConfig.attribute_map)."""
    cfg = _hf_dict(num_experts=3)
    del cfg["num_local_experts"]
    assert transformers.GptOssConfig(num_experts=3).num_local_experts == 3
    assert config_from_hf(cfg).num_experts == 3


def test_extensions_refuse_by_name(gpt_oss, tmp_path):
    from nanoserve.errors import NanoserveError
    from nanoserve.models.loader import save_checkpoint
    from nanoserve.parallel.tensor_parallel import tp_unsupported
    from nanoserve.quant.model import decoder_blocks

    model, cfg = load(gpt_oss[0])
    with pytest.raises(ConfigError, match="saving a gpt_oss checkpoint is not supported"):
        save_checkpoint(model, tmp_path)
    with pytest.raises(NanoserveError, match="'gpt_oss'"):
        decoder_blocks(model)
    assert "gpt_oss" in tp_unsupported(cfg, 2)
