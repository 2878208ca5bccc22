"""Model configuration: one `ModelConfig` for every architecture nanoserve runs.

It is read from a Hugging Face `config.json` (transformers 4.x and 5.x forms) or built from
a preset. The model code only ever sees this dataclass, never the HF dictionary, so the
quirks of each config format live here and nowhere else. Taught in notebooks/01_*.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ConfigError
from .hf_fields import ACTIVATIONS, check_hf_fields

# HF `architectures[0]` -> our model family.
SUPPORTED_ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "GPT2Model": "gpt2",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",  # Llama block + q/k/v bias
}
SUPPORTED_MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "qwen2": "llama"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    arch: str  # "gpt2" | "llama"
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
    hidden_act: str | None = None  # the MLP's activation by transformers' name; None: gelu_new / silu
    # GPT-2 only: scores × 1/√head_dim (False: unscaled), and in layer i also × 1/(i+1)
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ("gpt2", "llama"):
            raise ConfigError(f"unsupported model family {self.arch!r}; supported: 'gpt2', 'llama'")
        if self.hidden_act is None:
            self.hidden_act = "gelu_new" if self.arch == "gpt2" else "silu"
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unsupported activation {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        if self.arch == "llama" and (not self.scale_attn_weights or self.scale_attn_by_inverse_layer_idx):
            raise ConfigError("scale_attn_weights=False and scale_attn_by_inverse_layer_idx=True are GPT-2 options; "
                              "supported for Llama: the defaults (scores × 1/√head_dim)")
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name}={value!r} must be a positive integer")
        if self.head_dim_override is None and self.hidden_size % self.n_heads:
            raise ConfigError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.n_heads} is not a multiple of num_key_value_heads={self.n_kv_heads}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"unsupported rope scaling {rope_type!r} (config field rope_parameters, or rope_scaling "
                              f"in transformers 4); supported: {SUPPORTED_ROPE_TYPES}")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied), for model cards and benchmarks."""
        d, f, L, V = self.hidden_size, self.intermediate_size, self.n_layers, self.vocab_size
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if self.arch == "gpt2":
            per_layer = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
            total = V * d + self.max_position_embeddings * d + L * per_layer + 2 * d
        else:
            attn = d * q + 2 * d * kv + q * d
            attn += (q + 2 * kv) * self.qkv_bias + d * self.o_bias
            per_layer = 2 * d + attn + 3 * d * f + (2 * f + d) * self.mlp_bias
            total = V * d + L * per_layer + d
        return total + (0 if self.tie_word_embeddings else V * d)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary (transformers 4.x or 5.x)."""
        archs = cfg.get("architectures") or []
        family = None
        if archs:
            family = SUPPORTED_ARCHITECTURES.get(archs[0])
            if family is None:
                raise ConfigError(
                    f"unsupported architecture {archs[0]!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        else:
            family = SUPPORTED_MODEL_TYPES.get(cfg.get("model_type", ""))
            if family is None:
                raise ConfigError(
                    f"config.json has no 'architectures' and model_type={cfg.get('model_type')!r} is not "
                    f"supported; supported model types: {sorted(SUPPORTED_MODEL_TYPES)}")
        # every field that changes the math is computed or refused by name: the table in hf_fields.py
        check_hf_fields("gpt2" if family == "gpt2" else "qwen2" if _is_qwen2(cfg) else "llama", cfg)
        return _gpt2_from_hf(cfg) if family == "gpt2" else _llama_from_hf(cfg)


def _is_qwen2(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in (cfg.get("architectures") or [])


def _need(cfg: dict[str, Any], *names: str) -> Any:
    """The first of `names` present in cfg, or a ConfigError naming the missing field."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    raise ConfigError(f"config.json is missing the required field {names[0]!r}")


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _dtype_name(cfg: dict[str, Any]) -> str | None:
    value = cfg.get("dtype", cfg.get("torch_dtype"))
    return str(value) if value is not None else None


def _gpt2_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    d = int(_need(cfg, "n_embd", "hidden_size"))
    n_head = int(_need(cfg, "n_head", "num_attention_heads"))
    return ModelConfig(
        arch="gpt2",
        vocab_size=int(_need(cfg, "vocab_size")),
        hidden_size=d,
        n_layers=int(_need(cfg, "n_layer", "num_hidden_layers")),
        n_heads=n_head,
        n_kv_heads=n_head,
        intermediate_size=int(cfg.get("n_inner") or 4 * d),
        max_position_embeddings=int(_need(cfg, "n_positions", "max_position_embeddings")),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_list(cfg.get("eos_token_id")),
        dtype=_dtype_name(cfg),
        hidden_act=cfg.get("activation_function", "gelu_new"),
        scale_attn_weights=bool(cfg.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(cfg.get("scale_attn_by_inverse_layer_idx", False)),
    )


def _llama_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    n_heads = int(_need(cfg, "num_attention_heads"))
    # transformers 5 moved rope_theta / rope_scaling into `rope_parameters`.
    rope_params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or rope_params or {})
    rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling.pop("rope_theta", None)
    if "type" in scaling and "rope_type" not in scaling:  # the oldest spelling
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    is_qwen2 = _is_qwen2(cfg)  # Qwen2's code ignores attention_bias and mlp_bias (hf_fields.py)
    attention_bias = bool(cfg.get("attention_bias", False)) and not is_qwen2
    return ModelConfig(
        arch="llama",
        vocab_size=int(_need(cfg, "vocab_size")),
        hidden_size=int(_need(cfg, "hidden_size")),
        n_layers=int(_need(cfg, "num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        intermediate_size=int(_need(cfg, "intermediate_size")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=rope_theta,
        rope_scaling=scaling or None,
        qkv_bias=attention_bias or is_qwen2,
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) and not is_qwen2,
        head_dim_override=cfg.get("head_dim"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_list(cfg.get("eos_token_id")),
        dtype=_dtype_name(cfg),
        hidden_act=cfg.get("hidden_act", "silu"),
    )


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


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json dictionary for `cfg` (so transformers can load what nanoserve saves)."""
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                  bos_token_id=cfg.bos_token_id,
                  eos_token_id=cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids or None)
    if cfg.arch == "gpt2":
        return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=cfg.hidden_size,
                    n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.intermediate_size,
                    n_positions=cfg.max_position_embeddings, layer_norm_epsilon=cfg.norm_eps,
                    activation_function=cfg.hidden_act, scale_attn_weights=cfg.scale_attn_weights,
                    scale_attn_by_inverse_layer_idx=cfg.scale_attn_by_inverse_layer_idx, **common)
    out = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=cfg.hidden_size,
               num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
               num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.intermediate_size,
               max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
               rope_theta=cfg.rope_theta, hidden_act=cfg.hidden_act, head_dim=cfg.head_dim,
               attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias, **common)
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.qkv_bias and not cfg.o_bias:  # Qwen2's layout: q/k/v biases and no other
        if cfg.mlp_bias:
            raise ConfigError("no HF config has q/k/v biases, no o_proj bias and MLP biases; "
                              "transformers could not load this model")
        out.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
        out.pop("attention_bias")
        out.pop("mlp_bias")
    return out
