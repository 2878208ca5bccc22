"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention with a mixture of experts that
keeps a gated shared expert beside the routed ones (models/moe_shared.py).

What differs from the Llama blocks, as transformers' modeling_qwen2_moe computes it:
- the MLP of layer i is `SharedExpertMoeBlock` when num_experts > 0, i is not in mlp_only_layers
  and (i + 1) % decoder_sparse_step == 0 (moe.is_moe_layer, as Qwen3-MoE); else a dense MLP of
  intermediate_size;
- q, k and v have biases when `qkv_bias` (default true), o never;
- with use_sliding_window, and without an explicit layer_types, the layers that slide are the even
  ones below max_window_layers (i % 2 == 0 and i < max_window_layers): not Qwen2's rule (every
  layer from max_window_layers on).
The config is read as a Qwen2's once those are decided, the module names are Llama's (arch
"llama"), so quantization, LoRA and the loaders walk it as they walk Qwen3-MoE.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ...errors import ConfigError
from ..config import ModelConfig
from ..family import Family
from ..hf_config import llama_config_from_hf
from ..hf_fields import QWEN2_FIELDS, QWEN3_MOE_FIELDS, implemented, inert
from ..llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from ..moe import is_moe_layer, split_stacked_experts
from ..moe_shared import SharedExpertMoeBlock


@dataclass(frozen=True)
class Qwen2MoeOptions:
    shared_expert_intermediate_size: int = 5632  # the shared expert's MLP width

    def __post_init__(self) -> None:
        width = self.shared_expert_intermediate_size
        if type(width) is not int or width < 1:
            raise ConfigError(f"qwen2_moe config field shared_expert_intermediate_size={width!r} "
                              "must be a positive integer")


def qwen2_moe_layer_types(cfg: dict[str, Any]) -> list[str]:
    """Which layers slide when config.json lists no layer_types: with use_sliding_window, the even
    layers below max_window_layers (Qwen2MoeConfig's rule)."""
    on = bool(cfg.get("use_sliding_window"))
    first_full = int(cfg["max_window_layers"])
    types = []
    for i in range(int(cfg["num_hidden_layers"])):
        slides = on and i % 2 == 0 and i < first_full
        types.append("sliding_attention" if slides else "full_attention")
    return types


def _check_rope(cfg: dict[str, Any]) -> None:
    """Qwen2-MoE's RoPE rotates whole heads: a partial_rotary_factor is refused by name."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if factor not in (None, 1.0):
        raise ConfigError(f"qwen2_moe config field rope_parameters.partial_rotary_factor="
                          f"{factor!r} is not supported (rotating only part of each head); "
                          "supported: 1.0")


def qwen2_moe_config(cfg: dict[str, Any]) -> ModelConfig:
    _check_rope(cfg)
    layer_types = cfg.get("layer_types") or qwen2_moe_layer_types(cfg)
    if not cfg.get("use_sliding_window") and "sliding_attention" in layer_types:
        # (transformers then sets sliding_window to 0: a window that sees no key)
        raise ConfigError(f"qwen2_moe config field layer_types={layer_types!r} lists "
                          "sliding_attention layers with use_sliding_window=False; supported: "
                          "use_sliding_window true, or no sliding layers")
    # Qwen2's reading, with the layer types decided here
    base = llama_config_from_hf({**cfg, "layer_types": layer_types}, "qwen2")
    options = Qwen2MoeOptions(int(cfg["shared_expert_intermediate_size"]))
    return replace(base, hf_model_type="qwen2_moe", qkv_bias=bool(cfg["qkv_bias"]),
                   num_experts=int(cfg["num_experts"]),
                   num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg["norm_topk_prob"]),
                   moe_every=int(cfg["decoder_sparse_step"]),
                   mlp_only_layers=list(cfg.get("mlp_only_layers") or []) or None,
                   family_options=options)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block; in a sparse layer the MLP is the shared-expert block. (The Llama
    layer first builds moe.py's block there; it is replaced before any weight is read.)"""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        if is_moe_layer(cfg, layer_idx):
            width = cfg.family_options.shared_expert_intermediate_size
            self.mlp = SharedExpertMoeBlock(cfg, width)


class Qwen2MoeModel(LlamaModel):
    layer_class = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    model_class = Qwen2MoeModel


def rename(cfg: ModelConfig, tensors: dict) -> dict:
    """A state dict saved with the experts stacked (transformers 5's layout) read one expert at a
    time; save_pretrained's per-expert names pass through."""
    return split_stacked_experts(tensors, cfg.hidden_size, cfg.moe_intermediate_size)


_MOE_FIELDS = ("output_router_logits", "router_aux_loss_coef", "num_experts",
               "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "decoder_sparse_step", "mlp_only_layers")

QWEN2_MOE_FIELDS = {
    **QWEN2_FIELDS,
    **{name: QWEN3_MOE_FIELDS[name] for name in _MOE_FIELDS},
    "shared_expert_intermediate_size": implemented("the shared expert's MLP width; its output × "
                                                   "sigmoid(shared_expert_gate(x))"),
    "qkv_bias": implemented("biases on q, k and v (o has none)"),
    "attention_bias": inert("Qwen2-MoE's code reads qkv_bias"),
    "max_window_layers": implemented("without layer_types, the even layers below this index slide "
                                     "(with use_sliding_window)"),
    "layer_types": implemented("per-layer attention kinds: 'full_attention' or "
                               "'sliding_attention'; without it, from max_window_layers"),
}

FAMILY = Family(
    model_type="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    hf_config_class="Qwen2MoeConfig",
    fields=QWEN2_MOE_FIELDS,
    config=qwen2_moe_config,
    model_class=Qwen2MoeForCausalLM,
    defaults=dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                  num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                  decoder_sparse_step=1, moe_intermediate_size=1408,
                  shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_experts=60,
                  norm_topk_prob=False, mlp_only_layers=[], qkv_bias=True),
    rename=rename,
    name="Qwen2-MoE",
    summary="Qwen2 + routed experts and a sigmoid-gated shared expert (decoder_sparse_step, "
            "mlp_only_layers)",
)
