"""Llama-class models: Llama 2, Llama 3/3.1/3.2, TinyLlama, SmolLM, Mistral, Qwen2 and Qwen3.

Pre-RMSNorm blocks, rotary position embeddings (RoPE) applied to q and k, grouped-query
attention (n_kv_heads ≤ n_heads: each kv head serves n_heads / n_kv_heads query heads, which
shrinks the KV cache by that factor), a SwiGLU MLP, and a tied or untied LM head. Module names
follow the HF checkpoints so weights load by name. What the other families change is a config
field each (hf_config.py): Qwen2's q/k/v biases; Mistral's and Qwen2/3's sliding window (a layer
attends to its `window` newest keys only: `cfg.layer_window`); Qwen3's RMSNorm over each head of
q and k before RoPE (`qk_norm`), which keeps attention logits from growing. Taught in
notebooks/01_*.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .base import CausalLM
from .config import ModelConfig
from .layers import (
    ACTIVATION_FNS,
    RMSNorm,
    apply_rope,
    attention,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
)
from .moe import SparseMoeBlock, is_moe_layer


class LlamaAttention(nn.Module):
    # how q and k are rotated: HF's (i, i + D/2) pairs; a family's subclass may pair otherwise
    # (models/families/: Ernie 4.5's and GLM-4's adjacent pairs)
    rotate = staticmethod(apply_rope)

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        d = cfg.hidden_size
        q_dim = cfg.n_heads * cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, q_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_dim, d, bias=cfg.o_bias)
        self.window = cfg.layer_window(layer_idx)  # None: the whole context
        # None, None: scores · 1/√D, uncapped
        self.scale, self.softcap = cfg.attn_scale, cfg.attn_softcap
        self.qk_norm = cfg.qk_norm
        # per head: one head_dim weight shared by every head; whole: one weight per q/k channel
        if cfg.qk_norm:
            q_width, k_width = q_dim, kv_dim  # "whole": the whole projections
            if cfg.qk_norm == "per_head":
                q_width = k_width = cfg.head_dim
            self.q_norm = RMSNorm(q_width, cfg.norm_eps, cfg.norm_unit_offset, cfg.norm_scale_fp32)
            self.k_norm = RMSNorm(k_width, cfg.norm_eps, cfg.norm_unit_offset, cfg.norm_scale_fp32)

    def forward(self, x, positions, cos, sin, cache):
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # B, T, H·D; B, T, Hkv·D (twice)
        if self.qk_norm == "whole":  # OLMo 2: normalise the whole projections
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim)  # B, T, H, D
        k = k.view(B, T, self.n_kv_heads, self.head_dim)  # B, T, Hkv, D
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":  # Qwen3, Gemma 3: normalise each head's q and k
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # (None: a layer without RoPE, SmolLM3's NoPE layers)
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        how = dict(window=self.window, scale=self.scale, softcap=self.softcap)
        if cache is None:  # the T tokens attend causally among themselves
            y = attention(q, k, v, **how)  # B, T, H, D
        else:
            # the cache stores k, v and attends over what is cached (its backend: torch or Triton)
            y = cache.attention(self.layer_idx, q, k, v, positions, **how)  # B, T, H, D
        return self.o_proj(y.reshape(B, T, -1))


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)); the config may name another
    activation."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATION_FNS[cfg.hidden_act]  # "silu" in every Llama and Qwen2 release

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def rms_norm(cfg: ModelConfig) -> RMSNorm:
    """A norm over the hidden size, as the config's family makes it."""
    return RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_unit_offset, cfg.norm_scale_fp32)


def rope_kind(cfg: ModelConfig, layer_idx: int, window: int | None) -> str:
    """Which RoPE a layer applies: "global"; "local" for Gemma 3's sliding layers (their own base);
    "none" for SmolLM3's NoPE layers."""
    if layer_idx in (cfg.no_rope_layers or []):
        return "none"
    if cfg.local_rope_theta and window is not None:
        return "local"
    return "global"


