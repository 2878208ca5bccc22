"""GGUF files of the families added as modules (Granite, Gemma 1, StarCoder2, Phi-2, StableLM,
Command-R, GPT-NeoX, Qwen2-MoE, GLM-4, ERNIE 4.5, EXAONE 4) and of OLMo 2 and 3, each held to
transformers: a tiny random HF model
(testdata.tiny_hf_checkpoint: randomised norms and biases) is written as llama.cpp's converter
writes that architecture (tests/gguf_writer.py), loaded by `load_model("….gguf")`, and its prompt
logits and cached decode steps compared with the transformers model's (≤ 1e-4 in F32; in Q8_0, the
transformers model holding the numbers the file holds, rounded by the gguf package's own quantizer).

How the writer knows what the converter writes: the tensor names come from the gguf package's own
name map for the architecture (`gguf.get_tensor_name_map(MODEL_ARCH.GRANITE, ...)`: the map the
converter uses), the key names from its `GGUFWriter.add_*` methods (gguf.constants.Keys); which
keys each architecture gets, from which HF fields, and which tensors are changed (Granite's q/k rows
and biases reordered as Llama's, Gemma's norms stored as 1 + w, StableLM's per-head norms stacked,
Gemma's tied head left out) follow the converter's class for that architecture (GraniteModel,
GemmaModel, StarCoder2Model, Phi2Model, StableLMModel, CommandR2Model, Olmo2Model, GPTNeoXModel
(which reorders query_key_value's head-by-head rows to all q, k, v), Qwen2MoeModel (which stacks
the experts), Glm4Model, Ernie4_5Model, Exaone4Model), whose source was read for this, and what
llama.cpp computes from a key that is missing or 0 follows its model loaders (Granite's attention
scale 1/√head_dim, StableLM's parallel residual where a block has no ffn_norm, EXAONE 4's RoPE on
the sliding layers only, OLMo 3's sliding layers' base).

Negative controls: a dropped multiplier or norm offset, a bias or q/k norm read as absent, Granite's
q/k biases left in llama.cpp's row order, OLMo 2's and GLM-4's norms exchanged, the partial rotary
width ignored, GPT-NeoX's parallel residual read as sequential, Qwen2-MoE's top-k weights
renormalised, ERNIE's q/k read as Llama-reordered, EXAONE 4's and OLMo 3's sliding and global
layers exchanged and OLMo 3's sliding RoPE base not read each move the logits past TOL; keys
llama.cpp cannot load without are refused by name.
"""

from __future__ import annotations

import pytest
import torch
from family_oracle import TOL, assert_logits_match, load, logits_delta
from gguf_writer import close_gguf, write_gguf
from testdata import tiny_hf_checkpoint

from nanoserve.errors import CheckpointError
from nanoserve.models import gguf_file

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

SIZES = dict(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
# every multiplier far from 1 and from llama.cpp's value for a missing key; q/k/v/o biases (whose
# q and k rows the converter reorders with the weights)
GRANITE = dict(SIZES, embedding_multiplier=3.0, residual_multiplier=0.4,
               attention_multiplier=0.2, logits_scaling=2.5, attention_bias=True,
               tie_word_embeddings=True)
# a head wider than hidden / heads (llama.cpp reads it from attention.key_length)
GEMMA = dict(SIZES, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True)
# no window: the converter writes none and llama.cpp applies none to StarCoder2
STARCODER2 = dict(SIZES, use_bias=True, sliding_window=None, norm_epsilon=1e-4)
# Phi-2's converter writes an MLP width of 4 × hidden and as many KV heads as heads, as every Phi
# release has; a quarter of each head rotated (Phi's default is half)
PHI = dict(SIZES, intermediate_size=256, num_key_value_heads=4, partial_rotary_factor=0.25,
           layer_norm_eps=1e-4)
STABLELM = {"sequential": dict(SIZES, use_qkv_bias=True, partial_rotary_factor=0.5),
            "parallel": dict(SIZES, use_parallel_residual=True, qk_layernorm=True,
                             partial_rotary_factor=0.25)}
COMMAND_R = {"plain": dict(SIZES, logit_scale=0.25),
             "qk_norm_bias": dict(SIZES, logit_scale=0.25, use_qk_norm=True, attention_bias=True)}


def _hf_and_gguf(tmp_path, config, arch: str, qtype: str = "F32"):
    """(the GGUF file, the transformers model it was written from)."""
    transformers.logging.set_verbosity_error()
    hf = tiny_hf_checkpoint(config, tmp_path / "hf", seed=3)
    with torch.no_grad():  # Cohere's [heads, head_dim] q/k norms: 2-D, so not randomised there
        for name, p in hf.named_parameters():
            if "norm" in name and p.ndim == 2:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return write_gguf(hf, tmp_path / f"{arch}-{qtype}.gguf", qtype, arch), hf


def _without_key(path, key: str, add_keys=None):
    """The GGUF file at `path` rewritten beside it without the metadata key `key` (and with the
    keys `add_keys(writer)` adds)."""
    reader = gguf.GGUFReader(path)
    out = path.with_name(f"without-{key}.gguf")
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", key):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    if add_keys is not None:
        add_keys(writer)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())),
                          raw_dtype=t.tensor_type)
    close_gguf(writer)
    return out


