"""gpt-oss (OpenAI's open-weight models, gpt-oss-20b and -120b): a Llama-shaped attention with
learned attention sinks, alternating sliding and full layers, YaRN RoPE, and a mixture of experts
with biases and a clamped SwiGLU.

What differs from the Llama blocks (llama.py), as transformers' GptOss code computes it:

- **Attention sinks** (`self_attn.sinks`, one logit per query head). Each head's softmax runs over
  its scores and that logit; the sink's probability is dropped, so the weights on the real keys sum
  to less than 1 and a head can attend to nothing (layers.reference_attention). Every attention
  backend takes them as `sinks=` (the torch one, the C decode kernel, the Triton kernels).
- **Windows**: `layer_types` marks each layer "sliding_attention" (a query sees its
  `sliding_window` newest keys) or "full_attention"; by default they alternate, sliding first.
- **q, k, v and o biases** (`attention_bias`, on by default), RoPE with YaRN scaling (`truncate`:
  false in the released configs, so the ramp's ends are not rounded: config.yarn_rope_inv_freq).
- **The experts** (`mlp.router`, `mlp.experts`). The router is a linear layer with a bias; each
  token takes the k experts of highest logit, weighted by a softmax over those k logits alone (the
  same as renormalising the full softmax's top k). Expert e computes, with its weights stored as
  transformers stores them (x · W, not W · x):

      h = x · gate_up_proj[e] + gate_up_proj_bias[e]           # N, 2I: gate and up interleaved,
      gate, up = h[:, 0::2], h[:, 1::2]                        #   columns 2i and 2i + 1
      gate = min(gate, limit);  up = clamp(up, −limit, limit)  # swiglu_limit (7.0)
      y = ((up + 1) · gate · σ(alpha · gate)) · down_proj[e] + down_proj_bias[e]   # alpha 1.702

  The clamp bounds what one expert can add to the residual stream; the "+ 1" and alpha are how
  OpenAI trained it. `hidden_act` is never read.

The module layout is gpt-oss's own (the experts' weights stacked per layer, a `router`), so
`ModelConfig.arch` is "gpt_oss": quantization and tensor parallelism, which walk Llama's module
names, refuse it by name; the checkpoint's names are the model's (no renaming). MXFP4 checkpoints
(the released ones: `quantization_config.quant_method` "mxfp4", experts stored as
`gate_up_proj_blocks` / `_scales`) are refused by name; the bf16 ones load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ..config import LAYER_TYPES, ModelConfig
from ..family import Family
from ..hf_config import llama_config_from_hf
from ..hf_fields import LLAMA_FIELDS, implemented, inert, refused
from ..layers import apply_rope, attention
from ..llama import LlamaForCausalLM, LlamaModel, rms_norm


@dataclass(frozen=True)
class GptOssOptions:
    """The experts' clamped SwiGLU: σ's gain `swiglu_alpha` and the clamp `swiglu_limit`."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"gpt_oss config field {name}={value!r} must be a number")
            if not 0 < value < math.inf:
                raise ConfigError(f"gpt_oss config field {name}={value!r} must be a positive "
                                  "finite number")


# ----------------------------------------------------------------------------- the config
def _refuse_quantized(cfg: dict[str, Any]) -> None:
    qcfg = cfg.get("quantization_config")
    if qcfg is None:
        return
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else qcfg
    raise ConfigError(f"gpt_oss config field quantization_config.quant_method={method!r} is not "
                      "supported (the released checkpoints store the experts in MXFP4 blocks and "
                      "scales, gate_up_proj_blocks / gate_up_proj_scales, which nanoserve does not "
                      "read); supported: an unquantized checkpoint (no quantization_config), such "
                      "as a bf16 one")


