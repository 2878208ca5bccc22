"""GGUF files of the families added as modules (Granite, Gemma 1, StarCoder2, Phi-2, StableLM,
Command-R) and of OLMo 2, each held to transformers: a tiny random HF model
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
GemmaModel, StarCoder2Model, Phi2Model, StableLMModel, CommandR2Model, Olmo2Model), whose source
was read for this, and what llama.cpp computes from a key that is missing or 0 follows its model
loaders (Granite's attention scale 1/√head_dim, StableLM's parallel residual where a block has no
ffn_norm).

Negative controls: a dropped multiplier or norm offset, a bias or q/k norm read as absent, Granite's
q/k biases left in llama.cpp's row order, OLMo 2's two norms exchanged and the partial rotary width
ignored each move the logits past TOL; keys llama.cpp cannot load without are refused by name.
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


def test_olmo3_file_is_refused_by_name(tmp_path):
    """OLMo 3 is converted as olmo2 with a window and a per-layer pattern of sliding layers, which
    is not read here."""
    def olmo3_keys(writer):
        writer.add_sliding_window(8)
        writer.add_sliding_window_pattern([True, False])

    path, _ = _hf_and_gguf(tmp_path, transformers.Olmo2Config(**OLMO2), "olmo2")
    olmo3 = _without_key(path, "general.name", olmo3_keys)
    with pytest.raises(CheckpointError, match="olmo2.attention.sliding_window_pattern"):
        load(olmo3)


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