def _delta(path, hf) -> float:
    model, cfg = load(path)
    return logits_delta(model, cfg, hf)


# ----------------------------------------------------------------------------- Granite
def test_granite_matches_transformers(tmp_path):
    path, hf = _hf_and_gguf(tmp_path, transformers.GraniteConfig(**GRANITE), "granite")
    assert_logits_match(path, hf)
    _, cfg = load(path)
    assert (cfg.hf_model_type, cfg.arch) == ("granite", "llama")
    assert cfg.attn_scale == pytest.approx(0.2)  # (stored as float32)


def test_granite_q8_0_matches_transformers_on_the_files_numbers(tmp_path):
    """Q8_0 linears stay packed (GGMLLinear) with q/k rows reordered in their blocks; the reference
    is the transformers model whose linears hold gguf's own Q8_0 round trip of its weights."""
    from nanoserve.models.gguf_file import GGMLLinear

    path, hf = _hf_and_gguf(tmp_path, transformers.GraniteConfig(**GRANITE), "granite", "Q8_0")
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                w = module.weight.numpy()
                module.weight.copy_(torch.from_numpy(
                    gguf.quants.dequantize(gguf.quants.quantize(w, q8), q8)))
    assert_logits_match(path, hf)
    model, _ = load(path)
    packed = [m for m in model.modules() if isinstance(m, GGMLLinear)]
    assert len(packed) == 7 * GRANITE["num_hidden_layers"]  # the tied head is the embedding
    assert {m.type_name for m in packed} == {"Q8_0"}


def test_granite_negative_control_biases_left_reordered(tmp_path, monkeypatch):
    """The converter reorders q's and k's biases with their rows; read back as stored (only the
    weights' rows restored) they no longer match."""
    path, hf = _hf_and_gguf(tmp_path, transformers.GraniteConfig(**GRANITE), "granite")
    heads_for = gguf_file._heads_for

    def weights_only(name, hf_config):
        return heads_for(name, hf_config) if name.endswith(".weight") else None

    monkeypatch.setattr(gguf_file, "_heads_for", weights_only)
    assert _delta(path, hf) > TOL


@pytest.mark.parametrize("key", ["embedding_scale", "residual_scale", "attention.scale"])
def test_granite_negative_control_multiplier_dropped(tmp_path, key):
    """Without the key llama.cpp multiplies by nothing (attention: 1/√head_dim), and so do we:
    the logits then leave the transformers model's."""
    path, hf = _hf_and_gguf(tmp_path, transformers.GraniteConfig(**GRANITE), "granite")
    assert _delta(_without_key(path, f"granite.{key}"), hf) > TOL


def test_granite_without_attention_scale_is_one_over_root_head_dim(tmp_path):
    """llama.cpp's reading of a file without granite.attention.scale: 1/√head_dim, which is
    transformers' Granite with attention_multiplier = head_dim ** -0.5."""
    head_dim = GRANITE["hidden_size"] // GRANITE["num_attention_heads"]
    config = transformers.GraniteConfig(**{**GRANITE, "attention_multiplier": head_dim ** -0.5})
    path, hf = _hf_and_gguf(tmp_path, config, "granite")
    assert_logits_match(_without_key(path, "granite.attention.scale"), hf)


