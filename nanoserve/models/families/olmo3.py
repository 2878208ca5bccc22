"""OLMo 3 (AI2, 2025): OLMo 2's block with sliding-window attention in three layers of four.

OLMo 2's post-norm block (x + norm(attn(x)), then x + norm(mlp(x))) and its RMSNorm over the whole
q and k projections are ModelConfig fields (`block="post_norm"`, `qk_norm="whole"`), read as
hf_config reads an OLMo 2. What OLMo 3 adds: `layer_types` marks each layer "sliding_attention"
(a query sees its `sliding_window` newest keys) or "full_attention" (by default every fourth layer),
and RoPE comes per layer type: `rope_parameters.full_attention` (where long-context checkpoints put
YaRN) and `rope_parameters.sliding_attention` (unscaled, its own base: ModelConfig's
`local_rope_theta`, the mechanism Gemma 3 uses). So the model is the Llama model itself.

transformers 5 reads a config.json's top-level `rope_theta` into the full-attention layers only and
gives the sliding ones the class default 500000, while transformers 4 applied one RoPE to every
layer: such a config has no one answer unless its base is that default, and is refused otherwise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...errors import ConfigError
from ..config import LAYER_TYPES, ModelConfig
from ..family import Family
from ..hf_config import llama_config_from_hf
from ..hf_fields import OLMO2_FIELDS, implemented
from ..llama import LlamaForCausalLM
from ._llama_shaped import llama_shape_to_hf, refuse_partial_rope

DEFAULT_THETA = 500000.0  # Olmo3Config.default_theta


def olmo3_rope(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the full-attention layers' RoPE, the sliding layers' RoPE), as Olmo3Config builds them."""
    params = cfg.get("rope_parameters")
    theta = cfg.get("rope_theta")
    if params is None:  # transformers 4: rope_theta and rope_scaling at the top level
        if theta not in (None, DEFAULT_THETA):
            raise ConfigError(f"olmo3 config field rope_theta={theta!r} without rope_parameters is "
                              "not supported (transformers 5 applies it to the full-attention "
                              "layers only, transformers 4 to every layer); supported: "
                              f"rope_parameters per layer type, or rope_theta {DEFAULT_THETA}")
        full = {"rope_type": "default", **(cfg.get("rope_scaling") or {})}
        params = {"full_attention": full, "sliding_attention": {"rope_type": "default"}}
    if set(params) - set(LAYER_TYPES):
        raise ConfigError(f"olmo3 config field rope_parameters={params!r} is not supported "
                          "(transformers 5 ignores RoPE settings outside a layer type's entry); "
                          f"supported: one entry per layer type, {', '.join(LAYER_TYPES)}")
    full = {"rope_theta": DEFAULT_THETA, **(params.get("full_attention") or {})}
    sliding = {"rope_theta": DEFAULT_THETA, **(params.get("sliding_attention") or {})}
    if sliding.get("rope_type", "default") != "default":
        raise ConfigError("olmo3 config field rope_parameters.sliding_attention="
                          f"{sliding!r} is not supported (scaling of the sliding layers' RoPE); "
                          "supported: rope_type 'default'")
    for entry in (full, sliding):
        refuse_partial_rope({"rope_parameters": entry}, "olmo3")
    return full, sliding


def olmo3_windows(cfg: dict[str, Any], n_layers: int) -> tuple[int | None, list[str]]:
    """(sliding_window, layer_types); without layer_types every fourth layer is global."""
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layers)]
    window = cfg.get("sliding_window")
    if window is None and "sliding_attention" in types:
        raise ConfigError("olmo3 config lists sliding_attention layers in layer_types with "
                          "sliding_window=None; supported: a window, or no sliding layers")
    return window, list(types)


def olmo3_config(cfg: dict[str, Any]) -> ModelConfig:
    full, sliding = olmo3_rope(cfg)
    # read as an OLMo 2 with the full-attention layers' RoPE, then given OLMo 3's windows
    as_olmo2 = {**cfg, "rope_parameters": full, "rope_scaling": None, "rope_theta": None,
                "layer_types": None, "sliding_window": None}
    base = llama_config_from_hf(as_olmo2, "olmo2")
    window, types = olmo3_windows(cfg, base.n_layers)
    if "sliding_attention" not in types:
        window = None
    local_theta = float(sliding["rope_theta"]) if window is not None else None
    return replace(base, hf_model_type="olmo3", sliding_window=window,
                   layer_types=types if window is not None else None, local_rope_theta=local_theta)


def olmo3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = llama_shape_to_hf(cfg, "Olmo3ForCausalLM", "olmo3")
    local = {"rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}
    out.update(rope_parameters={"full_attention": out["rope_parameters"],
                                "sliding_attention": local},
               sliding_window=cfg.sliding_window,
               layer_types=cfg.layer_types or ["full_attention"] * cfg.n_layers)
    return out


OLMO3_FIELDS = {
    **OLMO2_FIELDS,
    "rope_parameters": implemented("one RoPE per layer type: full_attention's base and scaling, "
                                   "sliding_attention's base (its scaling is refused)"),
    "rope_theta": implemented("transformers 4's place for the RoPE base; refused unless 500000 "
                              "(transformers 5 gives it to the full-attention layers only)"),
    "rope_scaling": implemented("transformers 4's place for the full-attention layers' scaling"),
    "sliding_window": implemented("the window of the sliding layers: a query at p sees keys "
                                  "p − w + 1 .. p"),
    "layer_types": implemented("which layers slide; without it all but every fourth"),
}

FAMILY = Family(
    model_type="olmo3",
    architectures=("Olmo3ForCausalLM",),
    hf_config_class="Olmo3Config",
    fields=OLMO3_FIELDS,
    config=olmo3_config,
    model_class=LlamaForCausalLM,
    defaults=dict(rms_norm_eps=1e-5, sliding_window=4096, max_position_embeddings=2048),
    name="OLMo 3",
    summary="OLMo 2 + sliding windows in three layers of four, a RoPE per layer type",
    to_hf=olmo3_to_hf,
)
