"""Reading and writing Hugging Face `config.json`: the HF dictionary <-> `ModelConfig`.

Each HF model class reads its config its own way: Qwen2 always has q/k/v biases whatever
`attention_bias` says, Qwen3 puts `attention_bias` on o_proj too and normalises q and k per head,
Mistral slides a window over every layer while Qwen2/3 slide it only from `max_window_layers` on
(or where `layer_types` says). All of that is decided here, once; the model code only sees the
resulting `ModelConfig` fields. Before reading, `hf_fields.check_hf_fields` refuses by name every
field whose value nanoserve would compute wrongly. Taught in notebooks/01_*.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .config import LAYER_TYPES, ModelConfig
from .hf_fields import check_hf_fields

# HF `architectures[0]` -> the HF model type whose code nanoserve mirrors (its row in hf_fields.HF_FIELDS).
SUPPORTED_ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "GPT2Model": "gpt2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",  # Llama block + a sliding window in every layer (when set)
    "Qwen2ForCausalLM": "qwen2",  # Llama block + q/k/v bias (+ a window from max_window_layers on)
    "Qwen3ForCausalLM": "qwen3",  # Llama block + per-head RMSNorm of q and k before RoPE
}
SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")


def hf_model_type(cfg: dict[str, Any]) -> str:
    """Which HF model code the config names: `architectures[0]` (what transformers instantiates), else
    `model_type`; anything nanoserve does not run is refused by name."""
    archs = cfg.get("architectures") or []
    if archs:
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {archs[0]!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        return SUPPORTED_ARCHITECTURES[archs[0]]
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"config.json has no 'architectures' and model_type={cfg.get('model_type')!r} is not "
                          f"supported; supported model types: {sorted(SUPPORTED_MODEL_TYPES)}")
    return cfg["model_type"]


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dictionary (transformers 4.x or 5.x)."""
    hf_type = hf_model_type(cfg)
    # every field that changes the math is computed or refused by name: the table in hf_fields.py
    check_hf_fields(hf_type, cfg)
    return _gpt2_from_hf(cfg) if hf_type == "gpt2" else _llama_from_hf(cfg, hf_type)


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


def _windows(cfg: dict[str, Any], hf_type: str, n_layers: int) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as the HF model code applies them.

    Mistral: `sliding_window` in every layer (null: none). Qwen2/Qwen3: the window exists only with
    `use_sliding_window`, in the layers `layer_types` marks "sliding_attention", or, in a config
    without `layer_types` (transformers 4), in layers max_window_layers .. n_layers − 1."""
    # A key absent from config.json takes the HF class's default: sliding_window 4096, max_window_layers 28.
    if hf_type == "mistral":
        return cfg.get("sliding_window", 4096), None
    if hf_type == "llama":
        return None, None  # a window in a Llama config is refused by check_hf_fields
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(n_layers)]
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise ConfigError(f"{hf_type} config field layer_types has {bad[0]!r}; supported: {', '.join(LAYER_TYPES)}")
    if window is None or "sliding_attention" not in types:
        return None, None
    return int(window), list(types)


def _llama_from_hf(cfg: dict[str, Any], hf_type: str) -> ModelConfig:
    n_heads, n_layers = int(_need(cfg, "num_attention_heads")), int(_need(cfg, "num_hidden_layers"))
    # transformers 5 moved rope_theta / rope_scaling into `rope_parameters`.
    rope_params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or rope_params or {})
    rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling.pop("rope_theta", None)
    if "type" in scaling and "rope_type" not in scaling:  # the oldest spelling
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    # Which projections have biases, by the HF code of each type (hf_fields.py lists what each reads).
    attention_bias = bool(cfg.get("attention_bias", False)) and hf_type in ("llama", "qwen3")
    window, layer_types = _windows(cfg, hf_type, n_layers)
    return ModelConfig(
        arch="llama",
        vocab_size=int(_need(cfg, "vocab_size")),
        hidden_size=int(_need(cfg, "hidden_size")),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        intermediate_size=int(_need(cfg, "intermediate_size")),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=rope_theta,
        rope_scaling=scaling or None,
        qkv_bias=attention_bias or hf_type == "qwen2",
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) and hf_type == "llama",
        head_dim_override=cfg.get("head_dim"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_list(cfg.get("eos_token_id")),
        dtype=_dtype_name(cfg),
        hidden_act=cfg.get("hidden_act", "silu"),
        sliding_window=window,
        layer_types=layer_types,
        qk_norm=hf_type == "qwen3",
    )


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
    hf_type = _hf_type_of(cfg)
    if hf_type != "llama":
        out.update(architectures=[next(a for a, t in SUPPORTED_ARCHITECTURES.items() if t == hf_type)],
                   model_type=hf_type)
        out.pop("mlp_bias")
    if hf_type == "qwen2":
        out.pop("attention_bias")
    if hf_type == "mistral":
        out.pop("attention_bias")
        out["sliding_window"] = cfg.sliding_window
    elif hf_type in ("qwen2", "qwen3"):
        types = cfg.layer_types or [("sliding_attention" if cfg.sliding_window else "full_attention")] * cfg.n_layers
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                   layer_types=types, max_window_layers=types.index("sliding_attention")
                   if "sliding_attention" in types else cfg.n_layers)
    return out


def _hf_type_of(cfg: ModelConfig) -> str:
    """The HF model type that computes what `cfg` describes, or a ConfigError when none does."""
    if cfg.qk_norm:
        hf_type = "qwen3"  # q, k, v and o biases all or none; no MLP bias
        ok = cfg.qkv_bias == cfg.o_bias and not cfg.mlp_bias
    elif cfg.qkv_bias and not cfg.o_bias:
        hf_type, ok = "qwen2", not cfg.mlp_bias  # q/k/v biases and no other
    elif cfg.sliding_window is not None:
        hf_type = "mistral"  # a window in every layer, no biases
        ok = cfg.layer_types is None and not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias)
    else:
        hf_type, ok = "llama", True
    if not ok:
        raise ConfigError(f"no HF config describes this model (qk_norm={cfg.qk_norm}, qkv_bias={cfg.qkv_bias}, "
                          f"o_bias={cfg.o_bias}, mlp_bias={cfg.mlp_bias}, sliding_window={cfg.sliding_window}, "
                          f"layer_types={cfg.layer_types}); transformers could not load it")
    return hf_type