def _check_rope(cfg: dict[str, Any]) -> None:
    """gpt-oss rotates whole heads: its rotary code splits each head in two halves, so a partial
    rotary factor would not even run there."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1.0):
        raise ConfigError(f"gpt_oss config field rope_parameters.partial_rotary_factor={factor!r} "
                          "is not supported (gpt-oss rotates whole heads); supported: 1.0")


def _layer_types(cfg: dict[str, Any], n_layers: int) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as GptOssConfig fills them: without layer_types, layers
    alternate sliding (even indices) and full (odd)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                 for i in range(n_layers)]
    types = list(types)
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad or len(types) != n_layers:
        raise ConfigError(f"gpt_oss config field layer_types={types!r} must list one of "
                          f"{', '.join(LAYER_TYPES)} per layer ({n_layers} layers)")
    if window is None and "sliding_attention" in types:
        raise ConfigError("gpt_oss config field sliding_window=None with sliding_attention layers "
                          "in layer_types is not supported (no window to slide); supported: a "
                          "window of ≥ 1 keys, or only full_attention layers")
    if "sliding_attention" not in types:
        return None, None
    return int(window), types


def gpt_oss_config(cfg: dict[str, Any]) -> ModelConfig:
    """The HF dictionary (GptOssConfig's defaults filled in) -> ModelConfig: read as a Llama's
    (sizes, RoPE and YaRN, biases), then the windows, the experts and the SwiGLU's constants."""
    _refuse_quantized(cfg)
    _check_rope(cfg)
    n_layers = int(cfg["num_hidden_layers"])
    window, types = _layer_types(cfg, n_layers)
    # transformers maps num_experts onto num_local_experts; the latter may be our default
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    options = GptOssOptions(swiglu_alpha=cfg["swiglu_alpha"], swiglu_limit=cfg["swiglu_limit"])
    # hidden_act is never read by gpt-oss's experts: read as silu, whatever it says
    base = llama_config_from_hf({**cfg, "hidden_act": "silu", "mlp_bias": False}, "llama")
    return replace(base, arch="gpt_oss", hf_model_type="gpt_oss", sliding_window=window,
                   layer_types=types, num_experts=int(experts),
                   num_experts_per_tok=int(cfg["num_experts_per_tok"]), norm_topk_prob=True,
                   family_options=options)


# ----------------------------------------------------------------------------- the model
class GptOssAttention(nn.Module):
    """Llama's attention (q, k, v, o projections, RoPE, GQA, the layer's window) with one learned
    sink logit per query head joining every softmax."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        d, q_dim = cfg.hidden_size, cfg.n_heads * cfg.head_dim
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, q_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_dim, d, bias=cfg.o_bias)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads))  # H
        self.window = cfg.layer_window(layer_idx)  # None: the whole context

    def forward(self, x, positions, cos, sin, cache):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # B, T, H, D
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # B, T, Hkv, D
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        how = dict(window=self.window, sinks=self.sinks)
        if cache is None:  # the T tokens attend causally among themselves
            y = attention(q, k, v, **how)  # B, T, H, D
        else:  # the cache stores k, v and attends over what it holds (its backend's way)
            y = cache.attention(self.layer_idx, q, k, v, positions, **how)  # B, T, H, D
        return self.o_proj(y.reshape(B, T, -1))


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation of one expert: gate_up [N, 2I] holds gate in its even columns and
    up in its odd ones; (clamp(up) + 1) · g · σ(alpha · g) with g = min(gate, limit) -> [N, I]."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]  # N, I each
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


class GptOssExperts(nn.Module):
    """E experts' weights stacked as transformers stores them (inputs first: x · W)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, C, inter = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, C, 2 * inter))  # E, C, 2I (interleaved)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * inter))  # E, 2I
        self.down_proj = nn.Parameter(torch.zeros(E, inter, C))  # E, I, C
        self.down_proj_bias = nn.Parameter(torch.zeros(E, C))  # E, C
        self.alpha = cfg.family_options.swiglu_alpha
        self.limit = cfg.family_options.swiglu_limit

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on its tokens x [n, C] -> [n, C]."""
        h = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # n, 2I
        act = clamped_swiglu(h, self.alpha, self.limit)  # n, I
        return act @ self.down_proj[e] + self.down_proj_bias[e]  # n, C


class GptOssMLP(nn.Module):
    """The router (a linear layer with a bias) and the experts: each token's top-k experts by
    logit, weighted by the softmax over those k logits (models/moe.py's sum, grouped by expert)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssExperts(cfg)
        self.top_k = cfg.num_experts_per_tok

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, C] -> (weights [N, k], expert ids [N, k])."""
        logits = self.router(x)  # N, E
        top, experts = logits.topk(self.top_k, dim=-1)  # N, k
        return top.softmax(dim=-1), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # N, C
        weights, experts = self.route(x)  # N, k
        out = torch.zeros_like(x)  # N, C
        for e in experts.unique().tolist():  # only the experts some token chose
            # n_e each: which tokens, which of their k
            tokens, slot = (experts == e).nonzero(as_tuple=True)
            y = self.experts.expert(e, x.index_select(0, tokens))  # n_e, C
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out.view(shape)


class GptOssDecoderLayer(nn.Module):
    """Llama's pre-norm block with gpt-oss's attention and experts: x + attn(norm(x)), then
    x + moe(norm(x))."""

    rope = "global"  # every layer rotates with the one (YaRN-scaled) RoPE

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = rms_norm(cfg)
        self.self_attn = GptOssAttention(cfg, layer_idx)
        self.post_attention_layernorm = rms_norm(cfg)
        self.mlp = GptOssMLP(cfg)

    def forward(self, x, positions, cos, sin, cache):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssModel(LlamaModel):
    layer_class = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel


# ----------------------------------------------------------------------------- the field table
_UNREAD = "transformers' GptOss code never reads it"

GPT_OSS_FIELDS = {
    **LLAMA_FIELDS,
    "attention_bias": implemented("biases on q, k, v and o projections"),
    "hidden_act": inert("gpt-oss's experts always apply their clamped SwiGLU; " + _UNREAD),
    "mlp_bias": inert("the experts always have biases; " + _UNREAD),
    "head_dim": implemented("per-head width; 64 when absent, hidden_size / num_attention_heads "
                            "when null"),
    "rope_parameters": implemented("RoPE base and scaling (YaRN in every release, with its "
                                   "truncate flag); partial_rotary_factor refused"),
    "sliding_window": implemented("the window of the sliding layers: a query at p sees keys "
                                  "p − w + 1 .. p"),
    "layer_types": implemented("per layer 'sliding_attention' or 'full_attention'; without it they "
                               "alternate, sliding first"),
    "num_local_experts": implemented("experts per layer"),
    "num_experts": implemented("transformers' alias of num_local_experts"),
    "num_experts_per_tok": implemented("k: the experts each token runs, weighted by a softmax over "
                                       "their k router logits"),
    "swiglu_alpha": implemented("the experts' σ gain: gate · σ(alpha · gate)"),
    "swiglu_limit": implemented("the experts' clamp: gate ≤ limit, −limit ≤ up ≤ limit"),
    "output_router_logits": inert("what HF's forward returns besides the logits"),
    "router_aux_loss_coef": inert("the load-balancing loss, a training term"),
    "quantization_config": refused("MXFP4 experts (gate_up_proj_blocks / _scales) are not read; "
                                   "any quantization_config is refused by name"),
    # in the released config.json files, not GptOssConfig fields
    "experts_per_token": inert("the original release's name; transformers reads "
                               "num_experts_per_tok"),
    "initial_context_length": inert("the original release's name; transformers reads "
                                    "rope_parameters' original_max_position_embeddings"),
}

# GptOssConfig's defaults for keys a config.json may leave out (rope_theta: its default_theta)
DEFAULTS = dict(
    num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
    sliding_window=128, tie_word_embeddings=False, max_position_embeddings=131072,
    rms_norm_eps=1e-5, num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0,
    attention_bias=True, rope_theta=150000.0,
    rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                         truncate=False, original_max_position_embeddings=4096),
)

FAMILY = Family(
    model_type="gpt_oss",
    architectures=("GptOssForCausalLM",),
    hf_config_class="GptOssConfig",
    fields=GPT_OSS_FIELDS,
    config=gpt_oss_config,
    model_class=GptOssForCausalLM,
    defaults=DEFAULTS,
    name="gpt-oss",
    summary="attention sinks, alternating sliding / full layers, YaRN, experts with biases and a "
            "clamped SwiGLU (bf16 checkpoints; MXFP4 refused)",
)