def test_granite_without_logit_scale_is_refused_by_name(tmp_path):
    path, _ = _hf_and_gguf(tmp_path, transformers.GraniteConfig(**GRANITE), "granite")
    with pytest.raises(CheckpointError, match="granite.logit_scale"):
        load(_without_key(path, "granite.logit_scale"))


# ----------------------------------------------------------------------------- Gemma 1
def test_gemma_matches_transformers(tmp_path):
    path, hf = _hf_and_gguf(tmp_path, transformers.GemmaConfig(**GEMMA), "gemma")
    assert_logits_match(path, hf)
    assert load(path)[1].head_dim == 32


def test_gemma_negative_control_norms_read_as_stored(tmp_path, monkeypatch):
    path, hf = _hf_and_gguf(tmp_path, transformers.GemmaConfig(**GEMMA), "gemma")
    monkeypatch.setitem(gguf_file.NORM_OFFSET, "gemma", 0.0)
    assert _delta(path, hf) > TOL


# ----------------------------------------------------------------------------- StarCoder2
@pytest.mark.parametrize("use_bias", [True, False])
def test_starcoder2_matches_transformers(tmp_path, use_bias):
    """use_bias is read from the file's tensors (blk.0.attn_q.bias), as llama.cpp does."""
    config = transformers.Starcoder2Config(**{**STARCODER2, "use_bias": use_bias})
    path, hf = _hf_and_gguf(tmp_path, config, "starcoder2")
    assert_logits_match(path, hf)


def test_starcoder2_without_layer_norm_epsilon_is_refused_by_name(tmp_path):
    path, _ = _hf_and_gguf(tmp_path, transformers.Starcoder2Config(**STARCODER2), "starcoder2")
    with pytest.raises(CheckpointError, match="starcoder2.attention.layer_norm_epsilon"):
        load(_without_key(path, "starcoder2.attention.layer_norm_epsilon"))


# ----------------------------------------------------------------------------- Phi-2
def test_phi2_matches_transformers(tmp_path):
    path, hf = _hf_and_gguf(tmp_path, transformers.PhiConfig(**PHI), "phi2")
    assert_logits_match(path, hf)
    assert load(path)[1].partial_rotary_factor == 0.25


def test_phi2_negative_control_rotary_width_ignored(tmp_path, monkeypatch):
    """phi2.rope.dimension_count (4 of 16) not read: Phi's default, half of each head, turns."""
    path, hf = _hf_and_gguf(tmp_path, transformers.PhiConfig(**PHI), "phi2")
    read = gguf_file.hf_config_from_gguf

    def without_factor(meta, names):
        hf_config = read(meta, names)
        hf_config.pop("partial_rotary_factor")
        return hf_config

    monkeypatch.setattr(gguf_file, "hf_config_from_gguf", without_factor)
    assert _delta(path, hf) > TOL


def test_phi2_q_norm_is_refused_by_name():
    """llama.cpp's Phi-2 has no q/k norms (gguf's tensor list for PHI2 lists none)."""
    with pytest.raises(CheckpointError, match="blk.0.attn_q_norm.weight"):
        gguf_file.our_name("blk.0.attn_q_norm.weight", "phi2")


# ----------------------------------------------------------------------------- StableLM
@pytest.mark.parametrize("variant", sorted(STABLELM))
def test_stablelm_matches_transformers(tmp_path, variant):
    """Sequential with q/k/v biases; parallel (no ffn_norm: llama.cpp's test) with per-head q/k
    LayerNorms, stacked to [heads, head_dim] by the converter."""
    config = transformers.StableLmConfig(**STABLELM[variant])
    path, hf = _hf_and_gguf(tmp_path, config, "stablelm")
    assert_logits_match(path, hf)


def test_stablelm_parallel_residual_is_read_from_the_tensors(tmp_path, monkeypatch):
    """Negative control: the parallel file read as sequential lacks the MLP's own norm."""
    config = transformers.StableLmConfig(**STABLELM["parallel"])
    path, _ = _hf_and_gguf(tmp_path, config, "stablelm")
    monkeypatch.setattr(gguf_file, "fields_from_tensors", lambda arch, names: {})
    with pytest.raises(CheckpointError, match="post_attention_layernorm"):
        load(path)


