"""DeepSeek-V2 / V3 against transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM
(tests/family_oracle.py): multi-head latent attention (nanoserve/models/mla.py) with q_lora_rank
set and None, RoPE on neighbouring pairs and on halves, YaRN with DeepSeek's mscale, DeepSeek's
MoE layers; the absorbed form against the expanded one; a KV cache of the latent alone (its bytes
and its layout); and negative controls for each mechanism."""

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

from nanoserve.errors import ConfigError, NanoserveError
from nanoserve.models.family import family_of
from nanoserve.models.hf_config import config_from_hf
from nanoserve.models.layers import apply_rope, rope_cos_sin

# H = 4 heads; r = 16, d_rope = 8, d_nope = 12, d_v = 10: every width distinct, so a transposed or
# mis-split projection cannot pass by luck
MLA = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, vocab_size=257, max_position_embeddings=256, kv_lora_rank=16,
           qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, first_k_dense_replace=2,
           tie_word_embeddings=False, initializer_range=0.1)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            mscale=0.9, mscale_all_dim=1.3, beta_fast=32, beta_slow=1)
# expert layers from layer 1 on: 8 routed experts in 4 groups, 2 groups kept, top 2, 2 shared
MOE = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_group=4,
           topk_group=2, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=2,
           routed_scaling_factor=2.5)
