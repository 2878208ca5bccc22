"""DeepSeek-V2 and DeepSeek-V3: Llama's pre-norm blocks with multi-head latent attention.

Both read as a Llama and replace the attention with MLA (models/mla.py): q through a low-rank
bottleneck (q_a_proj, q_a_layernorm, q_b_proj; q_proj without q_lora_rank), one compressed latent
per token (kv_a_proj_with_mqa, kv_a_layernorm) that kv_b_proj expands into each head's key and
value, a RoPE key shared by every head, and a KV cache of the latent alone. The softmax scale is
1/√(qk_nope_head_dim + qk_rope_head_dim), times YaRN's mscale(factor, mscale_all_dim)² when the
config's rope scaling names one.

V2 rotates neighbouring pairs always; V3 where `rope_interleave` says (its default). V2's MLPs may
carry biases (`mlp_bias`); V3's never do. Layers from `first_k_dense_replace` on hold DeepSeek's
mixture of experts instead of a dense MLP (models/moe_shared.py's `DeepseekMoE`: shared experts
every token runs, routed experts chosen by V2's softmax greedy / group-limited greedy top-k or V3's
sigmoid scores with e_score_correction_bias, grouped, × routed_scaling_factor).

The module layout is DeepSeek's own (q_a_proj, kv_b_proj, ...), so `ModelConfig.arch` is the
model type: extensions that walk Llama's module names (quantization, tensor parallelism) refuse it
by name. The Triton attention backend serves the latent cache: decode steps through
kernels/mla_decode.py, the other steps on the torch path (kv/triton_backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ...errors import ConfigError
from ..config import KVLayout, ModelConfig
from ..family import Family
from ..hf_config import llama_config_from_hf
from ..hf_fields import LLAMA_FIELDS, implemented, inert
from ..llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from ..mla import MLAConfig, MLAttention, deepseek_softmax_scale
from ..moe import is_moe_layer, split_stacked_experts
from ..moe_shared import DeepseekMoE, DeepseekRouting


@dataclass(frozen=True)
class DeepseekOptions:
    """What DeepSeek adds to a Llama config: MLA's widths, and how the expert layers route (None:
    every layer dense). Which layers have experts: ModelConfig.mlp_only_layers, the first
    first_k_dense_replace."""

    mla: MLAConfig
    routing: DeepseekRouting | None = None

    @property
    def kv_layout(self) -> KVLayout:
        """The cache holds MLA's latent (ModelConfig.kv_layout reads this)."""
        return self.mla.kv_layout


def _mla_config(cfg: dict[str, Any], hf_type: str) -> MLAConfig:
    interleave = True if hf_type == "deepseek_v2" else cfg["rope_interleave"]
    return MLAConfig(kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                     qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                     q_lora_rank=cfg["q_lora_rank"], rope_interleave=bool(interleave),
                     attention_bias=bool(cfg["attention_bias"]))


def _check_heads(cfg: dict[str, Any], hf_type: str) -> int:
    """num_attention_heads, with num_key_value_heads equal to it (or absent): each MLA head expands
    the shared latent into its own key and value, and HF's code fails with any other count."""
    n_heads = int(cfg["num_attention_heads"])
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != n_heads:
        raise ConfigError(f"{hf_type} config field num_key_value_heads={kv_heads!r} is not "
                          "supported (MLA expands the latent into one key and value per query "
                          f"head); supported: None or num_attention_heads={n_heads}")
    return n_heads