# ----------------------------------------------------------------------------- Command-R
@pytest.mark.parametrize("variant", sorted(COMMAND_R))
def test_command_r_matches_transformers(tmp_path, variant):
    config = transformers.CohereConfig(**COMMAND_R[variant])
    path, hf = _hf_and_gguf(tmp_path, config, "command-r")
    assert_logits_match(path, hf)
    assert load(path)[1].family_options.logit_scale == 0.25


def test_command_r_without_logit_scale_is_refused_by_name(tmp_path):
    """(HF's default, 1/16, is not what llama.cpp would compute: it is not assumed.)"""
    path, _ = _hf_and_gguf(tmp_path, transformers.CohereConfig(**COMMAND_R["plain"]), "command-r")
    with pytest.raises(CheckpointError, match="command-r.logit_scale"):
        load(_without_key(path, "command-r.logit_scale"))


# ----------------------------------------------------------------------------- OLMo 2
OLMO2 = dict(SIZES, rms_norm_eps=1e-5)


def test_olmo2_matches_transformers(tmp_path):
    """Post-norm blocks (post_attention_norm, post_ffw_norm) and RMSNorms over the whole q and k
    projections (attn_q_norm [heads · head_dim]), q and k in HF's order (llama.cpp's NeoX RoPE)."""
    path, hf = _hf_and_gguf(tmp_path, transformers.Olmo2Config(**OLMO2), "olmo2")
    assert_logits_match(path, hf)


def test_olmo2_negative_control_norms_exchanged(tmp_path, monkeypatch):
    path, hf = _hf_and_gguf(tmp_path, transformers.Olmo2Config(**OLMO2), "olmo2")
    monkeypatch.setitem(gguf_file.ARCH_BLOCK_NAMES, "olmo2",
                        {"post_attention_norm": "post_feedforward_layernorm",
                         "post_ffw_norm": "post_attention_layernorm"})
    assert _delta(path, hf) > TOL


# ----------------------------------------------------------------------------- tensor-stated fields
TENSOR_STATED = [
    ("starcoder2", transformers.Starcoder2Config, STARCODER2, "use_bias"),
    ("stablelm", transformers.StableLmConfig, STABLELM["sequential"], "use_qkv_bias"),
    ("stablelm", transformers.StableLmConfig, STABLELM["parallel"], "qk_layernorm"),
    ("command-r", transformers.CohereConfig, COMMAND_R["qk_norm_bias"], "use_qk_norm"),
    ("command-r", transformers.CohereConfig, COMMAND_R["qk_norm_bias"], "attention_bias"),
    ("granite", transformers.GraniteConfig, GRANITE, "attention_bias"),
]


@pytest.mark.parametrize("arch, config_class, fields, field", TENSOR_STATED)
def test_negative_control_tensor_stated_field_read_as_absent(tmp_path, monkeypatch, arch,
                                                             config_class, fields, field):
    """A bias or q/k norm the file holds, read as absent (its tensors then unused), moves the
    logits."""
    path, hf = _hf_and_gguf(tmp_path, config_class(**fields), arch)
    read = gguf_file.fields_from_tensors

    def without(a, names):
        return {**read(a, names), field: False}

    monkeypatch.setattr(gguf_file, "fields_from_tensors", without)
    assert _delta(path, hf) > TOL


# ----------------------------------------------------------------------------- GPT-NeoX (Pythia)
NEOX_SIZES = {k: v for k, v in SIZES.items() if k != "num_key_value_heads"}  # no GQA in GPT-NeoX
GPTNEOX = {"parallel": dict(NEOX_SIZES, rotary_pct=0.25, layer_norm_eps=1e-4),
           "sequential_no_bias": dict(NEOX_SIZES, use_parallel_residual=False,
                                      attention_bias=False, rotary_pct=0.5)}


@pytest.mark.parametrize("variant", sorted(GPTNEOX))
def test_gptneox_matches_transformers(tmp_path, variant):
    """attn_qkv (reordered by the converter to all q, k, v rows) split at load; the rotated width
    from rope.dimension_count, the residual from use_parallel_residual, the q/k/v/o biases from the
    tensors the file holds; no RoPE base in the file (llama.cpp's 10,000, HF's default)."""
    config = transformers.GPTNeoXConfig(**GPTNEOX[variant])
    path, hf = _hf_and_gguf(tmp_path, config, "gptneox")
    assert_logits_match(path, hf)
    _, cfg = load(path)
    assert cfg.partial_rotary_factor == GPTNEOX[variant]["rotary_pct"]