CASES = {
    # q_proj (no q bottleneck), biases everywhere V2 has them, another activation and epsilon
    "v2": (transformers.DeepseekV2Config,
           dict(MLA, q_lora_rank=None, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5,
                hidden_act="gelu_pytorch_tanh")),
    # the q bottleneck, RoPE on neighbouring pairs, YaRN with mscale and mscale_all_dim
    "v3_yarn": (transformers.DeepseekV3Config,
                dict(MLA, q_lora_rank=24, attention_bias=True, rope_parameters=YARN)),
    # RoPE on halves, tied embeddings
    "v3_halves": (transformers.DeepseekV3Config,
                  dict(MLA, q_lora_rank=20, rope_interleave=False, tie_word_embeddings=True)),
    "v2_moe": (transformers.DeepseekV2Config,
               dict(MLA, **MOE, q_lora_rank=24, topk_method="group_limited_greedy",
                    mlp_bias=True)),
    "v3_moe": (transformers.DeepseekV3Config,
               dict(MLA, **MOE, q_lora_rank=24, norm_topk_prob=False)),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> (path, HF model) of CASES[name], each saved once per module."""
    transformers.logging.set_verbosity_error()
    saved = {}

    def get(name: str):
        if name not in saved:
            saved[name] = _save(tmp_path_factory.mktemp(name), name)
        return saved[name]

    return get


def _save(path, name: str):
    config_class, fields = CASES[name]
    hf = tiny_hf_checkpoint(config_class(**fields), path, seed=7)
    if name == "v3_moe":  # HF starts the correction bias at 0, where dropping it changes nothing
        with torch.no_grad():
            for layer in hf.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)
        hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module", params=list(CASES))
def deepseek(request, checkpoint):
    return checkpoint(request.param)


@pytest.fixture(scope="module")
def v3_yarn(checkpoint):
    return checkpoint("v3_yarn")


@pytest.fixture(scope="module")
def v3_moe(checkpoint):
    return checkpoint("v3_moe")


def test_logits_and_cached_decode_match_hf(deepseek):
    """Without a cache the expanded form, with one the absorbed form over the latent cache."""
    assert_logits_match(*deepseek)


@pytest.mark.parametrize("name, backend", [("v2", "cpu"), ("v3_yarn", "torch"),
                                           ("v3_moe", "torch")])
def test_engine_greedy_matches_hf(checkpoint, name, backend):
    """Paged blocks of 4, chunked prefill, a prefix-cache hit: all through the latent cache. (The
    cpu backend serves it through its torch path: the C kernel reads no latent.)"""
    assert_engine_matches_hf(*checkpoint(name), backends=(backend,), max_tokens=24)


def test_absorbed_equals_expanded_in_float64(v3_yarn):
    """W_UK folded into the query and W_UV onto the output: the same attention output as expanding
    every latent into H keys and values (float64: only rounding separates them)."""
    model, cfg = load(v3_yarn[0])
    model = model.double()
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 11, cfg.hidden_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(3))
    positions = torch.arange(11).expand(2, 11)
    freqs = positions[..., None].double() * model.model.inv_freq["global"].double()
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]  # B, T, 1, d_rope
    q_nope, q_pe, c_kv, k_pe = attn.project(x, emb.cos(), emb.sin())
    expanded = attn.expanded(q_nope, q_pe, c_kv, k_pe)
    absorbed = attn.absorbed(q_nope, q_pe, c_kv, k_pe, positions, None)
    assert expanded.shape == absorbed.shape == (2, 11, cfg.n_heads, 10)
    assert (expanded - absorbed).abs().max().item() < 1e-12


def test_absorbed_model_without_a_cache_matches_hf(v3_yarn):
    path, hf = v3_yarn
    model, cfg = load(path)
    for layer in model.model.layers:
        layer.self_attn.absorb_without_cache = True
    assert logits_delta(model, cfg, hf) <= TOL


def test_the_cache_holds_the_latent_and_its_bytes(v3_yarn):
    """One "head" of r + d_rope values per token and layer, V read from it: kv_bytes_per_token is
    n_layers · (r + d_rope) · 4 in float32, against n_layers · H · (d_nope + d_rope + d_v) · 4 for
    the expanded keys and values, and 2 · n_layers · H · D · 4 for an MHA of head_dim D =
    d_nope + d_rope (what nanoserve's Llama pool would hold for these heads)."""
    from nanoserve.kv import PagedKVCache, kv_bytes_per_token

    _, cfg = load(v3_yarn[0])
    L, H, r, d_rope, d_nope, d_v = 2, 4, 16, 8, 12, 10
    mla_bytes = L * (r + d_rope) * 4  # 192
    expanded_bytes = L * H * (d_nope + d_rope + d_v) * 4  # 960
    mha_bytes = 2 * L * H * (d_nope + d_rope) * 4  # 1280
    assert kv_bytes_per_token(cfg, torch.float32) == mla_bytes == 192
    assert (expanded_bytes, mha_bytes) == (960, 1280)  # 5x and 6.7x the latent's
    cache = PagedKVCache(cfg, num_blocks=5, block_size=4)
    assert cache.k.shape == (L, 5, 4, 1, r + d_rope) and cache.v is None
    assert cache.nbytes == 5 * 4 * mla_bytes
    k, v = cache.layer(1)
    assert v.shape == (5, 4, 1, r) and v.data_ptr() == k.data_ptr()  # a view: stored once


def test_the_cache_layout_is_c_kv_then_rotated_k_pe(v3_yarn):
    """Slot t of the pool holds [kv_a_layernorm(c_kv) ; k_pe rotated], as mla.py's docstring tells
    a kernel: recomputed here from the layer's own projections."""
    from nanoserve.kv import KVCache

    model, cfg = load(v3_yarn[0])
    ids = torch.randint(0, 257, (1, 9), generator=torch.Generator().manual_seed(1))
    cache = KVCache(cfg, 1, 12, block_size=4)
    captured = {}

    def keep_input(module, args):
        captured["x"] = args[0]

    layer = model.model.layers[1]
    layer.self_attn.register_forward_pre_hook(keep_input)
    with torch.no_grad():
        model(ids, cache=cache)
        cos, sin = rope_cos_sin(model.model.inv_freq["global"], torch.arange(9)[None],
                                torch.float32)  # 1, 9, 1, d_rope
        factor = model.model.attention_factor  # YaRN's, on cos and sin
        _, _, c_kv, k_pe = layer.self_attn.project(captured["x"], cos * factor, sin * factor)
    stored = cache.pool.k[1].flatten(0, 1)[:9, 0]  # 9 tokens, r + d_rope (blocks 0..2 in order)
    assert torch.equal(stored[:, :16], c_kv[0]) and torch.equal(stored[:, 16:], k_pe[0, :, 0])


def test_dropping_the_rope_key_moves_the_logits(v3_yarn):
    """Negative control: k_pe zeroed (the decoupled RoPE key gone) moves the logits past TOL."""
    path, hf = v3_yarn
    model, cfg = load(path)
    for layer in model.model.layers:
        attn = layer.self_attn
        project = attn.project

        def without_k_pe(x, cos, sin, project=project):
            q_nope, q_pe, c_kv, k_pe = project(x, cos, sin)
            return q_nope, q_pe, c_kv, torch.zeros_like(k_pe)

        attn.project = without_k_pe
    assert logits_delta(model, cfg, hf) > TOL


def test_rope_not_applied_moves_the_logits(v3_yarn):
    path, hf = v3_yarn
    model, cfg = load(path)
    for layer in model.model.layers:
        layer.self_attn.rope = lambda x, cos, sin: x
    assert logits_delta(model, cfg, hf) > TOL


@pytest.mark.parametrize("name", ["v2", "v3_halves"])
def test_the_wrong_rope_pairing_moves_the_logits(checkpoint, name):
    """Negative control: neighbouring pairs where the checkpoint rotates halves, and back."""
    path, hf = checkpoint(name)
    model, cfg = load(path)
    for layer in model.model.layers:
        layer.self_attn.mla = type(layer.self_attn.mla)(
            **{**vars(layer.self_attn.mla), "rope_interleave": name != "v2"})
    assert logits_delta(model, cfg, hf) > TOL


def test_yarn_mscale_in_the_softmax_scale_matters(v3_yarn):
    """Negative control: 1/√(d_nope + d_rope) without mscale(factor, mscale_all_dim)²."""
    path, hf = v3_yarn
    model, cfg = load(path)
    assert cfg.attn_scale != pytest.approx(20 ** -0.5)
    for layer in model.model.layers:
        layer.self_attn.scale = 20 ** -0.5
    assert logits_delta(model, cfg, hf) > TOL


def test_absorbed_decode_with_rope_on_the_latent_differs(v3_yarn):
    """Negative control: rotating (part of) the latent before it is cached, as RoPE over the whole
    cached key would, breaks the absorbed form's identity; the cached decode misses HF."""
    from nanoserve.kv import KVCache

    path, hf = v3_yarn
    model, cfg = load(path)
    for layer in model.model.layers:
        attn = layer.self_attn
        project = attn.project

        def rope_on_latent(x, cos, sin, project=project):
            q_nope, q_pe, c_kv, k_pe = project(x, cos, sin)
            turned = apply_rope(c_kv[:, :, None, :8], cos, sin)[:, :, 0]  # B, T, d_rope
            return q_nope, q_pe, torch.cat((turned, c_kv[..., 8:]), dim=-1), k_pe

        attn.project = rope_on_latent
    ids = torch.randint(0, 257, (1, 20), generator=torch.Generator().manual_seed(4))
    cache = KVCache(cfg, 1, 24)
    with torch.no_grad():
        ref = hf(ids).logits
        model(ids[:, :12], cache=cache)
        steps = torch.cat([model(ids[:, t:t + 1], cache=cache) for t in range(12, 20)], dim=1)
    assert (steps - ref[:, 12:]).abs().max().item() > TOL


def test_the_correction_bias_matters(v3_moe):
    """Negative control for the MoE wiring: e_score_correction_bias zeroed moves the logits."""
    path, hf = v3_moe
    model, cfg = load(path)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert logits_delta(model, cfg, hf) > TOL


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_every_transformers_field_is_classified(model_type):
    assert_every_field_classified(family_of(model_type))


def _hf_dict(name: str, **changes) -> dict:
    config_class, fields = CASES[name]
    cfg = config_class(**fields).to_dict()
    cfg.update(changes)
    cfg["architectures"] = [config_class.__name__.replace("Config", "ForCausalLM")]
    return cfg


@pytest.mark.parametrize("name, changes, match", [
    ("v3_yarn", dict(num_key_value_heads=2), "num_key_value_heads=2"),
    ("v2", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                     partial_rotary_factor=0.5)),
     "partial_rotary_factor=0.5"),
    ("v2_moe", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    ("v2_moe", dict(num_experts_per_tok=None), "num_experts_per_tok=None"),
])
def test_unsupported_fields_are_refused_by_name(name, changes, match):
    with pytest.raises(ConfigError, match=match):
        config_from_hf(_hf_dict(name, **changes))


def test_quantized_kv_is_refused_by_name(v3_yarn):
    from nanoserve.kv import PagedKVCache, kv_bytes_per_token

    _, cfg = load(v3_yarn[0])
    with pytest.raises(NanoserveError, match="kv_cache_dtype='int8'.*MLA's latent"):
        PagedKVCache(cfg, 4, 4, kv_cache_dtype="int8")
    with pytest.raises(NanoserveError, match="kv_cache_dtype='fp8'"):
        kv_bytes_per_token(cfg, torch.float32, "fp8")
    with pytest.raises(NanoserveError, match="kv_cache_dtype='int8'.*MLA's latent"):
        PagedKVCache(cfg, 4, 4, attention_backend="triton", kv_cache_dtype="int8")


def test_triton_backend_engine_matches_hf(v3_yarn, monkeypatch):
    """The triton backend in Triton's interpreter: decode steps through the MLA decode kernel
    (counted), prefills, chunks and the prefix-cache hit through the torch path; greedy == HF.
    (Negative controls: tests/test_mla_triton_backend.py.)"""
    import nanoserve.kernels.mla_decode as mla_decode_module

    calls = []
    kernel = mla_decode_module.mla_decode

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])  # B
        return kernel(*args, **kwargs)

    monkeypatch.setattr(mla_decode_module, "mla_decode", counted)
    assert_engine_matches_hf(*v3_yarn, backends=("triton",), max_tokens=12)
    assert len(calls) >= 2 * 11  # 2 layers, every token after a prompt's first


