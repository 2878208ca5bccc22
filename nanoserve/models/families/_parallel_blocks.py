"""The blocks of the GPT-NeoX lineage (Pythia, Phi-2, StableLM, StarCoder2, Cohere), written once on
the Llama classes; declares no family itself.

What these families change in Llama's block, each a switch in `BlockOptions`:
- LayerNorm (Ba et al. 2016) instead of RMSNorm: y = (x − mean(x)) / √(var(x) + eps) · w (+ b),
  with a bias in all but Cohere's;
- a plain MLP, down(act(up(x))) with a GELU, where Llama gates: HF's dense_h_to_4h / dense_4h_to_h
  (GPT-NeoX), fc1 / fc2 (Phi), c_fc / c_proj (StarCoder2), loaded as up_proj / down_proj;
- the parallel residual of GPT-J and GPT-NeoX: x + attn(ln₁(x)) + mlp(ln₂(x)), both branches read
  the block's input (Phi, StableLM and Cohere feed both from one norm, ln₁ = ln₂) where Llama's
  sequential block feeds the MLP x + attn(...);
- a LayerNorm over each head of q and k before RoPE: one (head_dim) weight and bias shared by the
  heads (Phi's qk_layernorm) or a weight per head (StableLM's qk_layernorm, Cohere's use_qk_norm);
- RoPE on the first rotary_dim dims of each head only (partial_rotary_factor; layers.apply_rope
  rotates (i, i + d/2) pairs within them, HF's rotate_half), or on adjacent pairs (2i, 2i + 1)
  (Cohere's interleaved layout, `_llama_shaped.apply_rope_adjacent`);
- an LM head with a bias (Phi) and logits × logit_scale (Cohere).

The module names stay Llama's (self_attn.q_proj, mlp.up_proj, input_layernorm, model.norm, ...):
each family's `rename` maps its checkpoint onto them. Their layout is not Llama's, so a family sets
`ModelConfig.arch` to its own model type: extensions that walk modules by name (quantization's
block groups, tensor parallelism) refuse it by name instead of folding scales into the wrong norm
or sharding a per-head norm's weight they do not know about.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ..config import ModelConfig
from ..layers import ACTIVATION_FNS, apply_rope, attention
from ..llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from ._llama_shaped import apply_rope_adjacent

QK_NORMS = (None, "shared", "per_head")  # BlockOptions.qk_norm


@dataclass(frozen=True)
class BlockOptions:
    """How a family's block differs from Llama's (ModelConfig.family_options)."""

    parallel_residual: bool = False  # x + attn(ln₁(x)) + mlp(ln₂(x)); False: Llama's sequence
    shared_norm: bool = False  # parallel with one norm: ln₂ is ln₁ (no post_attention_layernorm)
    gated_mlp: bool = False  # SwiGLU gate/up/down (StableLM, Cohere); False: down(act(up(x)))
    norm_bias: bool = True  # every LayerNorm has a bias (Cohere's have none)
    qk_norm: str | None = None  # LayerNorm of q and k per head: one of QK_NORMS
    interleaved_rope: bool = False  # RoPE pairs (2i, 2i + 1) (Cohere); False: (i, i + d/2)
    lm_head_bias: bool = False  # the LM head has a bias (Phi)
    logit_scale: float = 1.0  # logits × this (Cohere)

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS:
            raise ConfigError(f"qk_norm={self.qk_norm!r}; supported: {QK_NORMS}")
        if self.shared_norm and not self.parallel_residual:
            raise ConfigError("shared_norm=True needs parallel_residual=True: a sequential block "
                              "normalises the MLP's input on its own")
        scale = self.logit_scale
        if not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ConfigError(f"logit_scale={scale!r} must be a positive finite number")


# ----------------------------------------------------------------------------- the config
def rope_fields(cfg: dict[str, Any], hf_type: str, theta_names: tuple[str, ...],
                factor_names: tuple[str, ...], factor_default: float) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) as transformers 5 standardises them: rope_parameters
    first (or transformers 4's rope_scaling), then the top-level names older config.json files
    use (GPT-NeoX's rotary_emb_base and rotary_pct), then the class default. Only the default RoPE
    is read: these families' releases use no scaling."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"{hf_type} config field rope_parameters.rope_type={kind!r} is not "
                          "supported (RoPE scaling; no release of this family uses it); "
                          "supported: 'default'")
    theta = _first(params, cfg, "rope_theta", theta_names, 10000.0)
    factor = _first(params, cfg, "partial_rotary_factor", factor_names, factor_default)
    return float(theta), float(factor)


def _first(params: dict, cfg: dict, key: str, legacy: tuple[str, ...], default: float) -> Any:
    if params.get(key) is not None:
        return params[key]
    for name in legacy:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def check_head_dim(cfg: dict[str, Any], hf_type: str) -> None:
    """These families' attention splits hidden_size into the heads; a head_dim that says otherwise
    is refused by name (HF's rotary embedding would read it, its attention would not)."""
    natural = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    if cfg.get("head_dim") not in (None, natural):
        raise ConfigError(f"{hf_type} config field head_dim={cfg['head_dim']!r} is not supported "
                          "(the attention splits hidden_size evenly into the heads); supported: "
                          f"null or {natural}")


# ----------------------------------------------------------------------------- layers
class LayerNorm(nn.LayerNorm):
    """y = (x − mean(x)) / √(var(x) + eps) · w (+ b), over the last dim, computed in float32 (as
    Cohere's; GPT-NeoX's torch LayerNorm also accumulates in float32) and rounded back to x's
    dtype."""

    def __init__(self, dim: int, eps: float, bias: bool):
        super().__init__(dim, eps=eps, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        y = F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), bias, self.eps)
        return y.to(x.dtype)


