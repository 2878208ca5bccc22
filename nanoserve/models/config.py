"""Model configuration: one `ModelConfig` for every architecture nanoserve runs.

It is read from a Hugging Face `config.json` (transformers 4.x and 5.x forms: hf_config.py) or
built from a preset. The model code only ever sees this dataclass, never the HF dictionary, so
the quirks of each config format live in hf_config.py and nowhere else. Taught in notebooks/01_*.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ConfigError
from .hf_fields import ACTIVATIONS

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "dynamic")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class KVLayout:
    """What the KV cache holds per token in each layer; kv/cache.py sizes its pools from it.

    K: `n_kv_heads` heads of `head_dim` values. V: a pool of the same shape (`v_in_k` None), or no
    pool at all (`v_in_k` = r): V is then the first r values of each K head, read where K is, so
    nothing is stored twice. Multi-head latent attention stores one "head" of its latent c_kv
    followed by the rotated RoPE key, and attends with V = c_kv (models/mla.py)."""

    n_kv_heads: int
    head_dim: int
    v_in_k: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KVLayout {name}={value!r} must be a positive integer")
        if self.v_in_k is not None and not 0 < self.v_in_k <= self.head_dim:
            raise ConfigError(f"KVLayout v_in_k={self.v_in_k!r} must lie in 1..head_dim="
                              f"{self.head_dim} (or be None: V in a pool of its own)")

    @property
    def values_per_token(self) -> int:
        """Values one token stores in one layer: K's, and V's unless V is read from K."""
        per_pool = self.n_kv_heads * self.head_dim
        return per_pool if self.v_in_k is not None else 2 * per_pool


@dataclass
class ModelConfig:
    # the module layout: "gpt2" | "llama" (the two every extension knows), or a family's own
    # hf_model_type when its modules are laid out otherwise (models/families/: extensions that
    # walk the modules by name refuse it)
    arch: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    # Llama family only
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    head_dim_override: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str | None = None  # the dtype the checkpoint was saved in, if it says
    mlp_bias: bool = False  # Llama only
    # the MLP's activation by transformers' name; None: gelu_new / silu
    hidden_act: str | None = None
    # GPT-2 only: scores × 1/√head_dim (False: unscaled), and in layer i also × 1/(i+1)
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    # Llama family variants (hf_config.py says which family sets which): sliding windows (Mistral,
    # Qwen2/3, Gemma, SmolLM3, Phi-3), q/k norms, NoPE, partial RoPE, experts, block layouts,
    # soft-caps
    sliding_window: int | None = None  # keys a query sees in a sliding layer, its own included
    # per layer, one of LAYER_TYPES; None: every layer slides if windowed
    layer_types: list[str] | None = None
    # RMSNorm of q and k before RoPE: "per_head" (one head_dim weight for every head: Qwen3, Gemma
    # 3) or "whole" (over the whole q and k projections, before they split into heads: OLMo 2);
    # None: no norm
    qk_norm: str | None = None
    # layers that apply no RoPE at all (SmolLM3's "NoPE" layers)
    no_rope_layers: list[int] | None = None
    # RoPE rotates the first head_dim · this dims of each head (Phi-4-mini)
    partial_rotary_factor: float = 1.0
    # mixture of experts (Mixtral, Qwen3-MoE: moe.py); num_experts 0: a dense MLP in every layer
    num_experts: int = 0
    num_experts_per_tok: int = 0  # k: experts each token runs
    moe_intermediate_size: int | None = None  # each expert's width; None: intermediate_size
    norm_topk_prob: bool = True  # renormalise the k router probabilities to sum to 1
    # experts in layers i with (i + 1) % moe_every == 0 (Qwen3-MoE's decoder_sparse_step)
    moe_every: int = 1
    mlp_only_layers: list[int] | None = None  # layers that keep a dense MLP (Qwen3-MoE)
    # "pre_norm": x + f(norm(x)) (Llama); "sandwich": x + norm(f(norm(x))) (Gemma); "post_norm": x +
    # norm(f(x)) (OLMo 2); f is the attention, then the MLP
    block: str = "pre_norm"
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + w), not w (Gemma)
    # RMSNorm multiplies by w in float32, then rounds (OLMo 2); Llama rounds first
    norm_scale_fp32: bool = False
    embed_scale: bool = False  # token embeddings × √hidden_size (Gemma)
    # scores × attn_scale (Gemma: query_pre_attn_scalar^−½); None: 1/√head_dim
    attn_scale: float | None = None
    attn_softcap: float | None = None  # scores -> c·tanh(scores / c) before the softmax (Gemma 2)
    final_softcap: float | None = None  # logits -> c·tanh(logits / c) (Gemma 2)
    # the RoPE base of sliding layers, without scaling (Gemma 3)
    local_rope_theta: float | None = None
    # the HF model type the config was read from (save_checkpoint writes it back); None: built in
    # code
    hf_model_type: str | None = None
    # what a family of its own module adds (models/families/): its own small validated dataclass,
    # read only by its model class; None for the families above
    family_options: Any = None
    # text prompts start with the tokenizer's BOS (as the family's HF tokenizer adds it); None: the
    # Llama layout's do, GPT-2's and the other layouts' do not
    bos_in_prompts: bool | None = None

    def __post_init__(self) -> None:
        own_layout = self.arch == self.hf_model_type and self.hf_model_type is not None
        if self.arch not in ("gpt2", "llama") and not own_layout:
            raise ConfigError(f"unsupported model family {self.arch!r}; supported: 'gpt2', "
                              "'llama', or a family's own hf_model_type (models/families/)")
        if self.hidden_act is None:
            self.hidden_act = "gelu_new" if self.arch == "gpt2" else "silu"
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unsupported activation {self.hidden_act!r}; supported: "
                              f"{', '.join(ACTIVATIONS)}")
        gpt2_scaling = not self.scale_attn_weights or self.scale_attn_by_inverse_layer_idx
        if self.arch == "llama" and gpt2_scaling:
            raise ConfigError("scale_attn_weights=False and scale_attn_by_inverse_layer_idx=True "
                              "are GPT-2 options; supported for Llama: the defaults (scores × "
                              "1/√head_dim)")
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name}={value!r} must be a positive integer")
        if self.head_dim_override is None and self.hidden_size % self.n_heads:
            raise ConfigError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.n_heads} is not a multiple of "
                f"num_key_value_heads={self.n_kv_heads}")
        self._check_llama_family()
        bad_top_k = self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts
        if bad_top_k or self.moe_every < 1:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must lie in "
                              f"1..num_experts={self.num_experts}, and "
                              f"decoder_sparse_step={self.moe_every} be ≥ 1")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor={self.partial_rotary_factor!r} must give an "
                              f"even number of rotated dims in (0, head_dim={self.head_dim}]")
        short_factor = []
        if rope_type == "longrope":
            short_factor = self.rope_scaling.get("short_factor") or []
        if rope_type == "longrope" and len(short_factor) != self.rotary_dim // 2:
            raise ConfigError("longrope short_factor must hold rotary_dim / 2 = "
                              f"{self.rotary_dim // 2} numbers, got "
                              f"{self.rope_scaling.get('short_factor')!r}")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"unsupported rope scaling {rope_type!r} (config field "
                              "rope_parameters, or rope_scaling in transformers 4); supported: "
                              f"{SUPPORTED_ROPE_TYPES}")

    def _check_llama_family(self) -> None:
        """The Llama family's variant fields (windows, norms, caps, RoPE, experts): in range, not on
        GPT-2."""
        llama_only = dict(sliding_window=None, layer_types=None, qk_norm=None, no_rope_layers=None,
                          block="pre_norm",
                          partial_rotary_factor=1.0, num_experts=0, norm_unit_offset=False,
                          norm_scale_fp32=False,
                          embed_scale=False, attn_scale=None, attn_softcap=None, final_softcap=None,
                          local_rope_theta=None)
        if self.arch == "gpt2" and any(getattr(self, k) != v for k, v in llama_only.items()):
            raise ConfigError(f"{', '.join(llama_only)} are Llama-family options; GPT-2 has none")
        if self.block not in ("pre_norm", "sandwich", "post_norm"):
            raise ConfigError(f"block={self.block!r} is not a decoder layout; supported: "
                              "'pre_norm', 'sandwich', 'post_norm'")
        if self.qk_norm not in (None, "per_head", "whole"):
            raise ConfigError(f"qk_norm={self.qk_norm!r}; supported: None, 'per_head', 'whole'")
        if any(i not in range(self.n_layers) for i in self.no_rope_layers or []):
            raise ConfigError(f"no_rope_layers={self.no_rope_layers!r} must list layer indices "
                              f"0..{self.n_layers - 1}")
        for name in ("attn_scale", "attn_softcap", "final_softcap", "local_rope_theta"):
            value = getattr(self, name)
            number = isinstance(value, (int, float))
            if value is not None and (not number or not 0 < value < float("inf")):
                raise ConfigError(f"{name}={value!r} must be a positive finite number or None")
        w = self.sliding_window
        if w is not None and (type(w) is not int or w < 1):
            raise ConfigError(f"sliding_window={w!r} must be a positive integer or None (no "
                              "window)")
        if self.layer_types is not None:
            wrong_length = len(self.layer_types) != self.n_layers
            if wrong_length or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ConfigError(f"layer_types={self.layer_types!r} must list one of "
                                  f"{LAYER_TYPES} per layer ({self.n_layers} layers)")
            if w is None and "sliding_attention" in self.layer_types:
                raise ConfigError("layer_types has sliding_attention layers but sliding_window is "
                                  "None")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (a query at p sees keys p − w + 1 .. p), or None: the whole
        context."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """How far back every layer looks: the window when all layers slide (Mistral), else None.
        Only then can a sequence's oldest KV blocks be given back
        (BlockAllocator.free_out_of_window)."""
        if self.sliding_window is None:
            return None
        if self.layer_types and "full_attention" in self.layer_types:
            return None
        return self.sliding_window

    @property
    def adds_bos(self) -> bool:
        """Whether a text prompt starts with BOS (when the tokenizer has one)."""
        if self.bos_in_prompts is None:
            return self.arch == "llama"
        return self.bos_in_prompts

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.n_heads

    @property
    def kv_layout(self) -> KVLayout:
        """What the KV cache holds per token and layer: n_kv_heads K and V heads of head_dim, unless
        the family's options say otherwise with a `kv_layout` of their own (MLA's latent:
        models/mla.py)."""
        own = getattr(self.family_options, "kv_layout", None)
        if own is not None:
            return own
        return KVLayout(self.n_kv_heads, self.head_dim)

    @property
    def rotary_dim(self) -> int:
        """How many dims of each head RoPE rotates (HF: int(head_dim · partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied), for model cards and benchmarks."""
        d = self.hidden_size
        f = self.intermediate_size
        L = self.n_layers
        V = self.vocab_size
        q = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        if self.arch == "gpt2":
            per_layer = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
            total = V * d + self.max_position_embeddings * d + L * per_layer + 2 * d
        else:
            attn = d * q + 2 * d * kv + q * d
            attn += (q + 2 * kv) * self.qkv_bias + d * self.o_bias
            attn += {None: 0, "per_head": 2 * self.head_dim, "whole": q + kv}[self.qk_norm]
            norms = (4 if self.block == "sandwich" else 2) * d
            mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
            # (every layer counted as sparse: an upper bound with Qwen3-MoE's dense layers)
            if self.num_experts:
                expert = 3 * d * (self.moe_intermediate_size or f)
                mlp = self.num_experts * expert + d * self.num_experts  # experts and the router
            per_layer = norms + attn + mlp
            total = V * d + L * per_layer + d
        return total + (0 if self.tie_word_embeddings else V * d)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary (transformers 4.x or 5.x):
        hf_config.py."""
        from .hf_config import config_from_hf

        return config_from_hf(cfg)


# Released GPT-2 sizes (Radford et al. 2019), for benchmarks with random weights.
GPT2_PRESETS = {
    "gpt2": dict(n_layers=12, hidden_size=768, n_heads=12),
    "gpt2-medium": dict(n_layers=24, hidden_size=1024, n_heads=16),
    "gpt2-large": dict(n_layers=36, hidden_size=1280, n_heads=20),
    "gpt2-xl": dict(n_layers=48, hidden_size=1600, n_heads=25),
}


def gpt2_config(name: str = "gpt2", **overrides: Any) -> ModelConfig:
    """A GPT-2 config by released size name, with optional overrides (e.g. n_layers=6)."""
    if name not in GPT2_PRESETS:
        raise ConfigError(f"unknown GPT-2 size {name!r}; known: {sorted(GPT2_PRESETS)}")
    fields = dict(GPT2_PRESETS[name], vocab_size=50257, max_position_embeddings=1024,
                  bos_token_id=50256, eos_token_ids=[50256])
    fields.update(overrides)
    d, h = fields["hidden_size"], fields["n_heads"]
    fields.setdefault("n_kv_heads", h)
    fields.setdefault("intermediate_size", 4 * d)
    return ModelConfig(arch="gpt2", **fields)


def llama3_rope_inv_freq(inv_freq, scaling: dict[str, Any]):
    """Llama 3.1's frequency-dependent RoPE scaling (its paper's "llama3" rope type).

    Wavelengths shorter than original_len / high_freq_factor keep their frequency, those
    longer than original_len / low_freq_factor are divided by `factor`, and the band in
    between is interpolated smoothly.
    """
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = inv_freq.clone()
    out = out.where(wavelen <= old_len / high, scaled)  # medium band
    out = out.where(wavelen <= old_len / low, inv_freq / factor)  # long wavelengths
    return out


def yarn_rope_inv_freq(base: float, dim: int, scaling: dict[str, Any]):
    """YaRN (Peng et al. 2023): frequencies that turn fewer than beta_slow times over the original
    context L₀ are divided by `factor` (interpolated), those turning more than beta_fast times keep
    theirs (extrapolated), with a linear ramp over the dims in between. (attention_factor, applied
    to cos and sin, is computed when the config is read: hf_config.py.)"""
    import torch  # (config.py is imported by code that needs no torch)

    factor, L0 = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):  # the dim whose frequency turns `rotations` times over L₀
        return dim * math.log(L0 / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    # D/2
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32,
                          device="cpu") - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return (1 / (factor * pos_freqs)) * (1 - keep) + (1 / pos_freqs) * keep
