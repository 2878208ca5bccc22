"""Reading Hugging Face `config.json`: the HF dictionary -> `ModelConfig` (hf_export.py writes it
back).

Each HF model class reads its config its own way: Qwen2 always has q/k/v biases whatever
`attention_bias` says, Qwen3 puts `attention_bias` on o_proj too and normalises q and k per head,
Mistral slides a window over every layer while Qwen2/3 slide it only from `max_window_layers` on
(or where `layer_types` says). All of that is decided here, once; the model code only sees the
resulting `ModelConfig` fields. Before reading, `hf_fields.check_hf_fields` refuses by name every
field whose value nanoserve would compute wrongly. Taught in notebooks/01_*.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError
from .config import LAYER_TYPES, ModelConfig
from .family import architectures, families, family_of
from .hf_fields import check_hf_fields

# HF `architectures[0]` -> the HF model type whose code nanoserve mirrors (its row in
# hf_fields.HF_FIELDS).
SUPPORTED_ARCHITECTURES = {
    "GPT2LMHeadModel": "gpt2",
    "GPT2Model": "gpt2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",  # Llama block + a sliding window in every layer (when set)
    "Qwen2ForCausalLM": "qwen2",  # Llama block + q/k/v bias (+ a window from max_window_layers on)
    "Qwen3ForCausalLM": "qwen3",  # Llama block + per-head RMSNorm of q and k before RoPE
    # sandwich norms, (1 + w) RMSNorm, soft-capping, alternate windows
    "Gemma2ForCausalLM": "gemma2",
    # Gemma 2 with q/k norms and a local RoPE base, no attention soft-cap
    "Gemma3ForCausalLM": "gemma3_text",
    "SmolLM3ForCausalLM": "smollm3",  # Llama block; every 4th layer without RoPE ("NoPE")
    "Olmo2ForCausalLM": "olmo2",  # post-norm blocks; RMSNorm over the whole q and k projections
    # fused qkv / gate-up weights (split at load), partial RoPE, LongRoPE, a window
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",  # Mistral with a mixture of experts in every layer
    # Qwen3 with a mixture of experts (dense in mlp_only_layers)
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# model_type -> (the family's name, what it adds): the README's "What loads" table
# (scripts/what_loads.py; the families of models/families/ declare theirs in their Family)
BUILT_IN_SUMMARIES = {
    "gpt2": ("GPT-2", "learned positions, LayerNorm, GELU MLP; every size"),
    "llama": ("Llama 2 / 3 / 3.1 / 3.2, TinyLlama, SmolLM",
              "the Llama block: RMSNorm, RoPE (linear, llama3, yarn, dynamic scalings), GQA, "
              "SwiGLU"),
    "mistral": ("Mistral", "a sliding window in every layer (when set)"),
    "qwen2": ("Qwen2 / 2.5", "q/k/v biases; a window from max_window_layers on"),
    "qwen3": ("Qwen3", "RMSNorm of each head's q and k before RoPE; windows"),
    "gemma2": ("Gemma 2", "sandwich norms, (1 + w) RMSNorm, soft-capping, alternating windows"),
    "gemma3_text": ("Gemma 3 (text model)", "q/k norms, a RoPE base of its own in sliding layers"),
    "smollm3": ("SmolLM3", "every 4th layer without RoPE (NoPE)"),
    "olmo2": ("OLMo 2", "post-norm blocks; RMSNorm over the whole q and k projections"),
    "phi3": ("Phi-3 / 3.5 / 4-mini",
             "fused qkv / gate-up split at load, partial RoPE, LongRoPE within its original "
             "context"),
    "mixtral": ("Mixtral", "Mistral with a mixture of experts in every layer"),
    "qwen3_moe": ("Qwen3-MoE", "Qwen3 with a mixture of experts (dense in mlp_only_layers)"),
}
# gpt2, llama, mistral, ...
SUPPORTED_MODEL_TYPES = tuple(dict.fromkeys(SUPPORTED_ARCHITECTURES.values()))
# What a key absent from config.json means, where a family's HF class differs from Llama's defaults.
_WINDOWED = dict(sliding_window=4096, max_window_layers=28)
_GEMMA = dict(num_key_value_heads=4, sliding_window=4096, head_dim=256,
              hidden_activation="gelu_pytorch_tanh",
              query_pre_attn_scalar=256, tie_word_embeddings=True)
TYPE_DEFAULTS = {
    "mistral": dict(num_key_value_heads=8, max_position_embeddings=131072, sliding_window=4096),
    "mixtral": dict(num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    rope_theta=1e6,
                    num_local_experts=8, num_experts_per_tok=2),
    "qwen2": dict(num_key_value_heads=32, max_position_embeddings=32768, **_WINDOWED),
    "qwen3": dict(num_key_value_heads=32, max_position_embeddings=32768, head_dim=128, **_WINDOWED),
    "qwen3_moe": dict(num_key_value_heads=4, max_position_embeddings=32768, sliding_window=4096,
                      num_experts_per_tok=8, moe_intermediate_size=768),  # (num_experts: _experts)
    "gemma2": dict(max_position_embeddings=8192, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0,
                   **_GEMMA),
    "gemma3_text": dict(max_position_embeddings=131072, rope_theta=1e6, sliding_window_pattern=6,
                        **_GEMMA),
    "smollm3": dict(num_key_value_heads=4, max_position_embeddings=32768, tie_word_embeddings=True,
                    rope_theta=2e6),
    "olmo2": dict(rms_norm_eps=1e-5),
    "phi3": dict(rms_norm_eps=1e-5, max_position_embeddings=4096,
                 original_max_position_embeddings=4096),
}
GEMMA = ("gemma2", "gemma3_text")


def hf_model_type(cfg: dict[str, Any]) -> str:
    """The HF model type whose code nanoserve mirrors for this config (by `architectures`, else
    `model_type`); anything nanoserve does not run is refused by name."""
    known = {**SUPPORTED_ARCHITECTURES, **architectures()}
    archs = cfg.get("architectures") or []
    if archs:
        if archs[0] not in known:
            raise ConfigError(f"unsupported architecture {archs[0]!r}; supported: "
                              f"{sorted(known)}")
        return known[archs[0]]
    types = (*SUPPORTED_MODEL_TYPES, *families())
    if cfg.get("model_type") not in types:
        raise ConfigError("config.json has no 'architectures' and "
                          f"model_type={cfg.get('model_type')!r} is not supported; supported model "
                          f"types: {sorted(types)}")
    return cfg["model_type"]


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dictionary (transformers 4.x or 5.x)."""
    hf_type = hf_model_type(cfg)
    # every field that changes the math is computed or refused by name: the table in hf_fields.py
    check_hf_fields(hf_type, cfg)
    family = family_of(hf_type)
    if family is not None:  # a family of its own module (models/families/)
        return family.config({**family.defaults, **cfg})
    cfg = {**TYPE_DEFAULTS.get(hf_type, {}), **cfg}
    return _gpt2_from_hf(cfg) if hf_type == "gpt2" else llama_config_from_hf(cfg, hf_type)


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
        hf_model_type="gpt2",
    )


