"""StarCoder2 (BigCode): Llama's sequential block with LayerNorms, biases and a plain GELU MLP,
and a sliding window.

HF's Starcoder2DecoderLayer is x + attn(ln₁(x)), then + mlp(ln₂(·)), with LayerNorms that always
have a bias, biases on q, k, v, o and both MLP linears when use_bias, the MLP c_proj(act(c_fc(x)))
(no gate), RoPE over all of each head, and, when sliding_window is set, every layer attending to
its `sliding_window` newest keys (Mistral's mask). The blocks are _parallel_blocks.py's; `rename`
maps c_fc and c_proj onto up_proj and down_proj.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..config import ModelConfig
from ..family import Family
from ..hf_config import llama_config_from_hf
from ..hf_fields import COMMON, DROPOUT, implemented, inert
from ._parallel_blocks import BlockForCausalLM, BlockOptions, rename_keys, rope_fields


def starcoder2_config(cfg: dict[str, Any]) -> ModelConfig:
    # (HF's StarCoder2 RoPE turns every dim, whatever partial_rotary_factor says)
    theta, _ = rope_fields(cfg, "starcoder2", ("rope_theta",), (), 1.0)
    window = cfg.get("sliding_window")
    base = llama_config_from_hf({**cfg, "rope_parameters": {"rope_theta": theta}}, "llama")
    bias = bool(cfg["use_bias"])
    return replace(base, arch="starcoder2", hf_model_type="starcoder2",
                   norm_eps=float(cfg["norm_epsilon"]), qkv_bias=bias, o_bias=bias, mlp_bias=bias,
                   sliding_window=None if window is None else int(window),
                   family_options=BlockOptions())


_NAMES = ((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))


def starcoder2_rename(cfg: ModelConfig,
                      tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's MLP names -> Llama's (the tensors themselves are unchanged)."""
    return rename_keys(tensors, _NAMES)


STARCODER2_FIELDS = {
    **COMMON,
    "vocab_size": implemented("rows of the token embedding and of the LM head"),
    "hidden_size": implemented("hidden size"),
    "intermediate_size": implemented("MLP width"),
    "num_hidden_layers": implemented("number of blocks"),
    "num_attention_heads": implemented("query heads"),
    "num_key_value_heads": implemented("key/value heads (grouped-query attention); None means all"),
    "head_dim": implemented("per-head width; None means hidden_size / num_attention_heads"),
    "hidden_act": implemented("the MLP's activation: c_proj(act(c_fc(x)))"),
    "max_position_embeddings": implemented("the longest context (RoPE itself has no table)"),
    "norm_epsilon": implemented("LayerNorm epsilon"),
    "rope_parameters": implemented("RoPE base; rope types other than 'default' are refused (HF's "
                                   "StarCoder2 RoPE ignores partial_rotary_factor)"),
    "rope_theta": implemented("transformers 4's place for the RoPE base"),
    "rope_scaling": implemented("transformers 4's place for the RoPE parameters"),
    "sliding_window": implemented("the window of every layer (null: none): a query at p sees keys "
                                  "p − w + 1 .. p"),
    "use_bias": implemented("biases on q, k, v, o, c_fc and c_proj (the LayerNorms always have "
                            "one)"),
    "attention_dropout": inert(DROPOUT),
    "residual_dropout": inert(DROPOUT),
    "embedding_dropout": inert(DROPOUT),
}

FAMILY = Family(
    model_type="starcoder2",
    architectures=("Starcoder2ForCausalLM",),
    hf_config_class="Starcoder2Config",
    fields=STARCODER2_FIELDS,
    config=starcoder2_config,
    model_class=BlockForCausalLM,
    defaults=dict(hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5, use_bias=True,
                  tie_word_embeddings=True, num_key_value_heads=2, max_position_embeddings=4096,
                  intermediate_size=12288),
    rename=starcoder2_rename,
    name="StarCoder2",
    summary="LayerNorms with biases, a plain GELU MLP (c_fc, c_proj), biases on every projection, "
            "a sliding window",
)
