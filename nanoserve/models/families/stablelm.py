"""StableLM 2 and StableLM 3B-4E1T (Stability AI): Llama's projections and SwiGLU MLP with
LayerNorms, partial RoPE, and optionally a parallel residual and a q/k LayerNorm per head.

HF's StableLmDecoderLayer is Llama's sequential block with LayerNorms (biases included) or, with
use_parallel_residual, x + attn(ln(x)) + mlp(ln(x)) from the one input_layernorm; q, k and v have
biases with use_qkv_bias (o_proj and the MLP never); RoPE turns the first head_dim ·
partial_rotary_factor dims of each head (rotate_half pairs); with qk_layernorm each head of q and
of k goes through a LayerNorm of its own (HF keeps H of them, q_layernorm.norms.h.weight, no bias),
loaded as one [H, head_dim] weight. The blocks are _parallel_blocks.py's.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from ..config import ModelConfig
from ..family import Family
from ..hf_config import llama_config_from_hf
from ..hf_fields import COMMON, DROPOUT, implemented, inert
from ._parallel_blocks import BlockForCausalLM, BlockOptions, check_head_dim, rope_fields


def stablelm_config(cfg: dict[str, Any]) -> ModelConfig:
    check_head_dim(cfg, "stablelm")
    theta, factor = rope_fields(cfg, "stablelm", ("rope_theta",), ("partial_rotary_factor",), 0.25)
    parallel = bool(cfg["use_parallel_residual"])
    options = BlockOptions(parallel_residual=parallel, shared_norm=parallel, gated_mlp=True,
                           qk_norm="per_head" if cfg["qk_layernorm"] else None)
    base = llama_config_from_hf({**cfg, "rope_parameters": {"rope_theta": theta},
                                 "head_dim": None}, "llama")
    return replace(base, arch="stablelm", hf_model_type="stablelm",
                   norm_eps=float(cfg["layer_norm_eps"]), qkv_bias=bool(cfg["use_qkv_bias"]),
                   o_bias=False, mlp_bias=False, partial_rotary_factor=factor,
                   family_options=options)


# self_attn.q_layernorm.norms.3.weight: head 3's LayerNorm
_HEAD_NORM = re.compile(r"^(.*\.self_attn)\.([qk])_layernorm\.norms\.(\d+)\.weight$")


def stablelm_rename(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's H per-head LayerNorm weights of q (and of k) stacked into one [H, head_dim]
    q_norm.weight (k_norm.weight); every other tensor keeps its name."""
    out, heads = {}, {}
    for key, t in tensors.items():
        m = _HEAD_NORM.match(key)
        if m is None:
            out[key] = t
            continue
        prefix, which, head = m.groups()
        heads.setdefault(f"{prefix}.{which}_norm.weight", {})[int(head)] = t
    for key, per_head in heads.items():
        out[key] = torch.stack([per_head[h] for h in sorted(per_head)])  # H, D
    return out


STABLELM_FIELDS = {
    **COMMON,
    "vocab_size": implemented("rows of the token embedding and of the LM head"),
    "hidden_size": implemented("hidden size"),
    "intermediate_size": implemented("MLP width"),
    "num_hidden_layers": implemented("number of blocks"),
    "num_attention_heads": implemented("query heads (head_dim = hidden_size / heads)"),
    "num_key_value_heads": implemented("key/value heads (grouped-query attention); None means all"),
    "hidden_act": implemented("the gate's activation in the gated MLP: act(gate(x)) · up(x)"),
    "max_position_embeddings": implemented("the longest context (RoPE itself has no table)"),
    "layer_norm_eps": implemented("LayerNorm epsilon (the blocks', the final one's, q/k's)"),
    "rope_parameters": implemented("RoPE base and partial_rotary_factor (the rotated fraction of "
                                   "each head); rope types other than 'default' are refused"),
    "rope_theta": implemented("transformers 4's place for the RoPE base"),
    "rope_scaling": implemented("transformers 4's place for the RoPE parameters"),
    "partial_rotary_factor": implemented("transformers 4's place for the rotated fraction"),
    "use_qkv_bias": implemented("biases on q, k and v (o_proj never has one)"),
    "qk_layernorm": implemented("a LayerNorm per head (a weight each, no bias) on q and k before "
                                "RoPE"),
    "use_parallel_residual": implemented("x + attn(ln(x)) + mlp(ln(x)) from the one "
                                         "input_layernorm; False: Llama's sequence"),
    "head_dim": implemented("read by HF's RoPE only; refused unless hidden_size / heads"),
    "hidden_dropout": inert(DROPOUT),
    "attention_dropout": inert(DROPOUT),
}

FAMILY = Family(
    model_type="stablelm",
    architectures=("StableLmForCausalLM",),
    hf_config_class="StableLmConfig",
    fields=STABLELM_FIELDS,
    config=stablelm_config,
    model_class=BlockForCausalLM,
    defaults=dict(hidden_act="silu", layer_norm_eps=1e-5, use_qkv_bias=False, qk_layernorm=False,
                  use_parallel_residual=False, tie_word_embeddings=False,
                  max_position_embeddings=4096, intermediate_size=6912, num_key_value_heads=32),
    rename=stablelm_rename,
    name="StableLM",
    summary="Llama's projections and SwiGLU with LayerNorms, partial RoPE, optional parallel "
            "residual and per-head q/k LayerNorm",
)
