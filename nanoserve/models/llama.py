"""Llama-class models: Llama 2, Llama 3/3.1/3.2, TinyLlama, SmolLM, Mistral, Qwen2 and Qwen3.

Pre-RMSNorm blocks, rotary position embeddings (RoPE) applied to q and k, grouped-query
attention (n_kv_heads ≤ n_heads: each kv head serves n_heads / n_kv_heads query heads, which
shrinks the KV cache by that factor), a SwiGLU MLP, and a tied or untied LM head. Module names
follow the HF checkpoints so weights load by name. What the other families change is a config
field each (hf_config.py): Qwen2's q/k/v biases; Mistral's and Qwen2/3's sliding window (a layer
attends to its `window` newest keys only: `cfg.layer_window`); Qwen3's RMSNorm over each head of
q and k before RoPE (`qk_norm`), which keeps attention logits from growing. Taught in notebooks/01_*.
"""

from __future__ import annotations

from torch import nn

from .base import CausalLM
from .config import ModelConfig
from .layers import ACTIVATION_FNS, RMSNorm, apply_rope, attention, rope_cos_sin, rope_inv_freq


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        d, q_dim, kv_dim = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, q_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_dim, d, bias=cfg.o_bias)
        self.window = cfg.layer_window(layer_idx)  # None: the whole context
        if cfg.qk_norm:  # one RMSNorm weight of head_dim, shared by every head
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x, positions, cos, sin, cache):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # B, T, H, D
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # B, T, Hkv, D
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):  # Qwen3: normalise each head's q and k, then rotate
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:  # the T tokens attend causally among themselves
            y = attention(q, k, v, window=self.window)  # B, T, H, D
        else:  # the cache stores k, v and attends over what is cached (its backend: torch or Triton)
            y = cache.attention(self.layer_idx, q, k, v, positions, window=self.window)  # B, T, H, D
        return self.o_proj(y.reshape(B, T, -1))


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x)); the config may name another activation."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATION_FNS[cfg.hidden_act]  # "silu" in every Llama and Qwen2 release

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, positions, cos, sin, cache):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        # Kept in float32 whatever the model dtype (not a buffer, so .to(bf16) cannot round it).
        self.inv_freq = rope_inv_freq(cfg)  # D/2

    def forward(self, input_ids, positions, cache):
        x = self.embed_tokens(input_ids)  # B, T, C
        if self.inv_freq.device != x.device:
            self.inv_freq = self.inv_freq.to(x.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)  # once for all layers
        for layer in self.layers:
            x = layer(x, positions, cos, sin, cache)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        """Share the token embedding with the LM head when the config says so (again after .to_empty())."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_and_blocks(self, input_ids, positions, cache):
        return self.model(input_ids, positions, cache)
