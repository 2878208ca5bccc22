"""GLM-4 (Zhipu AI, THUDM; GLM-4-0414): a sandwich block, RoPE on adjacent pairs of half of each
head, q/k/v biases and a fused gate/up matrix.

HF's Glm4ForCausalLM against the pieces nanoserve has:
- the block normalises each branch's input and output, x + norm(attn(norm(x))), then
  x + norm(mlp(norm(x))): Gemma 2's sandwich (`block="sandwich"`), here with Llama's RMSNorm (w,
  not 1 + w; rounded before the scale). HF names the four norms input_layernorm,
  post_self_attn_layernorm (the attention's output), post_attention_layernorm (the MLP's input) and
  post_mlp_layernorm; they are renamed at load onto the sandwich's input_layernorm,
  post_attention_layernorm, pre_feedforward_layernorm and post_feedforward_layernorm;
- RoPE rotates adjacent dims (x_2i, x_2i+1), the GLM layout, on the first head_dim ·
  partial_rotary_factor dims of each head only (0.5 by default):
  _llama_shaped.AdjacentPairsAttention with ModelConfig's `partial_rotary_factor`;
- `attention_bias` puts biases on q, k and v, never on o; the MLP has none;
- the MLP's gate and up projections are one [2·intermediate, hidden] matrix, gate rows first,
  split at load as Phi-3's is (models/fused.py).
Saving is refused: the checkpoint would need the renames and the fusing undone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..config import ModelConfig
from ..family import Family
from ..fused import split_fused
from ..hf_config import llama_config_from_hf
from ..hf_fields import LLAMA_FIELDS, implemented, inert
from ..llama import LlamaForCausalLM
from ._llama_shaped import AdjacentPairsSandwichModel, refuse_windows

# GLM-4's norm names -> the sandwich block's (models/llama.py SandwichDecoderLayer)
NORM_NAMES = {
    "post_self_attn_layernorm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_mlp_layernorm": "post_feedforward_layernorm",
}


def glm4_partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """The rotated fraction of each head: in rope_parameters (transformers 5) or at the top level
    (transformers 4), 0.5 when absent from both, as Glm4Config fills it."""
    rope = cfg.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))


def glm4_config(cfg: dict[str, Any]) -> ModelConfig:
    refuse_windows(cfg, "glm4")
    base = llama_config_from_hf({**cfg, "attention_bias": False, "mlp_bias": False}, "llama")
    return replace(base, hf_model_type="glm4", qkv_bias=bool(cfg["attention_bias"]),
                   block="sandwich", partial_rotary_factor=glm4_partial_rotary_factor(cfg))


def rename_norm(key: str) -> str:
    """model.layers.N.<GLM's norm>.weight -> model.layers.N.<the sandwich's>.weight."""
    parts = key.split(".")
    if len(parts) == 5 and parts[3] in NORM_NAMES:
        parts[3] = NORM_NAMES[parts[3]]
    return ".".join(parts)


def glm4_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The sandwich's norm names, and gate_up_proj split into gate_proj and up_proj."""
    return split_fused(cfg, {rename_norm(key): t for key, t in tensors.items()})


class Glm4ForCausalLM(LlamaForCausalLM):
    model_class = AdjacentPairsSandwichModel


GLM4_FIELDS = {
    **LLAMA_FIELDS,
    "attention_bias": implemented("biases on q, k and v (o_proj never has one)"),
    "rope_parameters": implemented("RoPE base, scaling and partial_rotary_factor (the rotated "
                                   "fraction of each head, adjacent pairs)"),
    "partial_rotary_factor": implemented("transformers 4's place for the rotated fraction"),
    "head_dim": implemented("per-head width; 128 when absent"),
    "mlp_bias": inert("GLM-4's MLP never has biases"),
}

FAMILY = Family(
    model_type="glm4",
    architectures=("Glm4ForCausalLM",),
    hf_config_class="Glm4Config",
    fields=GLM4_FIELDS,
    config=glm4_config,
    model_class=Glm4ForCausalLM,
    defaults=dict(num_key_value_heads=2, head_dim=128, max_position_embeddings=131072,
                  rms_norm_eps=1.5625e-07, tie_word_embeddings=False, attention_bias=True,
                  eos_token_id=[151329, 151336, 151338]),
    rename=glm4_tensors,
    name="GLM-4",
    summary="sandwich norms, RoPE on adjacent pairs of half of each head, q/k/v biases, fused "
            "gate/up (split at load)",
)
