"""GPT-NeoX and Pythia (EleutherAI): the parallel residual, partial RoPE and a fused, per-head
q|k|v projection.

HF's GPTNeoXLayer computes x + attn(ln₁(x)) + mlp(ln₂(x)) (use_parallel_residual; False: Llama's
sequence with LayerNorms), LayerNorms with biases, a GELU MLP with biases (dense_h_to_4h,
dense_4h_to_h) and RoPE on the first head_dim · rotary_pct dims of each head (rotate_half pairs).
Its query_key_value weight [3·C, C] holds, head after head, that head's q, k and v rows
(viewed [H, 3, D, C]), not all the q rows first as Phi-3's qkv_proj does: `split_qkv` takes it
apart into q_proj / k_proj / v_proj at load. The LM head `embed_out` is untied by default. The
blocks are _parallel_blocks.py's.
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


def gpt_neox_config(cfg: dict[str, Any]) -> ModelConfig:
    check_head_dim(cfg, "gpt_neox")
    theta, factor = rope_fields(cfg, "gpt_neox", ("rotary_emb_base", "rope_theta"),
                                ("rotary_pct", "partial_rotary_factor"), 0.25)
    options = BlockOptions(parallel_residual=bool(cfg["use_parallel_residual"]))
    base = llama_config_from_hf({**cfg, "rope_parameters": {"rope_theta": theta},
                                 "num_key_value_heads": None, "head_dim": None}, "llama")
    bias = bool(cfg["attention_bias"])
    return replace(base, arch="gpt_neox", hf_model_type="gpt_neox",
                   norm_eps=float(cfg["layer_norm_eps"]), qkv_bias=bias, o_bias=bias,
                   mlp_bias=True, partial_rotary_factor=factor, family_options=options)


def split_qkv(cfg: ModelConfig, fused: torch.Tensor) -> list[torch.Tensor]:
    """query_key_value's weight [3·H·D, C] (or bias [3·H·D]) -> q, k, v [H·D, ...]: its rows are
    per head [q_h; k_h; v_h] (HF views them [H, 3, D])."""
    H, D = cfg.n_heads, cfg.head_dim
    per_head = fused.reshape(H, 3, D, *fused.shape[1:])  # H, 3, D, (C)
    return [per_head[:, i].reshape(H * D, *fused.shape[1:]) for i in range(3)]


_NAMES = (("gpt_neox.embed_in.", "model.embed_tokens."),
          ("gpt_neox.final_layer_norm.", "model.norm."),
          ("gpt_neox.layers.", "model.layers."),
          ("embed_out.", "lm_head."),
          (".attention.dense.", ".self_attn.o_proj."),
          (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
          (".mlp.dense_4h_to_h.", ".mlp.down_proj."))


def gpt_neox_rename(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> Llama's, and each layer's query_key_value split into q_proj, k_proj, v_proj
    (the causal-mask buffers old checkpoints carry, attention.bias and attention.masked_bias,
    dropped)."""
    out = {}
    renamed = rename_keys(tensors, _NAMES, dropped=(".attention.bias", ".attention.masked_bias"))
    for key, t in renamed.items():
        prefix, fused, kind = key.rpartition(".attention.query_key_value.")
        if not fused:
            out[key] = t
            continue
        if t.shape[0] != 3 * cfg.n_heads * cfg.head_dim:
            out[key] = t  # the loader then names the missing q_proj, k_proj and v_proj
            continue
        for name, part in zip(("q_proj", "k_proj", "v_proj"), split_qkv(cfg, t)):
            out[f"{prefix}.self_attn.{name}.{kind}"] = part
    return out


GPT_NEOX_FIELDS = {
    **COMMON,
    "vocab_size": implemented("rows of embed_in and of embed_out"),
    "hidden_size": implemented("hidden size"),
    "num_hidden_layers": implemented("number of blocks"),
    "num_attention_heads": implemented("attention heads (head_dim = hidden_size / heads)"),
    "intermediate_size": implemented("MLP width"),
    "hidden_act": implemented("the MLP's activation: down(act(up(x)))"),
    "max_position_embeddings": implemented("the longest context (RoPE itself has no table)"),
    "layer_norm_eps": implemented("LayerNorm epsilon"),
    "use_parallel_residual": implemented("x + attn(ln₁(x)) + mlp(ln₂(x)); False: x + attn(ln₁(x)), "
                                         "then + mlp(ln₂(·))"),
    "rope_parameters": implemented("RoPE base and partial_rotary_factor (the rotated fraction of "
                                   "each head); rope types other than 'default' are refused"),
    "rope_scaling": implemented("transformers 4's place for the RoPE parameters"),
    "rotary_pct": implemented("transformers 4's name of partial_rotary_factor"),
    "rotary_emb_base": implemented("transformers 4's name of the RoPE base"),
    "attention_bias": implemented("biases on query_key_value and dense"),
    "head_dim": implemented("read by HF's RoPE only; refused unless hidden_size / heads"),
    "is_decoder": inert("cross-attention switch of encoder-decoder configs; GPT-NeoX has none"),
    "attention_dropout": inert(DROPOUT),
    "hidden_dropout": inert(DROPOUT),
    "classifier_dropout": inert("the dropout of GPTNeoXForTokenClassification's head"),
}

FAMILY = Family(
    model_type="gpt_neox",
    architectures=("GPTNeoXForCausalLM",),
    hf_config_class="GPTNeoXConfig",
    fields=GPT_NEOX_FIELDS,
    config=gpt_neox_config,
    model_class=BlockForCausalLM,
    defaults=dict(hidden_act="gelu", layer_norm_eps=1e-5, use_parallel_residual=True,
                  attention_bias=True, tie_word_embeddings=False, max_position_embeddings=2048,
                  intermediate_size=24576),
    rename=gpt_neox_rename,
    name="Pythia, GPT-NeoX",
    summary="LayerNorms with biases, a GELU MLP, the parallel residual, RoPE on rotary_pct of each "
            "head; the fused per-head q, k, v split at load",
)