def _check_rope(cfg: dict[str, Any], hf_type: str) -> None:
    """RoPE must turn the whole qk_rope_head_dim part (HF's DeepSeek code has no partial RoPE)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1.0):
        raise ConfigError(f"{hf_type} config field rope_parameters.partial_rotary_factor="
                          f"{partial!r} is not supported (RoPE over part of qk_rope_head_dim); "
                          "supported: 1.0")


def _experts(cfg: dict[str, Any], hf_type: str, n_layers: int) -> dict[str, Any]:
    """The ModelConfig fields of DeepSeek's expert layers, from first_k_dense_replace on (none
    when it covers every layer), and their routing under the key "routing"."""
    dense = int(cfg["first_k_dense_replace"])
    if dense < 0:
        raise ConfigError(f"{hf_type} config field first_k_dense_replace={dense} must be >= 0")
    if dense >= n_layers:
        return dict(routing=None)
    top_k = cfg.get("num_experts_per_tok")
    if type(top_k) is not int:
        raise ConfigError(f"{hf_type} config field num_experts_per_tok={top_k!r} must be an "
                          f"integer when layers {dense}..{n_layers - 1} hold experts "
                          f"(first_k_dense_replace={dense})")
    v3 = hf_type == "deepseek_v3"
    routing = DeepseekRouting(n_shared_experts=int(cfg["n_shared_experts"]),
                              topk_method="noaux_tc" if v3 else cfg["topk_method"],
                              n_group=cfg.get("n_group") or 1,
                              topk_group=cfg.get("topk_group") or 1,
                              routed_scaling_factor=cfg["routed_scaling_factor"])
    # (HF's V2 router never renormalises the k weights, whatever norm_topk_prob says)
    return dict(routing=routing, num_experts=int(cfg["n_routed_experts"]),
                num_experts_per_tok=top_k, moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=v3 and bool(cfg["norm_topk_prob"]),
                mlp_only_layers=list(range(dense)) or None)


def deepseek_config(cfg: dict[str, Any], hf_type: str) -> ModelConfig:
    """The HF dictionary (defaults filled in) -> a Llama config with MLA in family_options."""
    n_heads = _check_heads(cfg, hf_type)
    _check_rope(cfg, hf_type)
    mla = _mla_config(cfg, hf_type)
    experts = _experts(cfg, hf_type, int(cfg["num_hidden_layers"]))
    routing = experts.pop("routing")
    # read as a Llama whose "heads" are the RoPE parts: head_dim = qk_rope_head_dim, as HF's config
    # sets it, so the RoPE frequencies (and YaRN's) span d_rope; the attention's own biases are
    # MLA's (MLAConfig.attention_bias), not Llama's q/k/v/o ones
    as_llama = {**cfg, "num_key_value_heads": n_heads, "head_dim": mla.qk_rope_head_dim,
                "attention_bias": False}
    base = llama_config_from_hf(as_llama, "llama")
    mlp_bias = hf_type == "deepseek_v2" and bool(cfg.get("mlp_bias", False))
    return replace(base, arch=hf_type, hf_model_type=hf_type, bos_in_prompts=True,
                   mlp_bias=mlp_bias,
                   attn_scale=deepseek_softmax_scale(mla, base.rope_scaling),
                   family_options=DeepseekOptions(mla=mla, routing=routing), **experts)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with multi-head latent attention; in an expert layer the MLP is
    DeepSeek's MoE block. (The Llama layer first builds moe.py's block there; it is replaced
    before any weight is read.)"""

    attention_class = MLAttention

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        if is_moe_layer(cfg, layer_idx):
            self.mlp = DeepseekMoE(cfg, cfg.family_options.routing)


class DeepseekModel(LlamaModel):
    layer_class = DeepseekDecoderLayer


class DeepseekForCausalLM(LlamaForCausalLM):
    model_class = DeepseekModel


def rename(cfg: ModelConfig, tensors: dict) -> dict:
    """A state dict saved with the experts stacked (transformers 5's layout) read one expert at a
    time; save_pretrained's per-expert names pass through."""
    if not cfg.num_experts:
        return tensors
    return split_stacked_experts(tensors, cfg.hidden_size, cfg.moe_intermediate_size)


_SHARED_FIELDS = {
    **LLAMA_FIELDS,
    "num_key_value_heads": implemented("must equal num_attention_heads (or be None): each head "
                                       "expands the latent into its own key and value"),
    "head_dim": inert("HF's config sets it to qk_rope_head_dim whatever the file says; nanoserve "
                      "reads qk_rope_head_dim"),
    "qk_head_dim": inert("HF derives it: qk_nope_head_dim + qk_rope_head_dim"),
    "attention_bias": implemented("biases on q_a_proj, kv_a_proj_with_mqa and o_proj (q_proj, "
                                  "q_b_proj and kv_b_proj never have one)"),
    "rope_parameters": implemented("RoPE base and scaling over qk_rope_head_dim (default, linear, "
                                   "llama3, yarn with DeepSeek's mscale / mscale_all_dim, "
                                   "dynamic); partial_rotary_factor other than 1 is refused"),
    "kv_lora_rank": implemented("r: the latent's width, what the KV cache holds per token with "
                                "the RoPE key"),
    "q_lora_rank": implemented("q through q_a_proj, q_a_layernorm and q_b_proj of this width; "
                               "None: q_proj"),
    "qk_nope_head_dim": implemented("each head's q and k width without RoPE"),
    "qk_rope_head_dim": implemented("each head's rotated q width and the shared RoPE key's"),
    "v_head_dim": implemented("each head's value width"),
    "first_k_dense_replace": implemented("layers before it have a dense MLP, the others "
                                         "DeepSeek's experts"),
    "moe_intermediate_size": implemented("each routed expert's MLP width (the shared experts': "
                                         "× n_shared_experts)"),
    "n_routed_experts": implemented("routed experts per expert layer"),
    "n_shared_experts": implemented("experts every token runs, held as one MLP that many times "
                                    "as wide"),
    "num_experts_per_tok": implemented("k: the routed experts each token runs"),
    "routed_scaling_factor": implemented("the routed experts' weights × this"),
    "n_group": implemented("the routed experts split into this many groups for group-limited "
                           "routing"),
    "topk_group": implemented("the groups each token's experts may come from"),
    "output_router_logits": inert("what HF's forward returns besides the logits"),
}

