"""Command-R (Cohere): attention and a SwiGLU MLP side by side from one bias-free LayerNorm,
RoPE on adjacent pairs, and scaled logits.

HF's CohereDecoderLayer computes x + attn(ln(x)) + mlp(ln(x)) with the one input_layernorm, a
LayerNorm without a bias (CohereLayerNorm subtracts the mean and scales, in float32); its RoPE
rotates the adjacent pairs (x_2i, x_2i+1) of each head (cos and sin repeat_interleave'd, not
concatenated as in Llama); the logits are lm_head(h) × logit_scale; with use_qk_norm each head of
q and of k goes through a bias-free LayerNorm with a weight per head ([H, head_dim]) before RoPE.
Module names are Llama's already, so nothing is renamed. The blocks are _parallel_blocks.py's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import ModelConfig
from ..family import Family
from ..hf_config import llama_config_from_hf
from ..hf_fields import COMMON, DROPOUT, implemented, inert
from ._parallel_blocks import BlockForCausalLM, BlockOptions, rope_fields


def cohere_config(cfg: dict[str, Any]) -> ModelConfig:
    # (HF's Cohere RoPE turns every dim, whatever partial_rotary_factor says)
    theta, _ = rope_fields(cfg, "cohere", ("rope_theta",), (), 1.0)
    options = BlockOptions(parallel_residual=True, shared_norm=True, gated_mlp=True,
                           norm_bias=False, interleaved_rope=True,
                           qk_norm="per_head" if cfg["use_qk_norm"] else None,
                           logit_scale=float(cfg["logit_scale"]))
    base = llama_config_from_hf({**cfg, "rope_parameters": {"rope_theta": theta}}, "llama")
    bias = bool(cfg["attention_bias"])
    return replace(base, arch="cohere", hf_model_type="cohere", bos_in_prompts=True,
                   norm_eps=float(cfg["layer_norm_eps"]), qkv_bias=bias, o_bias=bias,
                   mlp_bias=False, family_options=options)


COHERE_FIELDS = {
    **COMMON,
    "vocab_size": implemented("rows of the token embedding and of the LM head"),
    "hidden_size": implemented("hidden size"),
    "intermediate_size": implemented("MLP width"),
    "num_hidden_layers": implemented("number of blocks"),
    "num_attention_heads": implemented("query heads"),
    "num_key_value_heads": implemented("key/value heads (grouped-query attention); None means all"),
    "head_dim": implemented("per-head width; None means hidden_size / num_attention_heads"),
    "hidden_act": implemented("the gate's activation in the gated MLP: act(gate(x)) · up(x)"),
    "max_position_embeddings": implemented("the longest context (RoPE itself has no table)"),
    "layer_norm_eps": implemented("LayerNorm epsilon (the blocks', the final one's, q/k's)"),
    "logit_scale": implemented("logits × this"),
    "rope_parameters": implemented("RoPE base; rope types other than 'default' are refused (HF's "
                                   "Cohere RoPE ignores partial_rotary_factor)"),
    "rope_theta": implemented("transformers 4's place for the RoPE base"),
    "rope_scaling": implemented("transformers 4's place for the RoPE parameters"),
    "attention_bias": implemented("biases on q, k, v and o"),
    "use_qk_norm": implemented("a bias-free LayerNorm per head (a weight each) on q and k before "
                               "RoPE"),
    "attention_dropout": inert(DROPOUT),
}

FAMILY = Family(
    model_type="cohere",
    architectures=("CohereForCausalLM",),
    hf_config_class="CohereConfig",
    fields=COHERE_FIELDS,
    config=cohere_config,
    model_class=BlockForCausalLM,
    defaults=dict(hidden_act="silu", layer_norm_eps=1e-5, logit_scale=0.0625, use_qk_norm=False,
                  attention_bias=False, tie_word_embeddings=True, rope_theta=500000.0,
                  max_position_embeddings=8192, intermediate_size=22528),
    name="Command R (Cohere)",
    summary="attention and SwiGLU side by side from one bias-free LayerNorm, RoPE on adjacent "
            "pairs, logits × logit_scale, optional per-head q/k LayerNorm",
)
