"""EXAONE 4.0 (LG AI Research, 2025): OLMo 2's post-norm block, Qwen3's per-head q/k norms, and
sliding-window layers whose global layers carry no position encoding at all.

HF's Exaone4ForCausalLM, read against the ModelConfig fields that already compute each piece:
- the block is post-norm, x + norm(attn(x)), then x + norm(mlp(x)), with no input norm
  (`block="post_norm"`, as OLMo 2), its RMSNorm rounding before the scale as Llama's does;
- q and k are RMS-normalised per head before RoPE, one head_dim weight each (`qk_norm="per_head"`,
  as Qwen3);
- `layer_types` marks layers "sliding_attention" (a query sees its `sliding_window` newest
  keys; by default all but every `sliding_window_pattern`-th layer) or "full_attention". With a
  window only the sliding layers rotate q and k: the global layers are NoPE layers
  (`no_rope_layers`, SmolLM3's mechanism). Without a window (EXAONE 4.0 1.2B) every layer is
  global and every layer rotates.
No projection has a bias, the embeddings are not scaled, and one RoPE (with its scaling, llama3 in
the releases) serves every rotating layer. So the model is the Llama model itself.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...errors import ConfigError
from ..config import ModelConfig
from ..family import Family
from ..hf_config import llama_config_from_hf
from ..hf_fields import LLAMA_FIELDS, implemented, inert
from ..llama import LlamaForCausalLM
from ._llama_shaped import llama_shape_to_hf, refuse_partial_rope


def exaone4_layer_types(cfg: dict[str, Any], n_layers: int) -> list[str]:
    """layer_types as Exaone4Config fills it: given, or all full without a window, or all but every
    `sliding_window_pattern`-th layer sliding."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if cfg.get("sliding_window") is None:
        return ["full_attention"] * n_layers
    pattern = cfg.get("sliding_window_pattern")
    if type(pattern) is not int or pattern < 1:
        raise ConfigError(f"exaone4 config field sliding_window_pattern={pattern!r} without "
                          "layer_types is not supported (transformers 5 computes layers from an "
                          "integer only); supported: a positive integer, or layer_types")
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)]


def exaone4_config(cfg: dict[str, Any]) -> ModelConfig:
    refuse_partial_rope(cfg, "exaone4")
    # read as a Llama without windows or biases, then given EXAONE's block, norms and windows
    as_llama = {**cfg, "layer_types": None, "sliding_window": None}
    base = llama_config_from_hf(as_llama, "llama")
    types = exaone4_layer_types(cfg, base.n_layers)
    window = cfg.get("sliding_window")
    if window is None and "sliding_attention" in types:
        raise ConfigError("exaone4 config lists sliding_attention layers in layer_types with "
                          "sliding_window=None; supported: a window, or no sliding layers")
    nope = None
    if window is not None:  # the global layers apply no RoPE
        nope = [i for i, kind in enumerate(types) if kind == "full_attention"] or None
    sliding = window is not None and "sliding_attention" in types
    return replace(base, hf_model_type="exaone4", qkv_bias=False, o_bias=False, mlp_bias=False,
                   block="post_norm", qk_norm="per_head", no_rope_layers=nope,
                   sliding_window=window if sliding else None,
                   layer_types=types if sliding else None)


def exaone4_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = llama_shape_to_hf(cfg, "Exaone4ForCausalLM", "exaone4")
    del out["attention_bias"]
    types = cfg.layer_types or ["full_attention"] * cfg.n_layers
    # a window with no sliding layer still switches the global layers' RoPE off (NoPE)
    window = cfg.sliding_window
    if window is None and cfg.no_rope_layers:
        window = cfg.max_position_embeddings
    out.update(sliding_window=window, layer_types=types)
    return out


EXAONE4_FIELDS = {
    **LLAMA_FIELDS,
    "sliding_window": implemented("the window of the sliding layers; set, it also turns RoPE off "
                                  "in the full-attention layers (null: every layer global, with "
                                  "RoPE)"),
    "sliding_window_pattern": implemented("without layer_types, every n-th layer is global"),
    "layer_types": implemented("which layers slide (and, with a window, which rotate)"),
    "attention_bias": inert("EXAONE 4's projections never have biases"),
    "mlp_bias": inert("EXAONE 4's MLP never has biases"),
}

FAMILY = Family(
    model_type="exaone4",
    architectures=("Exaone4ForCausalLM",),
    hf_config_class="Exaone4Config",
    fields=EXAONE4_FIELDS,
    config=exaone4_config,
    model_class=LlamaForCausalLM,
    defaults=dict(num_key_value_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  sliding_window=4096, sliding_window_pattern=4, tie_word_embeddings=False),
    name="EXAONE 4",
    summary="post-norm blocks, per-head q/k norms, sliding layers with RoPE and global layers "
            "without (NoPE)",
    to_hf=exaone4_to_hf,
)