DEEPSEEK_V2_FIELDS = {
    **_SHARED_FIELDS,
    "mlp_bias": implemented("biases on the gate, up and down projections of the dense MLPs "
                            "and the shared experts"),
    "topk_method": implemented("the routed experts: top k of the softmax scores (greedy), or "
                               "of the topk_group best groups' (group_limited_greedy)",
                               ("greedy", "group_limited_greedy")),
    "norm_topk_prob": inert("HF's DeepSeek-V2 router never renormalises the k weights"),
}

DEEPSEEK_V3_FIELDS = {
    **_SHARED_FIELDS,
    "rope_interleave": implemented("RoPE turns neighbouring pairs (True) or halves (False) of "
                                   "the rotated parts"),
    "num_nextn_predict_layers": inert("multi-token prediction modules: checkpoint weights HF's "
                                      "forward never runs"),
    "mlp_bias": inert("DeepSeek-V3's MLPs never have biases"),
    "norm_topk_prob": implemented("renormalise the k routed weights to sum to 1 (before "
                                  "routed_scaling_factor)"),
}

_SHARED_DEFAULTS = dict(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, rms_norm_eps=1e-6,
                        attention_bias=False, tie_word_embeddings=False, hidden_act="silu")

FAMILIES = (
    Family(
        model_type="deepseek_v2",
        architectures=("DeepseekV2ForCausalLM",),
        hf_config_class="DeepseekV2Config",
        fields=DEEPSEEK_V2_FIELDS,
        config=lambda cfg: deepseek_config(cfg, "deepseek_v2"),
        model_class=DeepseekForCausalLM,
        rename=rename,
        defaults=dict(_SHARED_DEFAULTS, vocab_size=102400, hidden_size=4096,
                      intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      max_position_embeddings=2048, first_k_dense_replace=0, mlp_bias=False,
                      n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1407,
                      routed_scaling_factor=1.0, topk_method="greedy", n_group=None,
                      topk_group=None, num_experts_per_tok=None, norm_topk_prob=False,
                      bos_token_id=1, eos_token_id=2),
        name="DeepSeek-V2",
        summary="Llama + multi-head latent attention (a latent KV cache, a shared RoPE key) + "
                "DeepSeekMoE (shared experts, greedy / group-limited routing)",
    ),
    Family(
        model_type="deepseek_v3",
        architectures=("DeepseekV3ForCausalLM",),
        hf_config_class="DeepseekV3Config",
        fields=DEEPSEEK_V3_FIELDS,
        config=lambda cfg: deepseek_config(cfg, "deepseek_v3"),
        model_class=DeepseekForCausalLM,
        rename=rename,
        defaults=dict(_SHARED_DEFAULTS, vocab_size=129280, hidden_size=7168,
                      intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
                      num_key_value_heads=128, max_position_embeddings=4096,
                      first_k_dense_replace=3, rope_interleave=True, n_routed_experts=256,
                      n_shared_experts=1, moe_intermediate_size=2048, routed_scaling_factor=2.5,
                      n_group=8, topk_group=4, num_experts_per_tok=8, norm_topk_prob=True,
                      bos_token_id=0, eos_token_id=1),
        name="DeepSeek-V3",
        summary="DeepSeek-V2's MLA (rope_interleave) + MoE routed by sigmoid scores with "
                "e_score_correction_bias, grouped",
    ),
)
