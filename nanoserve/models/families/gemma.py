"""Gemma 1 (Google, 2024): Llama's pre-norm block with three of Gemma 2's habits and none of its
sandwich.

What HF's GemmaForCausalLM computes beyond a Llama: RMSNorm scales by (1 + w) in float32
(`norm_unit_offset`), the token embeddings are multiplied by √hidden_size rounded to the weights'
dtype (`embed_scale`), and the MLP is GeGLU: down(gelu_tanh(gate(x)) · up(x)). Attention keeps
1/√head_dim, with head_dim a field of its own (256 when absent, not hidden_size / heads). Every one
of these is a ModelConfig field already (Gemma 2/3 set them), so the model is the Llama model itself
and only the config reading lives here.

The activation: transformers 5 reads `hidden_act` and turns the original releases' "gelu" into
"gelu_pytorch_tanh" (the checkpoints were trained with the tanh form). transformers 4.38-4.40 read
`hidden_activation` instead; a config whose two names disagree has no one answer and is refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...errors import ConfigError
from ..config import ModelConfig
from ..family import Family
from ..hf_config import llama_config_from_hf
from ..hf_fields import ACTIVATIONS, LLAMA_FIELDS, implemented, inert, refused
from ..llama import LlamaForCausalLM
from ._llama_shaped import llama_shape_to_hf, refuse_partial_rope, refuse_windows


def gemma_activation(cfg: dict[str, Any]) -> str:
    """The MLP gate's activation as transformers 5 reads it: hidden_act, with "gelu" meaning the
    tanh form; a `hidden_activation` that says otherwise is refused by name."""
    act = cfg["hidden_act"]
    if act == "gelu":
        act = "gelu_pytorch_tanh"
    other = cfg.get("hidden_activation")
    if other is not None and other != act:
        raise ConfigError(f"gemma config field hidden_activation={other!r} disagrees with "
                          f"hidden_act={cfg['hidden_act']!r} (read as {act!r}); transformers 4.38 "
                          "read the first, transformers 5 the second; supported: "
                          f"hidden_activation absent, null or {act!r}")
    return act


def gemma_config(cfg: dict[str, Any]) -> ModelConfig:
    refuse_windows(cfg, "gemma")
    refuse_partial_rope(cfg, "gemma")
    base = llama_config_from_hf(cfg, "llama")
    return replace(base, hf_model_type="gemma", hidden_act=gemma_activation(cfg), mlp_bias=False,
                   norm_unit_offset=True, embed_scale=True)


def gemma_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return llama_shape_to_hf(cfg, "GemmaForCausalLM", "gemma")


GEMMA_FIELDS = {
    **LLAMA_FIELDS,
    "hidden_act": implemented("the gate's activation in the gated MLP (GeGLU by default); "
                              "'gelu' is read as 'gelu_pytorch_tanh', as transformers 5 does",
                              ACTIVATIONS),
    "hidden_activation": refused("transformers 4.38's name of the activation; refused where it "
                                 "disagrees with hidden_act"),
    "head_dim": implemented("per-head width; 256 when absent"),
    "rms_norm_eps": implemented("RMSNorm epsilon; the norms scale by (1 + w) in float32"),
    "mlp_bias": inert("Gemma's MLP never has biases"),
    "partial_rotary_factor": refused("rotating only part of each head", None, 1.0),
    "sliding_window": refused("a sliding window (Gemma 1 never slides)", None),
    "layer_types": refused("per-layer attention kinds: only 'full_attention'"),
    "use_bidirectional_attention": refused("queries attending to later keys (an encoder)", None,
                                           False),
}

# GemmaConfig's defaults for the keys a config.json may leave out
GEMMA_DEFAULTS = dict(num_key_value_heads=16, head_dim=256, hidden_act="gelu_pytorch_tanh",
                      max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      attention_bias=False, rope_theta=10000.0)

FAMILY = Family(
    model_type="gemma",
    architectures=("GemmaForCausalLM",),
    hf_config_class="GemmaConfig",
    fields=GEMMA_FIELDS,
    config=gemma_config,
    model_class=LlamaForCausalLM,
    defaults=GEMMA_DEFAULTS,
    name="Gemma 1",
    summary="Llama + (1 + w) RMSNorm, √d embeddings, GeGLU, head_dim 256",
    to_hf=gemma_to_hf,
)
