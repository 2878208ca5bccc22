"""Phi-1, Phi-1.5 and Phi-2 (Microsoft): one LayerNorm feeding attention and MLP side by side.

HF's PhiDecoderLayer computes x + attn(ln(x)) + mlp(ln(x)) with the one `input_layernorm` (the
parallel residual, one norm), LayerNorms with biases (`final_layernorm` at the end), biases on
q, k, v and `dense`, a GELU MLP with biases (fc1, fc2), RoPE on the first head_dim ·
partial_rotary_factor dims of each head, an LM head with a bias, and optionally (qk_layernorm) one
LayerNorm over head_dim, shared by the heads, on q and on k before RoPE. The blocks are
_parallel_blocks.py's; `rename` maps dense, fc1, fc2 and the norms onto Llama's names.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..config import ModelConfig
from ..family import Family
from ..hf_config import llama_config_from_hf
from ..hf_fields import COMMON, DROPOUT, implemented, inert
from ._parallel_blocks import (
    BlockForCausalLM,
    BlockOptions,
    check_head_dim,
    rename_keys,
    rope_fields,
)


def phi_config(cfg: dict[str, Any]) -> ModelConfig:
    check_head_dim(cfg, "phi")
    theta, factor = rope_fields(cfg, "phi", ("rope_theta",), ("partial_rotary_factor",), 0.5)
    options = BlockOptions(parallel_residual=True, shared_norm=True, lm_head_bias=True,
                           qk_norm="shared" if cfg["qk_layernorm"] else None)
    base = llama_config_from_hf({**cfg, "rope_parameters": {"rope_theta": theta},
                                 "head_dim": None}, "llama")
    return replace(base, arch="phi", hf_model_type="phi", norm_eps=float(cfg["layer_norm_eps"]),
                   qkv_bias=True, o_bias=True, mlp_bias=True, partial_rotary_factor=factor,
                   family_options=options)


_NAMES = (("model.final_layernorm.", "model.norm."),
          (".self_attn.dense.", ".self_attn.o_proj."),
          (".self_attn.q_layernorm.", ".self_attn.q_norm."),
          (".self_attn.k_layernorm.", ".self_attn.k_norm."),
          (".mlp.fc1.", ".mlp.up_proj."),
          (".mlp.fc2.", ".mlp.down_proj."))


def phi_rename(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's names -> Llama's (the tensors themselves are unchanged)."""
    return rename_keys(tensors, _NAMES)


PHI_FIELDS = {
    **COMMON,
    "vocab_size": implemented("rows of the token embedding and of the LM head"),
    "hidden_size": implemented("hidden size"),
    "intermediate_size": implemented("MLP width"),
    "num_hidden_layers": implemented("number of blocks"),
    "num_attention_heads": implemented("query heads (head_dim = hidden_size / heads)"),
    "num_key_value_heads": implemented("key/value heads (grouped-query attention); None means all"),
    "hidden_act": implemented("the MLP's activation: fc2(act(fc1(x)))"),
    "max_position_embeddings": implemented("the longest context (RoPE itself has no table)"),
    "layer_norm_eps": implemented("LayerNorm epsilon (the blocks', the final one's, q/k's)"),
    "rope_parameters": implemented("RoPE base and partial_rotary_factor (the rotated fraction of "
                                   "each head); rope types other than 'default' are refused"),
    "rope_theta": implemented("transformers 4's place for the RoPE base"),
    "rope_scaling": implemented("transformers 4's place for the RoPE parameters"),
    "partial_rotary_factor": implemented("transformers 4's place for the rotated fraction"),
    "qk_layernorm": implemented("one LayerNorm(head_dim), with a bias, on each head of q and of k "
                                "before RoPE"),
    "head_dim": implemented("read by HF's RoPE and attention; refused unless hidden_size / heads "
                            "(the q/k LayerNorm's width)"),
    "resid_pdrop": inert(DROPOUT),
    "embd_pdrop": inert(DROPOUT),
    "attention_dropout": inert(DROPOUT),
}

FAMILY = Family(
    model_type="phi",
    architectures=("PhiForCausalLM",),
    hf_config_class="PhiConfig",
    fields=PHI_FIELDS,
    config=phi_config,
    model_class=BlockForCausalLM,
    defaults=dict(hidden_act="gelu_new", layer_norm_eps=1e-5, qk_layernorm=False,
                  tie_word_embeddings=False, max_position_embeddings=2048),
    rename=phi_rename,
    name="Phi-1.5, Phi-2",
    summary="attention and a GELU MLP side by side from one LayerNorm, partial RoPE, biases "
            "everywhere (the LM head's too), optional q/k LayerNorm",
)