def _windows(cfg: dict[str, Any], hf_type: str,
             n_layers: int) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as the HF model code applies them (absent keys: TYPE_DEFAULTS).

    Mistral, Mixtral, Phi-3: `sliding_window` in every layer (null: none). Qwen2/3, SmolLM3: only
    with `use_sliding_window`, in the layers `layer_types` marks "sliding_attention" or, without it,
    from max_window_layers on (SmolLM3: its NoPE layers). Gemma: always; every 2nd / 6th layer
    global."""
    if hf_type in ("mistral", "phi3", "mixtral"):
        return cfg.get("sliding_window"), None
    if hf_type == "qwen3_moe":  # every layer, when switched on
        return cfg.get("sliding_window") if cfg.get("use_sliding_window") else None, None
    if hf_type == "llama":
        return None, None  # a window in a Llama config is refused by check_hf_fields
    types = cfg.get("layer_types")
    # without layer_types: the window slides in the NoPE layers
    if hf_type == "smollm3" and types is None:
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        nope = _no_rope_layers(cfg, n_layers)
        types = [
            "sliding_attention" if window is not None and i in nope else "full_attention"
            for i in range(n_layers)
        ]
    if hf_type in GEMMA:  # a window always; without layer_types, every `pattern`-th layer is global
        window = cfg.get("sliding_window")
        pattern = 2 if hf_type == "gemma2" else cfg["sliding_window_pattern"]
        types = types or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
        ]
    else:
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if types is None:
        first = cfg.get("max_window_layers")
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(n_layers)]
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise ConfigError(f"{hf_type} config field layer_types has {bad[0]!r}; supported: "
                          f"{', '.join(LAYER_TYPES)}")
    # transformers' attention paths disagree on this one
    if window is None and "sliding_attention" in types:
        raise ConfigError(f"{hf_type} config lists sliding_attention layers in layer_types with "
                          "the window switched off (use_sliding_window / sliding_window); "
                          "supported: both on, or no sliding layers")
    if window is None:
        return None, None
    return int(window), list(types)


def _no_rope_layers(cfg: dict[str, Any], n_layers: int) -> list[int]:
    """SmolLM3: `no_rope_layers` holds 1 where a layer applies RoPE, 0 where not (default: 0 every
    4th)."""
    flags = cfg.get("no_rope_layers") or [int((i + 1) % cfg.get("no_rope_layer_interval", 4) != 0)
                                          for i in range(n_layers)]
    if len(flags) != n_layers:
        raise ConfigError(f"smollm3 config field no_rope_layers has {len(flags)} entries for "
                          f"{n_layers} layers")
    return [i for i, uses_rope in enumerate(flags) if not uses_rope]


def _rope(cfg: dict[str, Any], hf_type: str) -> tuple[float, dict[str, Any], float | None]:
    """(rope_theta, scaling of the full-attention layers, the sliding layers' own base or None).

    transformers 5 keeps them in `rope_parameters` (Gemma 3: one entry per layer type); transformers
    4 in rope_theta / rope_scaling (and Gemma 3's rope_local_base_freq)."""
    params = dict(cfg.get("rope_parameters") or {})
    local = None
    if hf_type == "gemma3_text":
        # (a base absent from either falls back as transformers' own does)
        if "full_attention" in params:
            local, params = (
                dict(params.get("sliding_attention") or {}),
                dict(params["full_attention"]),
            )
            local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
        else:
            local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
            params = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e6)}
        if local.get("rope_type", "default") != "default":
            raise ConfigError("gemma3_text config field "
                              f"rope_parameters.sliding_attention={local!r} is not supported "
                              "(scaling of the local layers' RoPE); supported: rope_type "
                              "'default'")
    scaling = dict(cfg.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    for key in ("rope_theta", "partial_rotary_factor"):
        scaling.pop(key, None)
    if "type" in scaling and "rope_type" not in scaling:  # the oldest spelling
        scaling["rope_type"] = scaling.pop("type")
    # Phi-3's old names of LongRoPE
    if hf_type == "phi3" and scaling.get("rope_type") in ("su", "yarn"):
        scaling["rope_type"] = "longrope"
    if scaling.get("rope_type") == "longrope":
        scaling = _longrope(cfg, scaling)
    elif scaling.get("rope_type") == "yarn":
        scaling = _yarn(cfg, scaling)
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    return theta, scaling, None if local is None else float(local.get("rope_theta", 10000.0))


def _longrope(cfg: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE: per-frequency factors, `short_factor` while the sequence fits the
    pretraining context L₀ (original_max_position_embeddings), `long_factor` past it, and cos, sin ×
    attention_factor (default √(1 + ln s / ln L₀), s = max_position_embeddings / L₀). Past L₀,
    transformers re-rotates every new token with the long factors while the cached keys keep the
    short ones, so no one result exists to match there: nanoserve keeps the short factors and the
    context within L₀."""
    if "short_factor" not in scaling:
        raise ConfigError(f"config field rope_scaling={scaling!r} has rope_type 'longrope' but "
                          "no 'short_factor'; LongRoPE needs its per-frequency factors: "
                          "short_factor (and long_factor, which defaults to it)")
    # (Phi-3's code reads the top-level field, whatever rope_scaling says)
    original = int(
        cfg.get("original_max_position_embeddings")
        or scaling.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
    )
    factor = scaling.get("factor") or int(cfg["max_position_embeddings"]) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return dict(rope_type="longrope", short_factor=list(scaling["short_factor"]),
                long_factor=list(scaling.get("long_factor") or scaling["short_factor"]),
                original_max_position_embeddings=original, attention_factor=float(attention_factor))


def _yarn(cfg: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """YaRN's defaults made explicit: L₀ (the context it stretches from), the factor, and the
    attention factor 0.1·ln(s) + 1 (or DeepSeek's mscale / mscale_all_dim ratio) that multiplies cos
    and sin."""
    original = int(
        scaling.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048)
    )
    factor = scaling.get("factor") or int(cfg.get("max_position_embeddings", 2048)) / original
    ms = lambda scale, m=1: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0  # noqa: E731
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            ms(factor, mscale) / ms(factor, mscale_all_dim) if mscale and mscale_all_dim
            else ms(factor)
        )
    return {**scaling, "factor": float(factor), "original_max_position_embeddings": original,
            "attention_factor": float(attention_factor)}


def llama_config_from_hf(cfg: dict[str, Any], hf_type: str) -> ModelConfig:
    """The Llama-class reading of `cfg` as the HF code of `hf_type` reads it (a family module of
    models/families/ reads its config as the nearest of these, then replaces what differs)."""
    n_heads, n_layers = int(_need(cfg, "num_attention_heads")), int(_need(cfg, "num_hidden_layers"))
    rope_theta, scaling, local_theta = _rope(cfg, hf_type)
    gemma = hf_type in GEMMA
    # Which projections have biases, by the HF code of each type (hf_fields.py lists what each
    # reads).
    biased = ("llama", "qwen3", "qwen3_moe", "smollm3", "olmo2", *GEMMA)
    attention_bias = bool(cfg.get("attention_bias", False)) and hf_type in biased
    window, layer_types = _windows(cfg, hf_type, n_layers)
    context = int(cfg.get("max_position_embeddings", 2048))
    if scaling.get("rope_type") == "longrope":  # LongRoPE: within L₀
        context = min(context, scaling["original_max_position_embeddings"])
    qk_norm = None
    if hf_type in ("qwen3", "qwen3_moe", "gemma3_text"):
        qk_norm = "per_head"
    elif hf_type == "olmo2":
        qk_norm = "whole"
    partial_rotary_factor = 1.0
    if hf_type == "phi3":
        rope_fields = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        partial_rotary_factor = float(rope_fields.get("partial_rotary_factor",
                                                      cfg.get("partial_rotary_factor", 1.0)))
    return ModelConfig(
        arch="llama",
        vocab_size=int(_need(cfg, "vocab_size")),
        hidden_size=int(_need(cfg, "hidden_size")),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        intermediate_size=int(_need(cfg, "intermediate_size")),
        max_position_embeddings=context,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=rope_theta,
        rope_scaling=scaling or None,
        qkv_bias=attention_bias or hf_type == "qwen2",
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) and hf_type in ("llama", "smollm3"),
        head_dim_override=cfg.get("head_dim"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_list(cfg.get("eos_token_id")),
        dtype=_dtype_name(cfg),
        hidden_act=cfg.get("hidden_activation") if gemma else cfg.get("hidden_act", "silu"),
        sliding_window=window,
        layer_types=layer_types,
        qk_norm=qk_norm,
        no_rope_layers=_no_rope_layers(cfg, n_layers) if hf_type == "smollm3" else None,
        partial_rotary_factor=partial_rotary_factor,
        block="sandwich" if gemma else "post_norm" if hf_type == "olmo2" else "pre_norm",
        norm_unit_offset=gemma,
        norm_scale_fp32=hf_type == "olmo2",
        embed_scale=gemma,
        attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
        # Gemma 3 never applies it
        attn_softcap=cfg.get("attn_logit_softcapping") if hf_type == "gemma2" else None,
        final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
        local_rope_theta=local_theta,
        hf_model_type=hf_type,
        **_experts(cfg, hf_type),
    )


def _experts(cfg: dict[str, Any], hf_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields (moe.py): Mixtral's in every layer, always renormalised;
    Qwen3-MoE's where decoder_sparse_step and mlp_only_layers say, renormalised only with
    norm_topk_prob."""
    if hf_type not in ("mixtral", "qwen3_moe"):
        return {}
    if hf_type == "mixtral":
        return dict(num_experts=int(cfg["num_local_experts"]),
                    num_experts_per_tok=int(cfg["num_experts_per_tok"]))
    # either spelling
    return dict(num_experts=int(cfg.get("num_experts", cfg.get("num_local_experts", 128))),
                num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_every=int(cfg.get("decoder_sparse_step", 1)),
                mlp_only_layers=list(cfg.get("mlp_only_layers") or []) or None)
