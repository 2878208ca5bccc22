"""Building blocks shared by the GPT-2 and Llama models: activations, norms, RoPE and attention.

Attention comes twice: `naive_attention` spells out softmax(QKᵀ/√d + mask)·V for reading,
`attention` calls torch's fused `scaled_dot_product_attention` for speed; a test checks they agree.
Both take queries at explicit absolute positions, so one function serves the prompt (prefill, many
queries) and each generated token (decode, one query over the cache). Taught in notebooks/01_*.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, llama3_rope_inv_freq, yarn_rope_inv_freq


# ----------------------------------------------------------------------------- activations
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), GPT-2's "gelu_new"."""
    return F.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x·σ(1.702·x), a cheaper GELU approximation (CLIP's)."""
    return x * torch.sigmoid(1.702 * x)


# transformers' ACT2FN names (hf_fields.ACTIVATIONS) -> the function. Several names are one
# function: HF keeps separate spellings for separate implementations of the same math.
ACTIVATION_FNS = {
    "gelu": F.gelu, "gelu_python": F.gelu,  # exact: x·Φ(x), Φ the normal CDF (by erf)
    "gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh, "gelu_python_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "silu": F.silu, "swish": F.silu,  # x·σ(x)
}


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) * w   (Zhang & Sennrich 2019), computed in float32.

    unit_offset (Gemma): y = x / sqrt(mean(x²) + eps) * (1 + w), so w = 0 is the identity scale.
    With it or scale_fp32 (OLMo 2), the product is taken in float32 before rounding to x's dtype;
    Llama rounds first, then scales (the same in float32; in bf16 about a quarter of the values
    differ by an ulp)."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False,
                 scale_fp32: bool = False):
        super().__init__()
        self.eps, self.unit_offset, self.scale_fp32 = eps, unit_offset, scale_fp32 or unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_fp32:
            return (x * (float(self.unit_offset) + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


# ----------------------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """θ_i = base^(-2i/d) for i < d/2 (Su et al. 2021), with the config's scaling applied. d is the
    rotated part of a head (cfg.rotary_dim: all of it but in Phi-4-mini's partial RoPE)."""
    d = cfg.rotary_dim
    # Built on the CPU explicitly, so a model constructed on the "meta" device still gets real
    # values.
    exps = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d
    inv_freq = 1.0 / (cfg.rope_theta ** exps)  # D/2
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = llama3_rope_inv_freq(inv_freq, scaling)
    elif kind == "longrope":
        # Phi-3: a factor per frequency (the short ones: the context stays in the original)
        inv_freq = inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32,
                                           device="cpu")
    elif kind == "yarn":
        inv_freq = yarn_rope_inv_freq(cfg.rope_theta, d, scaling)
    # "dynamic" (NTK) changes the base only past max_position_embeddings, which nanoserve never
    # reaches
    return inv_freq


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: LongRoPE's and YaRN's attention factor (read with the
    config); else 1."""
    return (cfg.rope_scaling or {}).get("attention_factor", 1.0)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin of position·θ for each position; [B, T] positions -> two [B, T, 1, D] tensors."""
    freqs = positions[..., None].float() * inv_freq  # B, T, D/2
    emb = torch.cat((freqs, freqs), dim=-1)  # B, T, D  (HF's half-split layout)
    return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x_i, x_{i+D/2}) pair by position·θ_i.  x: [B, T, H, D].

    Pairs are (i, i + D/2), the layout of HF checkpoints. llama2.c pairs neighbours
    (2i, 2i+1) instead; its loader permutes the q/k weight rows so this one function serves both.
    With cos, sin narrower than x (partial RoPE) only x's first cos.shape[-1] dims rotate.
    """
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
    return x * cos + rotate_half(x) * sin


# ----------------------------------------------------------------------------- attention
def causal_mask(q_positions: torch.Tensor, kv_len: int, window: int | None = None) -> torch.Tensor:
    """Boolean mask [B, 1, T, S]: query at absolute position p sees keys at positions 0..p, or with
    a sliding window w only the w newest of them, p − w + 1 .. p (Mistral; HF's `kv_idx > q_idx −
    w`)."""
    k_positions = torch.arange(kv_len, device=q_positions.device)[None, None, :]  # 1, 1, S
    p = q_positions[:, :, None]  # B, T, 1
    visible = k_positions <= p
    if window is not None:
        visible = visible & (k_positions > p - window)
    return visible[:, None]  # B, 1, T, S


def naive_attention(q, k, v, q_positions=None, window: int | None = None):
    """softmax(q·kᵀ/√d + causal mask)·v, written out.  q [B,T,H,D]; k, v [B,S,Hkv,D] -> [B,T,H,D].

    Key j sits at position j. `q_positions` [B, T] are the queries' absolute positions; None
    means the queries are the keys themselves (positions 0..T-1, no cache). `window`: each query
    sees only its `window` newest keys, itself included (None: all of them). What notebook 01
    builds: `reference_attention` with its defaults.
    """
    return reference_attention(q, k, v, q_positions, window)


def reference_attention(q, k, v, q_positions=None, window: int | None = None,
                        scale: float | None = None,
                        softcap: float | None = None, mask: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None):
    """`naive_attention` with every option the model families use, written out in float32:
    `scale` multiplies the scores instead of 1/√D; `softcap` c maps them to c·tanh(scores / c)
    before the mask (Gemma 2: no score can take all the weight); `mask` [B, T, S] (bool, True:
    visible) replaces the causal mask (a token tree's queries see their ancestors only:
    spec/tree_sampler.py).

    `sinks` [H] (gpt-oss's learned attention sinks, HF's `self_attn.sinks`): head h's softmax runs
    over its visible scores and one more logit, sinks[h], and that extra column's probability is
    dropped: out = Σ_j p_j v_j with p_j = exp(s_j) / (exp(sinks[h]) + Σ_i exp(s_i)). The weights
    then sum to less than 1, so a head can put its attention "nowhere" (Xiao et al. 2023 found
    models learning to park it on the first token; gpt-oss learns the sink instead)."""
    B, T, H, D = q.shape
    if q_positions is None:
        q_positions = torch.arange(T, device=q.device).expand(B, T)
    group = H // k.shape[2]  # query heads per kv head (GQA; 1 = multi-head attention)
    k = k.repeat_interleave(group, dim=2)  # B, S, H, D
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float())  # B, H, T, S
    if scale is None:
        scores = scores / math.sqrt(D)
    else:
        scores = scores * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        visible = causal_mask(q_positions, k.shape[1], window)  # B, 1, T, S
    else:
        visible = mask[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        probs = softmax_with_sink(scores, sinks)
    return torch.einsum("bhts,bshd->bthd", probs, v.float()).to(q.dtype)  # B, T, H, D


def softmax_with_sink(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The softmax over each row of scores [B, H, T, S] and its head's sink logit sinks[h], the
    sink's column dropped: [B, H, T, S], rows summing to less than 1 (`reference_attention`)."""
    B, H, T, _ = scores.shape
    sink = sinks.float().view(1, H, 1, 1).expand(B, H, T, 1)  # B, H, T, 1
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)  # B, H, T, S + 1
    return probs[..., :-1]


def attention(q, k, v, q_positions=None, window: int | None = None, scale: float | None = None,
              softcap: float | None = None, mask: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None):
    """`reference_attention` through torch's fused SDPA kernel. SDPA can neither soft-cap the
    scores nor add a sink logit to the softmax: with `softcap` or `sinks` this is
    `reference_attention` itself."""
    if softcap is not None or sinks is not None:
        return reference_attention(q, k, v, q_positions, window, scale, softcap, mask, sinks)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # B, H, T, D
    gqa = q.shape[1] != k.shape[1]
    if q_positions is None and window is None and mask is None:  # no cache: plain causal attention
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        if q_positions is None:
            q_positions = torch.arange(q.shape[2], device=q.device).expand(q.shape[0], -1)  # B, T
        # B, 1, T, S
        visible = causal_mask(q_positions, k.shape[2], window) if mask is None else mask[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale,
                                             enable_gqa=gqa)
    return out.transpose(1, 2)  # B, T, H, D
