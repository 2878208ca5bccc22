"""Which Hugging Face config.json fields change what a model computes, and what nanoserve does with
each.

No checkpoint may load and then compute something else. So every field of the HF config classes
of the families nanoserve runs (GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config) is
listed here as one of
- implemented: config.py reads it and the model computes what transformers computes (for the
  values in `allowed`, when the field lists them; any other value is refused by name),
- refused: nanoserve computes only the values in `allowed` (HF's default first; for the fields
  that only mean something together, Llama's sliding-window ones, `check_hf_fields` decides); any
  other value makes loading fail with a ConfigError that names the field,
- inert: it does not change the logits at inference, with the reason (dropout, random init, what
  HF's forward returns besides logits, ...).
tests/test_config_fields.py checks that every key of the installed transformers' config classes
is listed (a field added by a new release fails the tests until someone decides), and matches each
implemented field against transformers. Keys that are in no table are ones transformers' model
code for the family does not read either, so they are ignored. config.py calls `check_hf_fields`
before it reads a config.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import ConfigError

IMPLEMENTED, REFUSED, INERT = "implemented", "refused", "inert"

# transformers' ACT2FN names whose math models/layers.py implements (its `ACTIVATION_FNS`).
# "gelu_fast" computes tanh(0.7978845608·x·(1 + 0.044715·x²)): the tanh form of "gelu_new" with
# √(2/π) rounded to 10 digits, so one function serves all four tanh spellings.
ACTIVATIONS = ("gelu", "gelu_python", "gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh",
               "gelu_fast",
               "quick_gelu", "relu", "silu", "swish")


class Field(NamedTuple):
    kind: str  # IMPLEMENTED | REFUSED | INERT
    why: str
    allowed: tuple = ()  # the values nanoserve computes correctly; () = no list to check against


def implemented(why: str, allowed: tuple = ()) -> Field:
    return Field(IMPLEMENTED, why, allowed)


def refused(why: str, *allowed: Any) -> Field:
    return Field(REFUSED, why, allowed)


def inert(why: str) -> Field:
    return Field(INERT, why)


_RETURNS = "what HF's forward returns besides the logits"
DROPOUT = "dropout is off at inference"

# Fields every transformers config carries (PreTrainedConfig).
COMMON = {
    "architectures": implemented("picks the model family (config.SUPPORTED_ARCHITECTURES)"),
    "model_type": implemented("picks the family when `architectures` is absent, and this table"),
    "bos_token_id": implemented("where generation starts (not the logits)"),
    "eos_token_id": implemented("where generation stops (not the logits)"),
    "tie_word_embeddings": implemented("the LM head is the token embedding matrix"),
    "dtype": inert("the dtype the weights were saved in; nanoserve computes in the dtype it is "
                   "asked for"),
    "torch_dtype": inert("transformers 4's name for `dtype`"),
    "transformers_version": inert("which transformers wrote the file"),
    "_name_or_path": inert("where transformers loaded the config from"),
    "output_hidden_states": inert(_RETURNS),
    "output_attentions": inert(_RETURNS),
    "return_dict": inert(_RETURNS),
    "use_cache": inert("switches HF's own KV cache; logits with and without a cache are the same"),
    "initializer_range": inert("the random init, which the checkpoint's weights replace"),
    "pad_token_id": inert("the embedding row training keeps fixed; looking tokens up is unchanged"),
    "chunk_size_feed_forward": inert("chunks the MLP over positions (same result); these models "
                                     "never do"),
    "is_encoder_decoder": inert("read by generate() only; these model classes are decoder-only"),
    "id2label": inert("labels of classification heads"),
    "label2id": inert("labels of classification heads"),
    "problem_type": inert("the loss of classification heads"),
}

GPT2_FIELDS = {
    **COMMON,
    "vocab_size": implemented("rows of the token embedding and of the LM head"),
    "n_positions": implemented("rows of the learned position embedding"),
    "n_embd": implemented("hidden size"),
    "n_layer": implemented("number of blocks"),
    "n_head": implemented("attention heads (head_dim = n_embd / n_head)"),
    "n_inner": implemented("MLP width; None means 4·n_embd"),
    "layer_norm_epsilon": implemented("LayerNorm epsilon"),
    "activation_function": implemented("the MLP's activation", ACTIVATIONS),
    "scale_attn_weights": implemented("scores × 1/√head_dim; False leaves them unscaled"),
    "scale_attn_by_inverse_layer_idx": implemented("scores of layer i also × 1/(i+1)"),
    "reorder_and_upcast_attn": inert("the same scores computed in fp32 with the scale applied "
                                     "first: it changes rounding in fp16 training, not the math"),
    "add_cross_attention": refused("cross-attention to an encoder's states: the decoder half of an "
                                   "encoder-decoder model, which nanoserve does not run", False),
    "resid_pdrop": inert(DROPOUT),
    "embd_pdrop": inert(DROPOUT),
    "attn_pdrop": inert(DROPOUT),
    "summary_first_dropout": inert(DROPOUT),
    "summary_type": inert("GPT2DoubleHeadsModel's multiple-choice head"),
    "summary_use_proj": inert("GPT2DoubleHeadsModel's multiple-choice head"),
    "summary_activation": inert("GPT2DoubleHeadsModel's multiple-choice head"),
    "summary_proj_to_labels": inert("GPT2DoubleHeadsModel's multiple-choice head"),
    # not in GPT2Config().to_dict(), but in older config.json files
    "hidden_size": implemented("transformers' alias of n_embd"),
    "num_hidden_layers": implemented("transformers' alias of n_layer"),
    "num_attention_heads": implemented("transformers' alias of n_head"),
    "max_position_embeddings": implemented("transformers' alias of n_positions"),
    "n_ctx": inert("old name of the context size; transformers reads n_positions"),
    "summary_last_dropout": inert(DROPOUT),
    "task_specific_params": inert("generate() defaults for pipelines"),
}

# Llama and Qwen2 share these.
_DECODER = {
    **COMMON,
    "vocab_size": implemented("rows of the token embedding and of the LM head"),
    "hidden_size": implemented("hidden size"),
    "intermediate_size": implemented("MLP width"),
    "num_hidden_layers": implemented("number of blocks"),
    "num_attention_heads": implemented("query heads"),
    "num_key_value_heads": implemented("key/value heads (grouped-query attention); None means all"),
    "hidden_act": implemented("the gate's activation in the gated MLP: act(gate(x)) · up(x)",
                              ACTIVATIONS),
    "max_position_embeddings": implemented("the longest context (RoPE itself has no table)"),
    "rms_norm_eps": implemented("RMSNorm epsilon"),
    "rope_parameters": implemented("RoPE base (rope_theta) and scaling: default, linear, llama3, "
                                   "yarn, dynamic (and Phi-3's longrope); others are refused "
                                   "(config.SUPPORTED_ROPE_TYPES)"),
    "rope_theta": implemented("transformers 4's place for the RoPE base"),
    "rope_scaling": implemented("transformers 4's place for the RoPE scaling"),
    "partial_rotary_factor": refused("rotating only part of each head", None, 1.0),
    # not a Qwen2Config field, but Qwen2's code reads it with getattr as Llama's does
    "head_dim": implemented("per-head width; None means hidden_size / num_attention_heads"),
    "attention_dropout": inert(DROPOUT),
}

LLAMA_FIELDS = {
    **_DECODER,
    "attention_bias": implemented("biases on q, k, v and o projections"),
    "mlp_bias": implemented("biases on the gate, up and down projections"),
    "pretraining_tp": inert("transformers 4 split each projection into this many slices and summed "
                            "them: the same product in another order; transformers 5 ignores it"),
    # not LlamaConfig fields, but transformers' cache reads them from any config and then keeps only
    # the last `sliding_window` keys while the Llama mask attends to all: no one result to match.
    "sliding_window": refused("a sliding attention window", None),
    "layer_types": refused("per-layer attention kinds; only 'full_attention' is supported"),
}

# Qwen2 and Qwen3 slide a window over the layers `layer_types` marks (hf_config._windows).
_QWEN_WINDOWS = {
    "use_sliding_window": implemented("turns the sliding window on"),
    "sliding_window": implemented("the window: a query at position p sees keys p − w + 1 .. p"),
    "max_window_layers": implemented("without layer_types, layers from this index on slide"),
    "layer_types": implemented("per-layer attention kinds: 'full_attention' or "
                               "'sliding_attention'"),
}

QWEN2_FIELDS = {
    **_DECODER,
    **_QWEN_WINDOWS,
    # not Qwen2Config fields: Qwen2's code gives q, k, v a bias and o and the MLP none, whatever
    # they say
    "attention_bias": inert("Qwen2 always has q/k/v biases and no o bias"),
    "mlp_bias": inert("Qwen2's MLP never has biases"),
}

QWEN3_FIELDS = {
    **_DECODER,
    **_QWEN_WINDOWS,
    "attention_bias": implemented("biases on q, k, v and o projections"),
    "mlp_bias": inert("Qwen3's MLP never has biases"),
}

MISTRAL_FIELDS = {
    **_DECODER,
    "sliding_window": implemented("the window of every layer (null: none): a query at p sees keys "
                                  "p − w + 1 .. p"),
    # not MistralConfig fields; Mistral's code reads neither
    "layer_types": refused("per-layer attention kinds: Mistral's code slides every layer or none "
                           "(Ministral's alternates; a different model)", None),
    "attention_bias": inert("Mistral's projections never have biases"),
    "mlp_bias": inert("Mistral's MLP never has biases"),
}

# Gemma 2 and 3: the Llama fields, their activation under another name, and what the sandwich block
# adds.
GEMMA2_FIELDS = {
    **_DECODER,
    "hidden_activation": implemented("the gate's activation in the gated MLP (GeGLU by default)",
                                     ACTIVATIONS),
    "hidden_act": inert("Gemma's code reads hidden_activation"),
    "head_dim": implemented("per-head width; 256 when absent"),
    "attention_bias": implemented("biases on q, k, v and o projections"),
    "query_pre_attn_scalar": implemented("scores × query_pre_attn_scalar^−½ (not head_dim^−½)"),
    "attn_logit_softcapping": implemented("scores -> c·tanh(scores / c) before the softmax (null: "
                                          "none)"),
    "final_logit_softcapping": implemented("logits -> c·tanh(logits / c) (null: none)"),
    "sliding_window": implemented("the window of the sliding layers"),
    "layer_types": implemented("which layers slide; without it every second layer, from layer 0"),
    "use_bidirectional_attention": refused("queries attending to later keys (EmbeddingGemma, an "
                                           "encoder)", None, False),
    "mlp_bias": inert("Gemma's MLP never has biases"),
}

GEMMA3_FIELDS = {
    **GEMMA2_FIELDS,
    "rope_parameters": implemented("one RoPE per layer type: full_attention's base and scaling, "
                                   "sliding_attention's base (its scaling is refused)"),
    "rope_local_base_freq": implemented("transformers 4's place for the sliding layers' RoPE base"),
    "sliding_window_pattern": implemented("transformers 4: without layer_types, every n-th layer "
                                          "is global"),
    "_sliding_window_pattern": inert("transformers 5 keeps the pattern it read; layer_types holds "
                                     "the result"),
    "layer_types": implemented("which layers slide; without it all but every "
                               "sliding_window_pattern-th"),
    "attn_logit_softcapping": inert("Gemma 3's attention keeps it but never applies it (unlike "
                                    "Gemma 2's)"),
}

SMOLLM3_FIELDS = {
    **_DECODER,
    "attention_bias": implemented("biases on q, k, v and o projections"),
    "mlp_bias": implemented("biases on the gate, up and down projections"),
    "no_rope_layers": implemented("per layer, 1: rotate q and k, 0: no position encoding at all "
                                  "(NoPE)"),
    "no_rope_layer_interval": implemented("without no_rope_layers, every n-th layer is a NoPE "
                                          "layer"),
    "use_sliding_window": implemented("turns the sliding window on"),
    "sliding_window": implemented("the window: a query at position p sees keys p − w + 1 .. p"),
    "layer_types": implemented("which layers slide; without it the NoPE layers, when the window "
                               "is on"),
}

OLMO2_FIELDS = {
    **_DECODER,
    "attention_bias": implemented("biases on q, k, v and o projections"),
    "mlp_bias": inert("OLMo 2's MLP never has biases"),
}

PHI3_FIELDS = {
    **_DECODER,
    "rope_parameters": implemented("RoPE base, partial_rotary_factor and LongRoPE (its short "
                                   "factors and attention factor; the context is kept within "
                                   "original_max_position_embeddings)"),
    "partial_rotary_factor": implemented("RoPE rotates the first head_dim · this dims of each "
                                         "head"),
    "original_max_position_embeddings": implemented("LongRoPE's pretraining context; nanoserve's "
                                                    "context limit"),
    "sliding_window": implemented("the window of every layer (null: none)"),
    "resid_pdrop": inert(DROPOUT),
    "embd_pdrop": inert(DROPOUT),
    "attention_bias": inert("Phi-3's projections never have biases"),
    "mlp_bias": inert("Phi-3's MLP never has biases"),
}

_ROUTER_TRAINING = {
    "output_router_logits": inert(_RETURNS),
    "router_aux_loss_coef": inert("the load-balancing loss, a training term"),
}

MIXTRAL_FIELDS = {
    **MISTRAL_FIELDS,
    **_ROUTER_TRAINING,
    "num_local_experts": implemented("experts per layer"),
    "num_experts_per_tok": implemented("k: the experts each token runs (weights renormalised to "
                                       "sum to 1)"),
    "router_jitter_noise": inert("multiplies the router's input by noise in training only"),
}

QWEN3_MOE_FIELDS = {
    **QWEN3_FIELDS,
    **_ROUTER_TRAINING,
    "sliding_window": implemented("with use_sliding_window, the window of every layer"),
    "max_window_layers": inert("Qwen3-MoE's code slides every layer or none; it reads neither "
                               "field"),
    "layer_types": inert("Qwen3-MoE's code slides every layer or none; it reads neither field"),
    "num_experts": implemented("experts per sparse layer"),
    "num_local_experts": implemented("transformers' alias of num_experts"),
    "num_experts_per_tok": implemented("k: the experts each token runs"),
    "moe_intermediate_size": implemented("each expert's MLP width"),
    "norm_topk_prob": implemented("renormalise the k router probabilities to sum to 1"),
    "decoder_sparse_step": implemented("experts in layers i with (i + 1) % step == 0; the others "
                                       "dense"),
    "mlp_only_layers": implemented("layers that keep a dense MLP of intermediate_size"),
}

HF_FIELDS = {"gpt2": GPT2_FIELDS, "llama": LLAMA_FIELDS, "mistral": MISTRAL_FIELDS,
             "qwen2": QWEN2_FIELDS,
             "qwen3": QWEN3_FIELDS, "gemma2": GEMMA2_FIELDS, "gemma3_text": GEMMA3_FIELDS,
             "smollm3": SMOLLM3_FIELDS,
             "olmo2": OLMO2_FIELDS, "phi3": PHI3_FIELDS, "mixtral": MIXTRAL_FIELDS,
             "qwen3_moe": QWEN3_MOE_FIELDS}


def check_hf_fields(hf_type: str, cfg: dict[str, Any]) -> None:
    """Raise a ConfigError naming the first field of `cfg` whose value nanoserve would compute
    wrongly."""
    from .family import family_of  # (the registry imports the families' modules)

    family = family_of(hf_type)
    table = family.fields if family is not None else HF_FIELDS[hf_type]
    for name, f in table.items():
        if f.allowed and name in cfg and cfg[name] not in f.allowed:
            raise ConfigError(f"{hf_type} config field {name}={cfg[name]!r} is not supported "
                              f"({f.why}); supported: {', '.join(repr(v) for v in f.allowed)}")
    if hf_type == "gpt2" or family is not None:  # (a family's module checks its own RoPE)
        return
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("partial_rotary_factor", 1.0) != 1.0 and hf_type != "phi3":
        raise ConfigError(
            f"{hf_type} config field rope_parameters.partial_rotary_factor="
            f"{rope['partial_rotary_factor']!r} is not supported (rotating only part of each "
            "head); supported: 1.0"
        )
    if hf_type == "llama" and (cfg.get("sliding_window") is not None
                               or any(t != "full_attention" for t in cfg.get("layer_types") or [])):
        raise ConfigError(
            "llama config asks for sliding-window attention "
            f"(sliding_window={cfg.get('sliding_window')!r}, "
            f"layer_types={cfg.get('layer_types')!r}), which Llama's mask ignores while "
            "transformers' cache keeps only the window's keys: no one result to match; supported: "
            "sliding_window None (a windowed Llama-style checkpoint is a Mistral: architectures "
            "['MistralForCausalLM'])")
