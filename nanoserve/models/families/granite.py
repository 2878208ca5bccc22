"""Granite 3 (IBM): a Llama with four multipliers, the worked example of a family module.

Granite's HF code scales the token embeddings by `embedding_multiplier`, each residual branch by
`residual_multiplier` (x + m·attn(norm(x)), then x + m·mlp(norm(x))), replaces attention's 1/√D by
`attention_multiplier`, and divides the logits by `logits_scaling`. Everything else is Llama's, so
the config is read as a Llama's and the model subclasses the Llama blocks, overriding only where a
multiplier enters.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ...errors import ConfigError
from ..config import ModelConfig
from ..family import Family
from ..hf_config import llama_config_from_hf
from ..hf_fields import LLAMA_FIELDS, implemented
from ..llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


@dataclass(frozen=True)
class GraniteOptions:
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def __post_init__(self) -> None:
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"granite config field {name}={value!r} must be a positive "
                                  "finite number")


def granite_config(cfg: dict[str, Any]) -> ModelConfig:
    options = GraniteOptions(embedding_multiplier=float(cfg["embedding_multiplier"]),
                             residual_multiplier=float(cfg["residual_multiplier"]),
                             logits_scaling=float(cfg["logits_scaling"]))
    base = llama_config_from_hf(cfg, "llama")
    return replace(base, hf_model_type="granite", attn_scale=float(cfg["attention_multiplier"]),
                   family_options=options)


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with each branch × residual_multiplier before it is added."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.residual_multiplier = cfg.family_options.residual_multiplier

    def forward(self, x, positions, cos, sin, cache):
        attn = self.self_attn(self.input_layernorm(x), positions, cos, sin, cache)
        x = x + attn * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class GraniteModel(LlamaModel):
    layer_class = GraniteDecoderLayer

    def embed(self, input_ids, positions):
        return self.embed_tokens(input_ids) * self.config.family_options.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_class = GraniteModel

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h) / self.config.family_options.logits_scaling


GRANITE_FIELDS = {
    **LLAMA_FIELDS,
    "embedding_multiplier": implemented("token embeddings × this"),
    "residual_multiplier": implemented("each block's attention and MLP outputs × this before the "
                                       "residual add"),
    "attention_multiplier": implemented("attention scores × this (in place of 1/√head_dim)"),
    "logits_scaling": implemented("logits ÷ this"),
}

FAMILY = Family(
    model_type="granite",
    architectures=("GraniteForCausalLM",),
    hf_config_class="GraniteConfig",
    fields=GRANITE_FIELDS,
    config=granite_config,
    model_class=GraniteForCausalLM,
    defaults=dict(embedding_multiplier=1.0, residual_multiplier=1.0, attention_multiplier=1.0,
                  logits_scaling=1.0, rms_norm_eps=1e-6),
    name="Granite 3",
    summary="multipliers on the embeddings, the residual branches, the attention and the logits",
)