def feed_forward(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """The layer's MLP; Mixtral's and Qwen3-MoE's: experts and a router instead (models/moe.py)."""
    if is_moe_layer(cfg, layer_idx):
        return SparseMoeBlock(cfg, ACTIVATION_FNS[cfg.hidden_act])
    return LlamaMLP(cfg)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm (Llama): x + attn(norm(x)), then x + mlp(norm(x))."""

    # a family's own attention (models/families/: DeepSeek's multi-head latent attention)
    attention_class: type[nn.Module] = LlamaAttention

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = rms_norm(cfg)
        self.self_attn = self.attention_class(cfg, layer_idx)
        self.post_attention_layernorm = rms_norm(cfg)
        self.mlp = feed_forward(cfg, layer_idx)
        self.rope = rope_kind(cfg, layer_idx, self.self_attn.window)

    def forward(self, x, positions, cos, sin, cache):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class SandwichDecoderLayer(LlamaDecoderLayer):
    """Sandwich (Gemma 2/3): the attention's and the MLP's outputs are normalised too, before the
    residual add. `post_attention_layernorm` is then the attention's output norm, and the MLP's
    input norm is `pre_feedforward_layernorm` (HF's names)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.pre_feedforward_layernorm = rms_norm(cfg)
        self.post_feedforward_layernorm = rms_norm(cfg)

    def forward(self, x, positions, cos, sin, cache):
        attn_out = self.self_attn(self.input_layernorm(x), positions, cos, sin, cache)
        x = x + self.post_attention_layernorm(attn_out)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PostNormDecoderLayer(LlamaDecoderLayer):
    """Post-norm (OLMo 2): only the outputs are normalised, x + norm(attn(x)), then
    x + norm(mlp(x)); there is no input norm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        del self.input_layernorm
        self.post_feedforward_layernorm = rms_norm(cfg)

    def forward(self, x, positions, cos, sin, cache):
        x = x + self.post_attention_layernorm(self.self_attn(x, positions, cos, sin, cache))
        return x + self.post_feedforward_layernorm(self.mlp(x))


DECODER_LAYERS = {"pre_norm": LlamaDecoderLayer, "sandwich": SandwichDecoderLayer,
                  "post_norm": PostNormDecoderLayer}  # ModelConfig.block -> the layer's class


class LlamaModel(nn.Module):
    # a family's block (models/families/); None: the config's `block` layout
    layer_class: type[nn.Module] | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layer_class = self.layer_class or DECODER_LAYERS[cfg.block]
        self.layers = nn.ModuleList(layer_class(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_unit_offset,
                            cfg.norm_scale_fp32)
        # Gemma: embeddings × √d
        self.embed_scale = cfg.hidden_size ** 0.5 if cfg.embed_scale else None
        # Kept in float32 whatever the model dtype (not buffers, so .to(bf16) cannot round them).
        self.inv_freq = {"global": rope_inv_freq(cfg)}  # D/2 each
        self.attention_factor = rope_attention_factor(cfg)
        if cfg.local_rope_theta:  # Gemma 3's sliding layers: their own base, no scaling
            local = replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None)
            self.inv_freq["local"] = rope_inv_freq(local)

    def embed(self, input_ids, positions):
        x = self.embed_tokens(input_ids)  # B, T, C
        if self.embed_scale is not None:  # the factor rounded to x's dtype first, as HF does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def forward(self, input_ids, positions, cache):
        return self.norm(self.blocks(self.embed(input_ids, positions), positions, cache))

    def blocks(self, x, positions, cache):
        """The layers this module holds (all of them; a pipeline stage's share:
        parallel/pipeline.py)."""
        if self.inv_freq["global"].device != x.device:
            self.inv_freq = {k: f.to(x.device) for k, f in self.inv_freq.items()}
        # once for all layers
        rope = {k: rope_cos_sin(f, positions, x.dtype) for k, f in self.inv_freq.items()}
        # LongRoPE / YaRN scale cos and sin (so every q·k by its square); not
        if self.attention_factor != 1.0:
            cos, sin = rope["global"]  # Gemma 3's local RoPE, which has no scaling of its own
            rope["global"] = (cos * self.attention_factor, sin * self.attention_factor)
        rope["none"] = (None, None)
        for layer in self.layers:
            x = layer(x, positions, *rope[layer.rope], cache)
        return x


class LlamaForCausalLM(CausalLM):
    model_class = LlamaModel  # a family's subclass (models/families/) names its own

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        """Share the token embedding with the LM head when the config says so (again after
        .to_empty())."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_and_blocks(self, input_ids, positions, cache):
        return self.model(input_ids, positions, cache)
