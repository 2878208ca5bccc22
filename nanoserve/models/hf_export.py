"""Writing a Hugging Face `config.json` for a `ModelConfig`, so transformers loads what nanoserve
saves.

The HF model type is the one the config was read from (`ModelConfig.hf_model_type`); a config built
in code is a Llama (or a Qwen2, for its q/k/v-bias layout) or a GPT-2. Each type spells some fields
its own way (Gemma's `hidden_activation`, Qwen's `use_sliding_window`, SmolLM3's `no_rope_layers`),
written here. No silent wrong save: the dictionary is read back with hf_config.config_from_hf and
must give the same model, else a ConfigError names the fields that differ.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..errors import ConfigError
from .config import ModelConfig
from .family import family_of
from .hf_config import GEMMA, SUPPORTED_ARCHITECTURES, config_from_hf

# not the math (head_dim is compared instead)
_NOT_MATH = ("dtype", "hf_model_type", "head_dim_override")


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The HF config.json dictionary for `cfg`; a ConfigError when no config of its type describes
    it."""
    family = family_of(cfg.hf_model_type)
    if family is not None and family.to_hf is None:
        raise ConfigError(f"saving a {cfg.hf_model_type} checkpoint is not supported (no "
                          "config.json writer for that family); supported: the families of "
                          "hf_config.SUPPORTED_ARCHITECTURES")
    hf_type = cfg.hf_model_type or (
        "gpt2" if cfg.arch == "gpt2" else "qwen2" if cfg.qkv_bias and not cfg.o_bias else "llama"
    )
    if family is not None:  # its own writer, held to the same read-back check
        out = family.to_hf(cfg)
    else:
        out = _gpt2(cfg) if hf_type == "gpt2" else _llama_family(cfg, hf_type)
    again = config_from_hf(out)
    differ = [k for k, v in asdict(cfg).items() if k not in _NOT_MATH and getattr(again, k) != v]
    differ += ["head_dim"] * (again.head_dim != cfg.head_dim)
    if differ:
        raise ConfigError(f"no {hf_type} config.json describes this model: {', '.join(differ)} "
                          "would read back as "
                          f"{', '.join(repr(getattr(again, k)) for k in differ)}; transformers "
                          "could not load it")
    return out


def _common(cfg: ModelConfig) -> dict[str, Any]:
    eos = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids or None
    # pad_token_id is not kept (it does not change the logits); null, not a class default outside a
    # tiny vocabulary
    return dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                bos_token_id=cfg.bos_token_id, eos_token_id=eos, pad_token_id=None)


def _gpt2(cfg: ModelConfig) -> dict[str, Any]:
    return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=cfg.hidden_size,
                n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.intermediate_size,
                n_positions=cfg.max_position_embeddings, layer_norm_epsilon=cfg.norm_eps,
                activation_function=cfg.hidden_act, scale_attn_weights=cfg.scale_attn_weights,
                scale_attn_by_inverse_layer_idx=cfg.scale_attn_by_inverse_layer_idx, **_common(cfg))


def _llama_family(cfg: ModelConfig, hf_type: str) -> dict[str, Any]:
    arch = next(a for a, t in SUPPORTED_ARCHITECTURES.items() if t == hf_type)
    out = dict(architectures=[arch], model_type=hf_type, hidden_size=cfg.hidden_size,
               num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
               num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.intermediate_size,
               max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
               rope_theta=cfg.rope_theta, hidden_act=cfg.hidden_act, head_dim=cfg.head_dim,
               attention_bias=cfg.o_bias, mlp_bias=cfg.mlp_bias, **_common(cfg))
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    types = (
        cfg.layer_types
        or ["sliding_attention" if cfg.sliding_window else "full_attention"] * cfg.n_layers
    )
    if hf_type == "llama":
        out["attention_bias"] = cfg.qkv_bias  # and o: checked on reading back
    elif hf_type in ("mistral", "phi3", "mixtral"):
        out["sliding_window"] = cfg.sliding_window
        if hf_type == "phi3":
            out.update(partial_rotary_factor=cfg.partial_rotary_factor,
                       original_max_position_embeddings=(
                cfg.rope_scaling or {}).get("original_max_position_embeddings",
                                            cfg.max_position_embeddings))
    elif hf_type == "qwen3_moe":
        out.update(use_sliding_window=cfg.sliding_window is not None,
                   sliding_window=cfg.sliding_window)
    elif hf_type in ("qwen2", "qwen3", "smollm3"):
        out.update(use_sliding_window=cfg.sliding_window is not None,
                   sliding_window=cfg.sliding_window,
                   layer_types=types)
        if hf_type != "smollm3":
            out["max_window_layers"] = (
                types.index("sliding_attention") if cfg.sliding_window else cfg.n_layers
            )
        else:
            out["no_rope_layers"] = [
                int(i not in (cfg.no_rope_layers or [])) for i in range(cfg.n_layers)
            ]
    if hf_type == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok)
    elif hf_type == "qwen3_moe":
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.moe_intermediate_size,
                   norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=cfg.moe_every, mlp_only_layers=cfg.mlp_only_layers or [])
    elif hf_type in GEMMA:
        out.update(hidden_activation=out.pop("hidden_act"),
                   query_pre_attn_scalar=round((cfg.attn_scale or 1) ** -2),
                   attn_logit_softcapping=cfg.attn_softcap,
                   final_logit_softcapping=cfg.final_softcap,
                   sliding_window=cfg.sliding_window or 4096, layer_types=types)
        if hf_type == "gemma3_text":
            full = {"rope_type": "default", **(cfg.rope_scaling or {}),
                    "rope_theta": out.pop("rope_theta")}
            out.pop("rope_scaling", None)
            out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": cfg.local_rope_theta or full["rope_theta"]}}
    return out
