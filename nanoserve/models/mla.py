"""Multi-head latent attention (MLA; DeepSeek-V2 2024, kept in V3): attention whose KV cache holds
one compressed latent per token instead of a key and a value per head.

Per token x, as HF's `DeepseekV2Attention` / `DeepseekV3Attention` compute it (H heads; r =
kv_lora_rank, d_nope = qk_nope_head_dim, d_rope = qk_rope_head_dim, d_v = v_head_dim):

    q           = q_b_proj(q_a_layernorm(q_a_proj(x)))   (or q_proj(x) without q_lora_rank)
    q_nope, q_pe = split(q per head, [d_nope, d_rope])    # H, d_nope; H, d_rope
    c_kv, k_pe  = split(kv_a_proj_with_mqa(x), [r, d_rope])
    c_kv        = kv_a_layernorm(c_kv)                    # r: the latent, shared by every head
    q_pe, k_pe  = RoPE(q_pe), RoPE(k_pe)                  # k_pe: one RoPE key shared by every head
    k_nope[h], v[h] = split(kv_b_proj(c_kv) per head, [d_nope, d_v])   # W_UK[h] c, W_UV[h] c

Head h's key is [k_nope[h] ; k_pe] and its value v[h]; scores × softmax_scale, which is
1/√(d_nope + d_rope), times mscale² where the config's YaRN scaling gives `mscale_all_dim`
(`deepseek_softmax_scale`). RoPE touches only the d_rope parts: that is the *decoupled* RoPE key.
A rotation inside the latent part would depend on the key's position, and then W_UK could not be
moved onto the query (below).

**Two forms, one result** (a test checks they agree):

- *expanded* (`MLAttention.expanded`, HF's form, the reference): kv_b_proj turns every latent into
  H keys and values, then ordinary multi-head attention.
- *absorbed* (`MLAttention.absorbed`, DeepSeek-V2 §2.1.2): q_nope · (W_UK[h] c) = (W_UK[h]ᵀ q_nope)
  · c, so W_UK is folded into the query once (q_lat [H, r]) instead of into every cached key, and
  Σ_j p_j W_UV[h] c_j = W_UV[h] Σ_j p_j c_j, so W_UV is applied once to the attention's output.
  Attention then runs over the cache as it is stored: multi-query attention with H query heads
  of width r + d_rope, [q_lat ; q_pe], over one shared "head" [c_kv ; k_pe], whose values are
  c_kv, the key's first r values. It returns o_lat [H, r]; W_UV[h] o_lat[h] is head h's output.

Without a cache the model computes the expanded form; with one, the absorbed form, so every key
it attends to (this step's, an earlier chunk's, a prefix-cache hit's) is read from the latent
cache in one way. (Servers expand for long prefills, where the FLOPs of H·r-wide scores dominate,
and absorb for decode, where reading the cache dominates; nanoserve keeps one path.)

**The KV cache layout** (`MLAConfig.kv_layout`: kv/cache.py's PagedKVCache builds it). Per layer
one pool, K, of shape [num_blocks, block_size, 1, r + d_rope], and no V pool:

    K[block, offset, 0, :r]          c_kv  (after kv_a_layernorm)
    K[block, offset, 0, r:]          k_pe  (rotated, in the half-split order, see below)
    V = K[..., :r]                   a view of the same memory: the latent is stored once

Token t of a sequence sits in block `block_tables[b, t // block_size]` at offset
`t % block_size` (slot = block · block_size + offset), as for every other model. The whole cache
is PagedKVCache.k [n_layers, num_blocks, block_size, 1, r + d_rope]; `PagedKVCache.layer(i)` gives
(K, V-view). Bytes per token: n_layers · (r + d_rope) · itemsize (kv_bytes_per_token), against
n_layers · H · (d_nope + d_rope + d_v) · itemsize had the expanded keys and values been cached
(DeepSeek-V3: 576 values a layer instead of 40,960).

**RoPE layout.** DeepSeek's checkpoints rotate neighbouring pairs (x₀, x₁), (x₂, x₃), ... (V2's
complex multiply; V3's `rope_interleave`, its default). nanoserve gathers each rope part into
[even dims ; odd dims] first and then rotates halves (layers.apply_rope): the same pairs turned by
the same angles, so every q_pe · k_pe is unchanged (V3's HF code returns this very order). The
cache therefore holds k_pe already rotated, in the half-split order, and a kernel reading it needs
no RoPE of its own: a score is scale · ([q_lat ; q_pe] · K[slot]) with q_pe rotated the same way.
(V3 with rope_interleave=False rotates halves of the checkpoint's order directly.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, NanoserveError
from .config import KVLayout, ModelConfig
from .layers import RMSNorm, apply_rope, attention

# HF builds q_a_layernorm and kv_a_layernorm without the config's rms_norm_eps: its RMSNorm default
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAConfig:
    """The widths of multi-head latent attention (HF's names), validated."""

    kv_lora_rank: int  # r: the latent's width, what the cache stores per token besides k_pe
    qk_nope_head_dim: int  # d_nope: the part of each head's q and k without RoPE
    qk_rope_head_dim: int  # d_rope: the rotated part (one shared key, k_pe)
    v_head_dim: int  # d_v: each head's value
    q_lora_rank: int | None = None  # q through a low-rank bottleneck of this width; None: q_proj
    rope_interleave: bool = True  # RoPE over neighbouring pairs (DeepSeek's checkpoints)
    attention_bias: bool = False  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"MLA config field {name}={value!r} must be a positive integer")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"MLA config field qk_rope_head_dim={self.qk_rope_head_dim} must be "
                              "even (RoPE turns pairs of values)")
        rank = self.q_lora_rank
        if rank is not None and (not isinstance(rank, int) or rank <= 0):
            raise ConfigError(f"MLA config field q_lora_rank={rank!r} must be a positive integer "
                              "or None (q_proj without a bottleneck)")

    @property
    def qk_head_dim(self) -> int:
        """Each expanded head's q and k width, d_nope + d_rope (the softmax scale's 1/√ of it)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_layout(self) -> KVLayout:
        """What the cache holds per token and layer: one "head" [c_kv ; k_pe] of r + d_rope values
        in K, and V read as its first r values (no V pool)."""
        width = self.kv_lora_rank + self.qk_rope_head_dim
        return KVLayout(n_kv_heads=1, head_dim=width, v_in_k=self.kv_lora_rank)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 · mscale · ln(factor) + 1 (1 when the context is not stretched)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def deepseek_softmax_scale(mla: MLAConfig, rope_scaling: dict[str, Any] | None) -> float:
    """1/√(d_nope + d_rope), times mscale(factor, mscale_all_dim)² when the RoPE is scaled and the
    config names mscale_all_dim (DeepSeek's YaRN: the sharper softmax a stretched context needs,
    put on the scores here rather than on cos and sin, whose own attention factor is the ratio
    mscale / mscale_all_dim: hf_config._yarn)."""
    scale = mla.qk_head_dim ** -0.5
    scaling = rope_scaling or {}
    all_dim = scaling.get("mscale_all_dim") or 0
    if scaling.get("rope_type", "default") != "default" and all_dim:
        scale *= yarn_mscale(float(scaling["factor"]), float(all_dim)) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [even dims ; odd dims]: neighbouring pairs become half-split pairs (i, i + d/2),
    the pairing layers.apply_rope rotates."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention for `LlamaDecoderLayer.attention_class`; its widths are
    `cfg.family_options.mla` (an MLAConfig), its softmax scale `cfg.attn_scale`. Module names are
    HF's, so a DeepSeek checkpoint loads by name."""

    # the absorbed form even without a cache (tests compare it with the expanded one)
    absorb_without_cache = False

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        mla: MLAConfig = cfg.family_options.mla
        self.mla, self.layer_idx, self.n_heads = mla, layer_idx, cfg.n_heads
        d, H, r = cfg.hidden_size, cfg.n_heads, mla.kv_lora_rank
        bias = mla.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, H * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, r + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(r, LATENT_NORM_EPS)
        # per head: d_nope rows of W_UK, then d_v rows of W_UV
        self.kv_b_proj = nn.Linear(r, H * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * mla.v_head_dim, d, bias=bias)
        self.window = None  # (LlamaDecoderLayer reads it: DeepSeek never slides)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else mla.qk_head_dim ** -0.5

    def forward(self, x, positions, cos, sin, cache):
        B, T, _ = x.shape
        q_nope, q_pe, c_kv, k_pe = self.project(x, cos, sin)
        if cache is None and not self.absorb_without_cache:
            y = self.expanded(q_nope, q_pe, c_kv, k_pe)  # B, T, H, d_v
        else:
            y = self.absorbed(q_nope, q_pe, c_kv, k_pe, positions, cache)  # B, T, H, d_v
        return self.o_proj(y.reshape(B, T, -1))

    def project(self, x, cos, sin):
        """x [B, T, C] -> q_nope [B, T, H, d_nope], q_pe [B, T, H, d_rope] (rotated), c_kv
        [B, T, r] (normalised), k_pe [B, T, 1, d_rope] (rotated)."""
        B, T, _ = x.shape
        mla = self.mla
        if mla.q_lora_rank is None:
            q = self.q_proj(x)  # B, T, H·(d_nope + d_rope)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, self.n_heads, mla.qk_head_dim)  # B, T, H, d_nope + d_rope
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim],
                                                      dim=-1)  # B, T, r; B, T, d_rope
        c_kv = self.kv_a_layernorm(c_kv)
        k_pe = k_pe.view(B, T, 1, mla.qk_rope_head_dim)  # one key for every head
        return q_nope, self.rope(q_pe, cos, sin), c_kv, self.rope(k_pe, cos, sin)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on a rope part [B, T, h, d_rope], pairs as the checkpoint lays them out (module
        docstring: the result is in the half-split order)."""
        if self.mla.rope_interleave:
            x = deinterleave(x)
        return apply_rope(x, cos, sin)

    def kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight split per head: W_UK [H, d_nope, r] and W_UV [H, d_v, r]. The
        absorbed form reads the weight itself, so kv_b_proj must be a plain linear: an unmerged
        LoRA adapter or a quantized layer there would be skipped without a word, and is refused."""
        if not isinstance(self.kv_b_proj, nn.Linear):
            raise NanoserveError(f"layer {self.layer_idx}'s kv_b_proj is a "
                                 f"{type(self.kv_b_proj).__name__}: MLA's absorbed form folds "
                                 "kv_b_proj's weight into the query and the output, and needs a "
                                 "plain nn.Linear there (merge a LoRA adapter into it: "
                                 "lora_merge=True)")
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.n_heads, mla.qk_nope_head_dim + mla.v_head_dim,
                                       mla.kv_lora_rank)  # H, d_nope + d_v, r
        return w.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)

    def expanded(self, q_nope, q_pe, c_kv, k_pe):
        """HF's form: every latent expanded to H keys and values, then causal multi-head attention
        among the T tokens. Returns [B, T, H, d_v]."""
        B, T, H, _ = q_nope.shape
        mla = self.mla
        kv = self.kv_b_proj(c_kv).view(B, T, H, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)  # B, T, H, d_*
        k = torch.cat((k_nope, k_pe.expand(B, T, H, mla.qk_rope_head_dim)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)  # B, T, H, d_nope + d_rope
        return attention(q, k, v, scale=self.scale)  # B, T, H, d_v

    def latent_key(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """What the cache stores for each token: [c_kv ; k_pe], one head [B, T, 1, r + d_rope]."""
        return torch.cat((c_kv[:, :, None], k_pe), dim=-1)

    def absorbed(self, q_nope, q_pe, c_kv, k_pe, positions, cache):
        """W_UK folded into the query, attention over the latent (MQA: one shared head whose values
        are its first r entries), W_UV applied to the result. Returns [B, T, H, d_v]."""
        w_uk, w_uv = self.kv_b_weights()  # H, d_nope, r; H, d_v, r
        q_lat = torch.einsum("bthn,hnr->bthr", q_nope, w_uk)  # B, T, H, r
        q = torch.cat((q_lat, q_pe), dim=-1)  # B, T, H, r + d_rope
        k = self.latent_key(c_kv, k_pe)  # B, T, 1, r + d_rope
        v = k[..., :self.mla.kv_lora_rank]  # B, T, 1, r: the latent, as the cache reads it
        if cache is None:
            o_lat = attention(q, k, v, scale=self.scale)  # B, T, H, r
        else:
            o_lat = cache.attention(self.layer_idx, q, k, v, positions, scale=self.scale)
        return torch.einsum("bthr,hvr->bthv", o_lat, w_uv)  # B, T, H, d_v