def test_gptneox_negative_control_residual_flag_not_read(tmp_path, monkeypatch):
    """The parallel file read as sequential moves the logits."""
    path, hf = _hf_and_gguf(tmp_path, transformers.GPTNeoXConfig(**GPTNEOX["parallel"]),
                            "gptneox")
    read = gguf_file.hf_config_from_gguf

    def sequential(meta, names):
        return {**read(meta, names), "use_parallel_residual": False}

    monkeypatch.setattr(gguf_file, "hf_config_from_gguf", sequential)
    assert _delta(path, hf) > TOL


def test_gptneox_without_parallel_residual_is_refused_by_name(tmp_path):
    path, _ = _hf_and_gguf(tmp_path, transformers.GPTNeoXConfig(**GPTNEOX["parallel"]), "gptneox")
    with pytest.raises(CheckpointError, match="gptneox.use_parallel_residual"):
        load(_without_key(path, "gptneox.use_parallel_residual"))


def test_gptneox_negative_control_biases_read_as_absent(tmp_path, monkeypatch):
    test_negative_control_tensor_stated_field_read_as_absent(
        tmp_path, monkeypatch, "gptneox", transformers.GPTNeoXConfig, GPTNEOX["parallel"],
        "attention_bias")


# ----------------------------------------------------------------------------- Qwen2-MoE
# every layer sparse (llama.cpp's qwen2moe has no dense layers), top-k weights not renormalised
# (llama.cpp does not renormalise them for qwen2moe; HF's default)
QWEN2MOE = dict(SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=64, norm_topk_prob=False)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_qwen2moe_matches_transformers(tmp_path, qtype):
    """The stacked experts (ffn_*_exps [experts, rows, cols]) split one linear per expert — packed
    rows too —, the router, the shared expert and its sigmoid gate; q/k/v biases from the tensors.
    Q8_0: the transformers model holds gguf's own Q8_0 round trip of every matrix written so."""
    path, hf = _hf_and_gguf(tmp_path, transformers.Qwen2MoeConfig(**QWEN2MOE), "qwen2moe", qtype)
    if qtype == "Q8_0":
        _round_trip_q8_0(hf)
    assert_logits_match(path, hf)
    model, cfg = load(path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    packed = [n for n, m in model.named_modules() if isinstance(m, gguf_file.GGMLLinear)]
    routed = [n for n in packed if ".experts." in n]
    assert len(routed) == (0 if qtype == "F32" else 2 * 4 * 3)  # layers × experts × linears


def _round_trip_q8_0(hf) -> None:
    """Each matrix the writer quantizes (the linears, the LM head and the stacked experts; not the
    embedding, norms or routers) replaced by gguf's Q8_0 round trip of it."""
    q8 = gguf.GGMLQuantizationType.Q8_0
    kept = ("embed_tokens", "norm", "mlp.gate.weight", "shared_expert_gate")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim in (2, 3) and not any(part in name for part in kept):
                p.copy_(torch.from_numpy(
                    gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)))


def test_qwen2moe_negative_control_top_k_renormalised(tmp_path, monkeypatch):
    path, hf = _hf_and_gguf(tmp_path, transformers.Qwen2MoeConfig(**QWEN2MOE), "qwen2moe")
    read = gguf_file.hf_config_from_gguf

    def renormalised(meta, names):
        return {**read(meta, names), "norm_topk_prob": True}

    monkeypatch.setattr(gguf_file, "hf_config_from_gguf", renormalised)
    assert _delta(path, hf) > TOL


def test_qwen2moe_without_expert_width_is_refused_by_name(tmp_path):
    path, _ = _hf_and_gguf(tmp_path, transformers.Qwen2MoeConfig(**QWEN2MOE), "qwen2moe")
    with pytest.raises(CheckpointError, match="qwen2moe.expert_feed_forward_length"):
        load(_without_key(path, "qwen2moe.expert_feed_forward_length"))


# ----------------------------------------------------------------------------- GLM-4
# a head wider than hidden / heads (attention.key_length), a quarter of it rotated
GLM4 = {"bias": dict(SIZES, head_dim=32, partial_rotary_factor=0.25, pad_token_id=0),
        "no_bias": dict(SIZES, head_dim=16, attention_bias=False, pad_token_id=0)}


