"""What the family modules whose checkpoints keep Llama's module names share: refusing a window or
a partial RoPE their HF code would not apply, writing the config.json keys a Llama-shaped config
has in common (a family's `to_hf` adds its own; hf_export.to_hf_config reads the result back and
refuses a model it does not describe), and RoPE on adjacent pairs (Ernie 4.5, GLM-4). Declares no
family itself.

RoPE's pairs. HF's Llama code rotates (x_i, x_{i+d/2}) by position·θ_i (layers.apply_rope,
"rotate_half"); the GLM lineage (GLM-4, Ernie 4.5) rotates adjacent dims (x_2i, x_2i+1) by the same
angle, the layout of the RoFormer paper. The two are one rotation of differently ordered dims, so
weights trained for one give other logits under the other: the attention classes below rotate
adjacent pairs, on the first rotary_dim dims of each head only (partial RoPE: GLM-4 rotates half).
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import ConfigError
from ..config import ModelConfig
from ..llama import LlamaAttention, LlamaDecoderLayer, LlamaModel, SandwichDecoderLayer


def refuse_windows(cfg: dict[str, Any], hf_type: str) -> None:
    """No sliding window: the HF model's mask attends to every key, so a window in the config would
    only make transformers' cache drop keys the mask still reads."""
    kinds = cfg.get("layer_types") or []
    if any(kind != "full_attention" for kind in kinds):
        raise ConfigError(f"{hf_type} config field layer_types={kinds!r} is not supported "
                          f"({hf_type}'s attention is never windowed); supported: null or "
                          "'full_attention' in every layer")


def refuse_partial_rope(cfg: dict[str, Any], hf_type: str) -> None:
    """RoPE over every dim of each head: a partial_rotary_factor inside rope_parameters is refused
    by name (a family module checks its own RoPE; hf_fields checks only the top-level field)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1.0):
        raise ConfigError(f"{hf_type} config field rope_parameters.partial_rotary_factor="
                          f"{factor!r} is not supported (rotating only part of each head); "
                          "supported: 1.0")


def llama_shape_to_hf(cfg: ModelConfig, arch: str, hf_type: str) -> dict[str, Any]:
    """The config.json keys a Llama-shaped family shares: sizes, norm epsilon, RoPE, biases, ids
    (hf_export.to_hf_config reads the result back and refuses a model it does not describe)."""
    eos = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids or None
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
    return dict(architectures=[arch], model_type=hf_type, vocab_size=cfg.vocab_size,
                hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers,
                num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
                max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
                rope_parameters=rope, hidden_act=cfg.hidden_act, attention_bias=cfg.o_bias,
                tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
                eos_token_id=eos, pad_token_id=None)


def apply_rope_adjacent(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair (x_2i, x_2i+1), i < R/2, by position·θ_i; dims from R on pass
    through. x [B, T, H, D]; cos, sin [B, T, 1, R] in layers.rope_cos_sin's half-split layout,
    whose first R/2 columns hold θ_0 .. θ_{R/2−1} once each (R = rotary_dim ≤ D)."""
    rd = cos.shape[-1]
    c, s = cos[..., :rd // 2], sin[..., :rd // 2]  # B, T, 1, R/2
    even, odd = x[..., 0:rd:2], x[..., 1:rd:2]  # B, T, H, R/2 each
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1)  # B, T, H, R/2, 2
    return torch.cat((rotated.flatten(-2), x[..., rd:]), dim=-1)  # B, T, H, D


class AdjacentPairsAttention(LlamaAttention):
    """Llama's attention with RoPE on adjacent pairs."""

    rotate = staticmethod(apply_rope_adjacent)


class AdjacentPairsLayer(LlamaDecoderLayer):
    """Llama's pre-norm block around AdjacentPairsAttention (Ernie 4.5)."""

    attention_class = AdjacentPairsAttention


class AdjacentPairsSandwichLayer(SandwichDecoderLayer):
    """The sandwich block (each branch's output normalised too) around AdjacentPairsAttention
    (GLM-4)."""

    attention_class = AdjacentPairsAttention


class AdjacentPairsModel(LlamaModel):
    """A Llama body of AdjacentPairsLayer blocks. (A class of its own, so the Triton path, whose
    fused kernels rotate HF's Llama pairs, leaves it unfused: triton_layers._fuse_model.)"""

    layer_class = AdjacentPairsLayer


class AdjacentPairsSandwichModel(LlamaModel):
    layer_class = AdjacentPairsSandwichLayer