def test_saving_a_deepseek_checkpoint_is_refused_by_name(v3_yarn, tmp_path):
    from nanoserve.models.loader import save_checkpoint

    model, cfg = load(v3_yarn[0])
    assert cfg.arch == cfg.hf_model_type == "deepseek_v3"
    with pytest.raises(ConfigError, match="saving a deepseek_v3 checkpoint is not supported"):
        save_checkpoint(model, tmp_path)


def test_extensions_that_walk_llama_modules_refuse_by_name(v3_yarn):
    """Quantization and tensor parallelism know Llama's q/k/v/o names, not MLA's: refused by the
    layout's name. A kv_b_proj that is no plain linear (an unmerged LoRA adapter) would be skipped
    by the absorbed form, which reads its weight: refused."""
    from nanoserve.kv import KVCache
    from nanoserve.parallel.tensor_parallel import tp_unsupported
    from nanoserve.quant.model import decoder_blocks

    model, cfg = load(v3_yarn[0])
    with pytest.raises(NanoserveError, match="not 'deepseek_v3'"):
        decoder_blocks(model)
    assert "'deepseek_v3' layout" in tp_unsupported(cfg, 2)

    class Wrapped(torch.nn.Module):  # what an unmerged adapter puts in a linear's place
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    attn = model.model.layers[0].self_attn
    attn.kv_b_proj = Wrapped(attn.kv_b_proj)
    with pytest.raises(NanoserveError, match="kv_b_proj is a Wrapped"):
        model(torch.tensor([[1, 2, 3]]), cache=KVCache(cfg, 1, 8))