@pytest.mark.parametrize("variant", sorted(GLM4))
def test_glm4_matches_transformers(tmp_path, variant):
    """The sandwich's four norms (attn_norm, post_attention_norm, ffn_norm, post_ffw_norm), gate
    and up fused under ffn_up, RoPE on adjacent pairs of rope.dimension_count dims (q and k as HF
    stores them), q/k/v biases from the tensors."""
    path, hf = _hf_and_gguf(tmp_path, transformers.Glm4Config(**GLM4[variant]), "glm4")
    assert_logits_match(path, hf)
    head_dim = GLM4[variant]["head_dim"]
    assert load(path)[1].head_dim == head_dim


def test_glm4_negative_control_norms_exchanged(tmp_path, monkeypatch):
    """The norms after attention and after the MLP read into each other's place."""
    path, hf = _hf_and_gguf(tmp_path, transformers.Glm4Config(**GLM4["bias"]), "glm4")
    monkeypatch.setitem(gguf_file.ARCH_BLOCK_NAMES, "glm4",
                        {"ffn_up": "mlp.gate_up_proj",
                         "post_attention_norm": "post_mlp_layernorm",
                         "post_ffw_norm": "post_self_attn_layernorm"})
    assert _delta(path, hf) > TOL


def test_glm4_negative_control_bias_read_as_absent(tmp_path, monkeypatch):
    test_negative_control_tensor_stated_field_read_as_absent(
        tmp_path, monkeypatch, "glm4", transformers.Glm4Config, GLM4["bias"], "attention_bias")


# ----------------------------------------------------------------------------- ERNIE 4.5
ERNIE4_5 = {"plain": dict(SIZES, head_dim=16),
            "bias": dict(SIZES, head_dim=32, use_bias=True, tie_word_embeddings=False)}


@pytest.mark.parametrize("variant", sorted(ERNIE4_5))
def test_ernie4_5_matches_transformers(tmp_path, variant):
    """Llama's block with RoPE on adjacent pairs (q and k as HF stores them: llama.cpp's ernie4_5
    rotates adjacent pairs too) and use_bias read from the tensors."""
    config = transformers.Ernie4_5Config(**ERNIE4_5[variant])
    path, hf = _hf_and_gguf(tmp_path, config, "ernie4_5")
    assert_logits_match(path, hf)


def test_ernie4_5_negative_control_biases_read_as_absent(tmp_path, monkeypatch):
    test_negative_control_tensor_stated_field_read_as_absent(
        tmp_path, monkeypatch, "ernie4_5", transformers.Ernie4_5Config, ERNIE4_5["bias"],
        "use_bias")


def test_ernie4_5_negative_control_q_k_reordered_as_llama(tmp_path, monkeypatch):
    """Read as if the converter had reordered q and k as Llama's, the rotation pairs the wrong
    dims."""
    path, hf = _hf_and_gguf(tmp_path, transformers.Ernie4_5Config(**ERNIE4_5["plain"]),
                            "ernie4_5")
    monkeypatch.setitem(gguf_file.ARCHITECTURES, "ernie4_5", ("ernie4_5", True))
    assert _delta(path, hf) > TOL


# ----------------------------------------------------------------------------- EXAONE 4
# windowed: layer 0 slides (6 keys, with RoPE), layer 1 is global without RoPE (NoPE); windowless:
# both global, both rotating
EXAONE4 = {"windowed": dict(SIZES, head_dim=16, sliding_window=6,
                            layer_types=["sliding_attention", "full_attention"]),
           "windowless": dict(SIZES, head_dim=32, sliding_window=None,
                              layer_types=["full_attention"] * 2)}


@pytest.mark.parametrize("variant", sorted(EXAONE4))
def test_exaone4_matches_transformers(tmp_path, variant):
    """Post-norm blocks, per-head q/k norms, the layer kinds from sliding_window_pattern (prompts
    of 36 tokens, far past the window of 6)."""
    path, hf = _hf_and_gguf(tmp_path, transformers.Exaone4Config(**EXAONE4[variant]), "exaone4")
    assert_logits_match(path, hf)
    _, cfg = load(path)
    expected = {"windowed": [1], "windowless": None}[variant]
    assert cfg.no_rope_layers == expected


