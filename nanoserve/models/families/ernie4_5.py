"""ERNIE 4.5 (Baidu, 2025), its dense models: Llama's block with RoPE on adjacent pairs and one
switch for every bias.

HF's Ernie4_5ForCausalLM is Llama's pre-norm block, GQA and SwiGLU MLP with two differences:
- RoPE rotates adjacent dims (x_2i, x_2i+1) by position·θ_i, the GLM layout, where Llama rotates
  (x_i, x_{i+d/2}) (_llama_shaped.AdjacentPairsAttention);
- `use_bias` puts a bias on every projection, q/k/v/o and the MLP's gate/up/down alike.
HF computes that RoPE in float32 and rounds q and k afterwards; nanoserve rotates in the model's
dtype (equal in float32, an ulp apart in bf16). The tensors keep HF's names and layouts, so a
saved checkpoint is transformers' own again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import ModelConfig
from ..family import Family
from ..hf_config import llama_config_from_hf
from ..hf_fields import LLAMA_FIELDS, implemented, inert
from ..llama import LlamaForCausalLM
from ._llama_shaped import (
    AdjacentPairsModel,
    llama_shape_to_hf,
    refuse_partial_rope,
    refuse_windows,
)


def ernie4_5_config(cfg: dict[str, Any]) -> ModelConfig:
    refuse_partial_rope(cfg, "ernie4_5")
    refuse_windows(cfg, "ernie4_5")
    base = llama_config_from_hf({**cfg, "attention_bias": False, "mlp_bias": False}, "llama")
    bias = bool(cfg["use_bias"])
    return replace(base, hf_model_type="ernie4_5", qkv_bias=bias, o_bias=bias, mlp_bias=bias)


def ernie4_5_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = llama_shape_to_hf(cfg, "Ernie4_5ForCausalLM", "ernie4_5")
    del out["attention_bias"]
    out["use_bias"] = cfg.o_bias  # (a model with biases on some projections only reads back wrong)
    return out


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    model_class = AdjacentPairsModel


ERNIE4_5_FIELDS = {
    **LLAMA_FIELDS,
    "use_bias": implemented("biases on q, k, v, o and the MLP's gate, up and down projections"),
    "head_dim": implemented("per-head width; 128 when absent, hidden_size / heads when null"),
    "attention_bias": inert("Ernie 4.5's code reads use_bias"),
    "mlp_bias": inert("Ernie 4.5's code reads use_bias"),
}

FAMILY = Family(
    model_type="ernie4_5",
    architectures=("Ernie4_5ForCausalLM",),
    hf_config_class="Ernie4_5Config",
    fields=ERNIE4_5_FIELDS,
    config=ernie4_5_config,
    model_class=Ernie4_5ForCausalLM,
    defaults=dict(num_key_value_heads=2, head_dim=128, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, tie_word_embeddings=True, use_bias=False,
                  rope_theta=500000.0),
    name="Ernie 4.5",
    summary="Llama with RoPE on adjacent pairs (GLM's layout) and use_bias on every projection",
    to_hf=ernie4_5_to_hf,
)
