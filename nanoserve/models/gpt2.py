"""GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm blocks, GELU MLP, tied head.

Module names follow the HF checkpoints (`transformer.h.0.attn.c_attn`, ...) so weights load
by name. OpenAI's checkpoints store these projections as Conv1D with weight [in, out]; we use
plain nn.Linear ([out, in]) and the loader transposes them. Taught in notebooks/01_*.
"""

from __future__ import annotations

import math

from torch import nn

from .base import CausalLM
from .config import ModelConfig
from .layers import ACTIVATION_FNS, attention


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # fused q, k, v
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        # Every attention backend (SDPA, the cache's torch and Triton paths) multiplies scores by
        # 1/√D. GPT-2 configs may want no scaling or an extra 1/(layer + 1); (s·q)·k/√D =
        # (q·k)·s/√D, so scaling q by s gives any such factor without touching the backends.
        self.q_scale = 1.0 if cfg.scale_attn_weights else math.sqrt(self.head_dim)
        if cfg.scale_attn_by_inverse_layer_idx:
            self.q_scale /= layer_idx + 1

    def forward(self, x, positions, cache):
        B, T, C = x.shape
        # each B, T, H, D
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_heads, self.head_dim).unbind(2)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if cache is None:  # the T tokens attend causally among themselves
            y = attention(q, k, v)  # B, T, H, D
        else:
            # the cache stores k, v and attends over everything cached (its backend: torch or
            # Triton)
            y = cache.attention(self.layer_idx, q, k, v, positions)  # B, T, H, D
        # (-1: H·D, which tensor parallelism makes a share of C)
        return self.c_proj(y.reshape(B, T, -1))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        # GPT-2's own: "gelu_new", GELU's tanh approximation
        self.act = ACTIVATION_FNS[cfg.hidden_act]
        self.hidden_act = cfg.hidden_act

    def forward(self, x):
        if fuses_activation(self.c_fc, self.hidden_act):  # the linear and GELU in one call
            return self.c_proj(self.c_fc.forward_gelu(x, self.hidden_act))
        return self.c_proj(self.act(self.c_fc(x)))


def fuses_activation(linear: nn.Module, hidden_act: str) -> bool:
    """Whether `linear` computes its output and the activation in one call: on a CPU the
    extension that runs linears in oneDNN (models/onednn.py) swaps in such layers."""
    fuses = getattr(linear, "fuses_gelu", None)
    return fuses is not None and fuses(hidden_act)


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x, positions, cache):
        x = x + self.attn(self.ln_1(x), positions, cache)
        return x + self.mlp(self.ln_2(x))


class GPT2Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def embed(self, input_ids, positions):
        return self.wte(input_ids) + self.wpe(positions)  # B, T, C

    def blocks(self, x, positions, cache):
        """The blocks this module holds (all of them; a pipeline stage's share:
        parallel/pipeline.py)."""
        for block in self.h:
            x = block(x, positions, cache)
        return x

    def forward(self, input_ids, positions, cache):
        return self.ln_f(self.blocks(self.embed(input_ids, positions), positions, cache))


class GPT2LMHeadModel(CausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.transformer = GPT2Transformer(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        """Share the token embedding with the LM head when the config says so (again after
        .to_empty())."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def embed_and_blocks(self, input_ids, positions, cache):
        return self.transformer(input_ids, positions, cache)