def test_exaone4_negative_control_pattern_reversed(tmp_path, monkeypatch):
    """The sliding and the global layer exchanged: other layers slide, other layers rotate."""
    path, hf = _hf_and_gguf(tmp_path, transformers.Exaone4Config(**EXAONE4["windowed"]),
                            "exaone4")
    kind = gguf_file._layer_kind
    monkeypatch.setattr(gguf_file, "_layer_kind", lambda slides: kind(not slides))
    assert _delta(path, hf) > TOL


def test_exaone4_window_without_pattern_is_refused_by_name(tmp_path):
    path, _ = _hf_and_gguf(tmp_path, transformers.Exaone4Config(**EXAONE4["windowed"]), "exaone4")
    with pytest.raises(CheckpointError, match="exaone4.attention.sliding_window_pattern"):
        load(_without_key(path, "exaone4.attention.sliding_window_pattern"))


# ----------------------------------------------------------------------------- OLMo 3
def _olmo3(sliding_theta: float) -> dict:
    """OLMo 3: layer 0 slides (a window of 6), layer 1 is global; the full-attention layers' RoPE
    base 10,000, the sliding layers' `sliding_theta`."""
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": sliding_theta}}
    return dict(OLMO2, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                rope_parameters=rope)


def _olmo3_file(tmp_path, sliding_theta: float):
    """(the file, the HF model): written by the converter (one base, no rope.freq_base_swa), then,
    for a sliding base of its own, given that key as llama.cpp reads it."""
    config = transformers.Olmo3Config(**_olmo3(sliding_theta))
    path, hf = _hf_and_gguf(tmp_path, config, "olmo2")
    if sliding_theta == 10000.0:
        return path, hf
    return _without_key(path, "general.name", lambda w: w.add_rope_freq_base_swa(sliding_theta)), hf


@pytest.mark.parametrize("sliding_theta", [10000.0, 500.0])
def test_olmo3_matches_transformers(tmp_path, sliding_theta):
    """An olmo2 file with a window is OLMo 3: layer types from sliding_window_pattern (prompts of
    36 tokens, far past the window), the sliding layers' RoPE base from rope.freq_base_swa or else
    the file's one base."""
    path, hf = _olmo3_file(tmp_path, sliding_theta)
    assert_logits_match(path, hf)
    _, cfg = load(path)
    assert (cfg.hf_model_type, cfg.sliding_window) == ("olmo3", 6)
    assert cfg.layer_types == ["sliding_attention", "full_attention"]


def test_olmo3_negative_control_sliding_base_not_read(tmp_path):
    """Without rope.freq_base_swa llama.cpp gives the sliding layers the file's base: a model
    trained with its own sliding base then no longer matches."""
    path, hf = _olmo3_file(tmp_path, 500.0)
    assert _delta(_without_key(path, "olmo2.rope.freq_base_swa"), hf) > TOL


def test_olmo3_negative_control_pattern_reversed(tmp_path, monkeypatch):
    path, hf = _olmo3_file(tmp_path, 10000.0)
    kind = gguf_file._layer_kind
    monkeypatch.setattr(gguf_file, "_layer_kind", lambda slides: kind(not slides))
    assert _delta(path, hf) > TOL


def test_olmo3_pattern_as_a_period(tmp_path):
    """llama.cpp also reads the pattern as a period (the last layer of each period global); 2
    gives this model's layer types."""
    path, hf = _olmo3_file(tmp_path, 10000.0)
    rewritten = _without_key(path, "olmo2.attention.sliding_window_pattern",
                             lambda w: w.add_sliding_window_pattern(2))
    assert_logits_match(rewritten, hf)


# ----------------------------------------------------------------------------- refused by name
@pytest.mark.parametrize("arch", ["deepseek2", "gpt-oss"])
def test_unread_architecture_is_refused_by_name(arch):
    """DeepSeek-V2/V3 (MLA: attn_kv_a_mqa with kv_b either whole, attn_kv_b, or split and
    transposed, attn_k_b / attn_v_b, by the converter's version; grouped routing; YaRN) and
    gpt-oss (MXFP4 experts) are not read."""
    with pytest.raises(CheckpointError, match=f"GGUF architecture '{arch}' is not read here"):
        gguf_file.hf_config_from_gguf({"general.architecture": arch}, set())