class PerHeadLayerNorm(nn.Module):
    """LayerNorm over head_dim with a weight of its own per head, no bias: x [B, T, H, D] ->
    (x − mean) / √(var + eps) · weight[h]. StableLM keeps H LayerNorms (norms.h.weight), Cohere one
    [H, D] weight: both load as this [H, D] weight."""

    def __init__(self, n_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_heads, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # B, T, H, D
        y = F.layer_norm(x.float(), x.shape[-1:], eps=self.eps) * self.weight.float()
        return y.to(x.dtype)


def layer_norm(cfg: ModelConfig) -> LayerNorm:
    """A LayerNorm over the hidden size, with a bias where the family's have one."""
    return LayerNorm(cfg.hidden_size, cfg.norm_eps, cfg.family_options.norm_bias)


class BlockAttention(LlamaAttention):
    """Llama's attention (q/k/v/o, biases, GQA, windows) with a LayerNorm of q and k per head
    before RoPE and the family's pair layout for RoPE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        options = cfg.family_options
        self.rotate = apply_rope_adjacent if options.interleaved_rope else apply_rope
        self.head_norm = options.qk_norm
        if options.qk_norm == "shared":  # Phi: one LayerNorm(head_dim), with a bias, for all heads
            self.q_norm = LayerNorm(cfg.head_dim, cfg.norm_eps, bias=True)
            self.k_norm = LayerNorm(cfg.head_dim, cfg.norm_eps, bias=True)
        elif options.qk_norm == "per_head":  # StableLM, Cohere: a weight per head
            self.q_norm = PerHeadLayerNorm(cfg.n_heads, cfg.head_dim, cfg.norm_eps)
            self.k_norm = PerHeadLayerNorm(cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps)

    def forward(self, x, positions, cos, sin, cache):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # B, T, H, D
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # B, T, Hkv, D
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.head_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        how = dict(window=self.window, scale=self.scale, softcap=self.softcap)
        if cache is None:
            y = attention(q, k, v, **how)  # B, T, H, D
        else:
            y = cache.attention(self.layer_idx, q, k, v, positions, **how)  # B, T, H, D
        return self.o_proj(y.reshape(B, T, -1))


class PlainMLP(nn.Module):
    """down(act(up(x))): the transformer's original MLP, no gate (GPT-NeoX, Phi, StarCoder2)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATION_FNS[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


class BlockDecoderLayer(LlamaDecoderLayer):
    """LayerNorms, the family's MLP, and the parallel or the sequential residual."""

    attention_class = BlockAttention

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        options = cfg.family_options
        self.parallel_residual = options.parallel_residual
        self.input_layernorm = layer_norm(cfg)
        if options.shared_norm:
            del self.post_attention_layernorm  # both branches read input_layernorm's output
        else:
            self.post_attention_layernorm = layer_norm(cfg)
        self.mlp = LlamaMLP(cfg) if options.gated_mlp else PlainMLP(cfg)

    def mlp_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's input norm: its own, or the attention's where one norm feeds both."""
        if hasattr(self, "post_attention_layernorm"):
            return self.post_attention_layernorm(x)
        return self.input_layernorm(x)

    def forward(self, x, positions, cos, sin, cache):
        attn = self.self_attn(self.input_layernorm(x), positions, cos, sin, cache)  # B, T, C
        if self.parallel_residual:  # both branches read the block's input x
            return x + attn + self.mlp(self.mlp_norm(x))
        x = x + attn
        return x + self.mlp(self.mlp_norm(x))


class BlockModel(LlamaModel):
    layer_class = BlockDecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = layer_norm(cfg)


class BlockForCausalLM(LlamaForCausalLM):
    """The LM head, with Phi's bias and Cohere's logit scale where the family has them."""

    model_class = BlockModel

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        if cfg.family_options.lm_head_bias:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=True)
            self.tie_weights()

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        scale = self.config.family_options.logit_scale
        logits = self.lm_head(h)  # ..., V
        return logits if scale == 1.0 else logits * scale


# ----------------------------------------------------------------------------- checkpoints
def rename_keys(tensors: dict[str, torch.Tensor], pairs: tuple[tuple[str, str], ...],
                dropped: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Each key with every `old` substring of `pairs` replaced by its `new`, in order; keys ending
    in one of `dropped` (buffers that are not weights) left out."""
    out = {}
    for key, t in tensors.items():
        if key.endswith(dropped):
            continue
        for old, new in pairs:
            key = key.replace(old, new)
        out[key] = t
    return out
