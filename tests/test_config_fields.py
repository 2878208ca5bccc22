"""No checkpoint loads and then computes something else: each HF config field that changes the math.

nanoserve/models/hf_fields.py classifies every field of GPT2Config, LlamaConfig, MistralConfig,
Qwen2Config and Qwen3Config. Here:
(a) MATCHED: a tiny random checkpoint (docs/TESTING.md §A randomisation) with one field changed
gives
    nanoserve logits within TOL of transformers' (eager attention, fp32), for the prompt and for
    each cached decode step; REFUSED: a config nanoserve cannot compute fails with a ConfigError
    naming the field. Sliding-window cases run ≥ 3× the window, so a window would show.
(b) every key of the installed transformers' config classes is classified (a field a new release
    adds fails here until someone decides), and every non-inert field is exercised by a case;
(c) negative controls: a model that ignores a field fails the same check;
(d) checkpoints stored as pytorch_model.bin (one file or sharded) load and match transformers.

Weights are drawn with std 0.1 (initializer_range), not HF's 0.02: with tiny weights attention
scores and MLP inputs stay near 0, where a missing 1/(i+1) or tanh- instead of erf-GELU moves the
logits by < 1e-5 and no tolerance could tell. Measured here: correct models |Δ| ~1e-6.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from testdata import tiny_hf_checkpoint

from nanoserve import CheckpointError, ConfigError
from nanoserve.kv import KVCache
from nanoserve.models.hf_fields import ACTIVATIONS, HF_FIELDS, INERT
from nanoserve.models.layers import ACTIVATION_FNS, RMSNorm, gelu_tanh
from nanoserve.models.llama import LlamaDecoderLayer
from nanoserve.models.loader import build_from_tensors, load_model, read_hf_config, read_weights_dir

# tiny tensors: a second thread only adds latency
pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4  # docs/TESTING.md §A: fp32 logits differ only by summation order, ~1e-6 at these sizes
WINDOW = 4
T, PREFILL = 6 * WINDOW, 8  # 8 prompt tokens, then 16 single-token decode steps
DROP = object()  # in a case's json edits: remove the key from config.json

CLASSES = {"gpt2": transformers.GPT2Config, "llama": transformers.LlamaConfig,
           "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "gemma2": transformers.Gemma2Config,
           "gemma3_text": transformers.Gemma3TextConfig, "smollm3": transformers.SmolLM3Config,
           "olmo2": transformers.Olmo2Config, "phi3": transformers.Phi3Config,
           "mixtral": transformers.MixtralConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig}
_SMALL = dict(vocab_size=257, initializer_range=0.1, bos_token_id=0, eos_token_id=1)
_DECODER = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, **_SMALL)
BASE = {"gpt2": dict(n_layer=2, n_embd=32, n_head=4, n_positions=64, **_SMALL), "llama": _DECODER,
        "mistral": dict(_DECODER, sliding_window=None), "qwen2": _DECODER, "qwen3": _DECODER,
        "gemma2": dict(_DECODER, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8),
        "gemma3_text": dict(_DECODER, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=8),
        "smollm3": dict(_DECODER, num_hidden_layers=4, pad_token_id=0),
        "olmo2": dict(_DECODER, pad_token_id=0),
        "phi3": dict(_DECODER, pad_token_id=0),
        "mixtral": dict(_DECODER, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0),
        "qwen3_moe": dict(_DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                          pad_token_id=0)}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.9],
            "long_factor": [3.0, 4.0, 5.0]}
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          # short original: every band used
          "original_max_position_embeddings": 16, "rope_theta": 500000.0}
SLIDING = dict(use_sliding_window=True, sliding_window=WINDOW)

# (id, family, HF config kwargs, edits to the saved config.json): nanoserve must match transformers
MATCHED = [
    *[(f"gpt2-{act}", "gpt2", dict(activation_function=act), {}) for act in ACTIVATIONS],
    ("gpt2-unscaled", "gpt2", dict(scale_attn_weights=False), {}),
    ("gpt2-inverse-layer-idx", "gpt2", dict(scale_attn_by_inverse_layer_idx=True), {}),
    ("gpt2-both-scalings-reordered", "gpt2",
     dict(scale_attn_weights=False, scale_attn_by_inverse_layer_idx=True,
                                                   reorder_and_upcast_attn=True), {}),
    ("gpt2-untied-n-inner-eps", "gpt2",
     dict(tie_word_embeddings=False, n_inner=40, layer_norm_epsilon=0.1), {}),
    ("gpt2-inert", "gpt2",
     dict(resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5, summary_first_dropout=0.5,
                                use_cache=False, pad_token_id=3), {}),
    ("gpt2-old-names", "gpt2", {},
     {"n_embd": DROP, "hidden_size": 32, "n_layer": DROP, "num_hidden_layers": 2,
                                    "n_head": DROP, "num_attention_heads": 4, "n_positions": DROP,
                                    "max_position_embeddings": 64, "n_ctx": 64, "dtype": DROP,
                                    "torch_dtype": "float32"}),
    ("llama-biases", "llama", dict(attention_bias=True, mlp_bias=True), {}),
    ("llama-head-dim-tied-eps", "llama",
     dict(head_dim=12, tie_word_embeddings=True, rms_norm_eps=0.1), {}),
    ("llama-mha-gelu", "llama", dict(num_key_value_heads=4, hidden_act="gelu"), {}),
    ("llama-rope-linear", "llama",
     dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}), {}),
    ("llama-rope-llama3", "llama", dict(rope_parameters=dict(LLAMA3)), {}),
    ("llama-rope-transformers4", "llama", dict(rope_parameters=dict(LLAMA3)),
     {"rope_parameters": DROP, "rope_theta": 500000.0,
      "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}}),
    # YaRN from a short original context (every band used), with its defaults and with every knob
    # set; dynamic NTK changes nothing within max_position_embeddings, nanoserve's context limit
    ("llama-rope-yarn", "llama",
     dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                       "original_max_position_embeddings": 16}), {}),
    ("llama-rope-yarn-knobs", "llama", dict(rope_parameters={
        "rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4,
        "original_max_position_embeddings": 8, "beta_fast": 16,
        "beta_slow": 2, "mscale": 2.0, "mscale_all_dim": 1.0, "truncate": False}), {}),
    ("qwen2-rope-dynamic", "qwen2",
     dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     {}),
    ("llama-inert", "llama",
     dict(pretraining_tp=2, attention_dropout=0.5, partial_rotary_factor=1.0), {}),
    ("qwen2-head-dim-eps", "qwen2",
     dict(head_dim=12, rms_norm_eps=0.1, hidden_act="gelu_pytorch_tanh"), {}),
    ("qwen2-ignores-llama-biases", "qwen2", dict(attention_bias=True, mlp_bias=True), {}),
    # the window is switched on, but max_window_layers = the layer count leaves no layer sliding
    ("qwen2-window-in-no-layer", "qwen2", dict(max_window_layers=2, **SLIDING), {}),
    ("qwen2-window-in-no-layer-transformers4", "qwen2", dict(max_window_layers=2, **SLIDING),
     {"layer_types": DROP}),
    # a Qwen2.5 config.json as transformers 4 wrote it: a window length, switched off
    ("qwen2-window-off-transformers4", "qwen2", {}, {"layer_types": DROP, "sliding_window": 32768,
                                                     "max_window_layers": 0,
                                                     "use_sliding_window": False}),
    ("qwen2-tied", "qwen2", dict(tie_word_embeddings=True, attention_dropout=0.5), {}),
    # sliding windows (Mistral in every layer; Qwen2/3 from max_window_layers on, or where
    # layer_types says)
    ("qwen2-sliding", "qwen2", dict(max_window_layers=1, **SLIDING), {}),
    ("qwen2-sliding-transformers4", "qwen2", dict(max_window_layers=0, **SLIDING),
     {"layer_types": DROP}),
    ("qwen2-sliding-layer-types", "qwen2",
     dict(layer_types=["sliding_attention", "full_attention"], **SLIDING), {}),
    ("mistral-window", "mistral", dict(sliding_window=WINDOW, head_dim=12), {}),
    # Mistral's code reads neither
    ("mistral-no-window", "mistral", dict(attention_bias=True, mlp_bias=True,
                                          hidden_act="gelu", rms_norm_eps=0.1,
                                          tie_word_embeddings=True), {}),
    ("mistral-rope-transformers4", "mistral",
     dict(sliding_window=WINDOW, rope_parameters=dict(LLAMA3)),
     {"rope_parameters": DROP, "rope_theta": 500000.0,
      "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}}),
    ("mistral-default-window", "mistral", dict(max_position_embeddings=8192), {"sliding_window": DROP}),  # 4096
    ("qwen3-qk-norm", "qwen3", dict(head_dim=12, rms_norm_eps=0.1, mlp_bias=True, hidden_act="gelu",
                                    tie_word_embeddings=True), {}),
    ("qwen3-rope-linear", "qwen3",
     dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}),
     {}),
    ("qwen3-rope-transformers4", "qwen3", dict(rope_parameters=dict(LLAMA3)),
     {"rope_parameters": DROP, "rope_theta": 500000.0,
      "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}}),
    ("qwen3-biases-sliding", "qwen3", dict(attention_bias=True, max_window_layers=1, **SLIDING), {}),
    ("qwen3-sliding-layer-types", "qwen3",
     dict(layer_types=["sliding_attention", "full_attention"], **SLIDING),
     {"max_window_layers": 0}),
    # Gemma 2 / 3: sandwich norms, (1 + w) norms, √d embeddings, query_pre_attn_scalar, soft-caps,
    # windows
    ("gemma2-defaults", "gemma2", {}, {}),  # soft-caps 50 and 30, windows in layer 0
    ("gemma2-soft-caps", "gemma2", dict(attn_logit_softcapping=0.5, final_logit_softcapping=1.5,
                                        query_pre_attn_scalar=3), {}),
    ("gemma2-no-caps-biases", "gemma2",
     dict(attn_logit_softcapping=None, final_logit_softcapping=None,
                                             attention_bias=True, hidden_activation="silu",
          rms_norm_eps=0.1), {}),
    ("gemma2-layer-types-untied", "gemma2",
     dict(layer_types=["full_attention", "sliding_attention"],
                                                 tie_word_embeddings=False, num_key_value_heads=4,
                                                 rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 1e4}), {}),
    ("gemma2-transformers4", "gemma2",
     dict(head_dim=256, num_attention_heads=1, num_key_value_heads=1,
                                            rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
     {"layer_types": DROP, "rope_parameters": DROP, "rope_theta": 500.0, "hidden_act": "gelu",
      "head_dim": DROP}),  # head_dim 256 when absent; hidden_act is not read
    ("gemma3-rope-per-layer-type", "gemma3_text",
     dict(rope_parameters=GEMMA3_ROPE, sliding_window_pattern=2), {}),
    # attn_logit_softcapping is read by Gemma 3's config, never applied by its attention
    ("gemma3-soft-caps-window-all", "gemma3_text",
     dict(attn_logit_softcapping=2.0, final_logit_softcapping=4.0,
                                                        layer_types=["sliding_attention"] * 2), {}),
    ("gemma3-biases-eps-untied", "gemma3_text",
     dict(attention_bias=True, rms_norm_eps=0.1, tie_word_embeddings=False,
                                                     use_bidirectional_attention=False), {}),
    ("gemma2-rope-transformers4", "gemma2",
     dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 1e4}),
     {"rope_parameters": DROP, "rope_theta": 1e4,
      "rope_scaling": {"type": "linear", "factor": 2.0}}),
    ("gemma3-transformers4", "gemma3_text", dict(sliding_window_pattern=2, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 2e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}),
     {"layer_types": DROP, "rope_parameters": DROP, "rope_theta": 2e5, "rope_local_base_freq": 50.0,
      "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "sliding_window_pattern": 2,
      "_sliding_window_pattern": DROP}),
    # SmolLM3: NoPE layers (and its window); OLMo 2: post-norm, whole-projection q/k norms
    ("smollm3-nope", "smollm3", dict(no_rope_layer_interval=2), {}),  # layers 1 and 3 without RoPE
    ("smollm3-window-biases", "smollm3",
     dict(use_sliding_window=True, sliding_window=WINDOW, attention_bias=True,
                                             mlp_bias=True, hidden_act="gelu", rms_norm_eps=0.1,
                                             tie_word_embeddings=False, head_dim=12), {}),
    ("smollm3-explicit-lists", "smollm3", dict(no_rope_layers=[0, 1, 1, 0], use_sliding_window=True,
                                              sliding_window=WINDOW,
                                               layer_types=["sliding_attention", "full_attention"]
                                              * 2,
                                               rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                    "rope_theta": 1e4}), {}),
    ("smollm3-transformers4", "smollm3", dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1e4}),
     {"rope_parameters": DROP, "rope_theta": 1e4,
      "rope_scaling": {"rope_type": "linear", "factor": 2.0},
      "layer_types": DROP}),
    ("olmo2-qk-norm", "olmo2",
     dict(rms_norm_eps=0.1, hidden_act="gelu", tie_word_embeddings=True, head_dim=12), {}),
    # (OLMo 2's MLP reads no mlp_bias)
    ("olmo2-biases", "olmo2", dict(attention_bias=True, mlp_bias=True,
                                   rope_parameters={"rope_type": "llama3",
                                                    **{k: v for k, v in LLAMA3.items()
                                                                              if k != "rope_type"}}), {}),
    ("olmo2-transformers4", "olmo2",
     dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     {"rope_parameters": DROP, "rope_theta": 1e4,
      "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # Phi-3: fused weights, partial RoPE, LongRoPE (short factors, attention factor), a window in
    # every layer
    ("phi3-partial-window", "phi3",
     dict(partial_rotary_factor=0.5, sliding_window=WINDOW, hidden_act="gelu",
                                         rms_norm_eps=0.1, tie_word_embeddings=True,
                                         attention_bias=True, mlp_bias=True, resid_pdrop=0.5), {}),
    ("phi3-longrope", "phi3",
     dict(rope_parameters=dict(LONGROPE, rope_theta=1e4, partial_rotary_factor=0.75),
                                   max_position_embeddings=256,
          original_max_position_embeddings=32), {}),
    ("phi3-su-transformers4", "phi3",
     dict(rope_parameters=dict(LONGROPE, rope_theta=1e4, partial_rotary_factor=0.75),
                                           max_position_embeddings=256,
          original_max_position_embeddings=32),
     {"rope_parameters": DROP, "rope_theta": 1e4,
      "rope_scaling": {"type": "su", **{k: v for k, v in LONGROPE.items()
                                                                                if k != "rope_type"}},
      "partial_rotary_factor": 0.75}),
    ("phi3-default-rope", "phi3",
     dict(head_dim=12, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                        "partial_rotary_factor": 1.0}), {}),
    # mixtures of experts: Mixtral (always renormalised), Qwen3-MoE (norm_topk_prob; dense layers)
    ("mixtral-top1-window", "mixtral",
     dict(num_experts_per_tok=1, sliding_window=WINDOW, router_jitter_noise=0.5,
                                            hidden_act="gelu", rms_norm_eps=0.1,
          tie_word_embeddings=True,
                                            head_dim=12), {}),
    ("mixtral-top3", "mixtral", dict(num_experts_per_tok=3, rope_parameters=dict(LLAMA3)), {}),
    ("mixtral-transformers4", "mixtral", dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 500.0}),
     {"rope_parameters": DROP, "rope_theta": 500.0,
      "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("qwen3-moe-renormalised", "qwen3_moe",
     dict(norm_topk_prob=True, decoder_sparse_step=2, num_experts_per_tok=3,
                                                 attention_bias=True, head_dim=12, rms_norm_eps=0.1,
                                                 hidden_act="gelu", tie_word_embeddings=True), {}),
    # a window in every layer
    ("qwen3-moe-dense-layer-window", "qwen3_moe", dict(mlp_only_layers=[0], **SLIDING,
                                                       rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                        "rope_theta": 1e4}),
     # (read by no code)
     {"max_window_layers": 1, "layer_types": ["full_attention", "sliding_attention"]}),
    ("qwen3-moe-transformers4", "qwen3_moe",
     dict(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 500.0}),
     {"rope_parameters": DROP, "rope_theta": 500.0,
      "rope_scaling": {"rope_type": "linear", "factor": 2.0},
      "num_experts": 4, "num_local_experts": DROP}),
    # keys absent from config.json take each class's own defaults (Mixtral's RoPE base 1e6 and eps
    # 1e-5, Phi-3's eps 1e-5, Gemma 3's per-type bases); YaRN on Gemma 3's global layers leaves the
    # local ones unscaled
    ("mixtral-absent-defaults", "mixtral", {}, {"rms_norm_eps": DROP, "rope_parameters": DROP}),
    ("phi3-absent-eps", "phi3", {}, {"rms_norm_eps": DROP}),
    ("gemma3-absent-bases", "gemma3_text", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}),
     {"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "default"}},
      "rope_local_base_freq": 500.0}),
    ("gemma3-yarn-global", "gemma3_text", dict(rope_parameters={
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                           "original_max_position_embeddings": 16},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}), {}),
    # Phi-3's code takes LongRoPE's original context from the top-level field, whatever
    # rope_parameters says
    ("phi3-original-top-level", "phi3",
     dict(rope_parameters=dict(LONGROPE, rope_theta=1e4, partial_rotary_factor=0.75),
                                             max_position_embeddings=256,
          original_max_position_embeddings=32),
     {"rope_parameters": dict(LONGROPE, rope_theta=1e4, partial_rotary_factor=0.75,
                              original_max_position_embeddings=16)}),
    ("qwen2-rope-oldest-spelling", "qwen2",
     dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}),
     {"rope_parameters": DROP, "rope_theta": 5e5,
      "rope_scaling": {"type": "linear", "factor": 2.0}}),
]

# (id, family, HF config kwargs, edits to the saved config.json, what the error must name)
REFUSED = [
    ("gpt2-cross-attention", "gpt2", dict(add_cross_attention=True), {}, "add_cross_attention"),
    ("gpt2-activation", "gpt2", dict(activation_function="gelu_accurate"), {},
     "activation_function='gelu_accurate'"),
    ("llama-activation", "llama", dict(hidden_act="relu2"), {}, "hidden_act='relu2'"),
    ("llama-rope-type", "llama", {},
     {"rope_parameters": {"rope_type": "mrope", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters"),
    ("llama-partial-rotary", "llama", {}, {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("llama-sliding-window", "llama", dict(sliding_window=WINDOW), {}, "sliding_window"),
    ("llama-layer-types", "llama", dict(layer_types=["full_attention", "sliding_attention"]), {},
     "layer_types"),
    ("qwen2-unknown-layer-type", "qwen2",
     dict(layer_types=["chunked_attention", "full_attention"], **SLIDING), {},
     "layer_types has 'chunked_attention'"),
    ("mixtral-partial-rotary", "mixtral", {}, {"partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("mixtral-layer-types", "mixtral", {}, {"layer_types": ["full_attention", "sliding_attention"]},
     "layer_types"),
    ("qwen3-moe-partial-rotary", "qwen3_moe", {}, {"partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("qwen3-moe-top-k", "qwen3_moe", {}, {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ("phi3-activation", "phi3", dict(hidden_act="relu2"), {}, "hidden_act"),
    ("phi3-short-factors", "phi3", {},
     {"rope_parameters": dict(LONGROPE, short_factor=[1.0], rope_theta=1e4)},
     "short_factor"),
    ("smollm3-sliding-types-window-off", "smollm3",
     dict(layer_types=["sliding_attention", "full_attention"] * 2,
                                                         use_sliding_window=False,
          sliding_window=WINDOW), {},
     "sliding_attention layers in layer_types with the window switched off"),
    ("smollm3-partial-rotary", "smollm3", {}, {"partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("smollm3-no-rope-layers-length", "smollm3", {}, {"no_rope_layers": [1, 0]},
     "no_rope_layers has 2 entries"),
    ("olmo2-partial-rotary", "olmo2", {}, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("olmo2-activation", "olmo2", dict(hidden_act="relu2"), {}, "hidden_act"),
    ("gemma2-bidirectional", "gemma2", dict(use_bidirectional_attention=True), {},
     "use_bidirectional_attention"),
    ("gemma2-partial-rotary", "gemma2", {}, {"partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("gemma3-bidirectional", "gemma3_text", {}, {"use_bidirectional_attention": True},
     "use_bidirectional_attention"),
    ("gemma3-partial-rotary", "gemma3_text", {}, {"partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("gemma3-local-rope-scaled", "gemma3_text", {}, {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "sliding_attention"),
    ("gemma3-activation", "gemma3_text", dict(hidden_activation="gelu_10"), {},
     "hidden_activation"),
    ("mistral-partial-rotary", "mistral", {}, {"partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
    ("qwen3-partial-rotary", "qwen3", {}, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("mistral-layer-types", "mistral", {}, {"layer_types": ["full_attention", "sliding_attention"]},
     "layer_types"),
    ("qwen2-activation", "qwen2", dict(hidden_act="gelu_10"), {}, "hidden_act"),
    ("qwen2-partial-rotary", "qwen2", {}, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
]


def _hf_config(family, kwargs):
    return CLASSES[family](**{**BASE[family], **kwargs})


def _edit_json(path, edits):
    raw = json.loads((path / "config.json").read_text())
    raw.update(edits)
    raw = {k: v for k, v in raw.items() if v is not DROP}
    (path / "config.json").write_text(json.dumps(raw))


def _checkpoint(tmp_path, family, kwargs, edits, seed=0):
    """(HF model, directory): a tiny random checkpoint with `kwargs`, its config.json edited."""
    transformers.logging.set_verbosity_error()
    hf = tiny_hf_checkpoint(_hf_config(family, kwargs), tmp_path, seed, attn_implementation="eager")
    _edit_json(tmp_path, edits)
    return hf, tmp_path


def max_delta(model, cfg, hf, length=T, prefill=PREFILL) -> float:
    """Max |Δ| between nanoserve's logits (prompt, then cached single-token steps) and HF's full
    forward."""
    ids = torch.randint(0, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits  # 1, T, V
        cache = KVCache(cfg, 1, length)
        steps = [model(ids[:, :prefill], cache=cache)] + [model(ids[:, t:t + 1], cache=cache)
                                                           for t in range(prefill, length)]
    return (torch.cat(steps, dim=1) - ref).abs().max().item()


@pytest.mark.parametrize("family, kwargs, edits", [c[1:] for c in MATCHED],
                         ids=[c[0] for c in MATCHED])
def test_field_matches_transformers(tmp_path, family, kwargs, edits):
    hf, path = _checkpoint(tmp_path, family, kwargs, edits)
    model, cfg, _ = load_model(path, dtype="float32", device="cpu")
    assert max_delta(model, cfg, hf) <= TOL


@pytest.mark.parametrize("family, kwargs, edits, names", [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_field_is_refused_by_name(tmp_path, family, kwargs, edits, names):
    _hf_config(family, kwargs).save_pretrained(tmp_path)  # config.json as transformers writes it
    _edit_json(tmp_path, edits)
    with pytest.raises(ConfigError, match=names):
        read_hf_config(tmp_path / "config.json")


def test_round_trip_through_to_hf_config_keeps_every_field(tmp_path):
    """save_checkpoint writes the activation and the GPT-2 scalings back: transformers reloads the
    same model."""
    from nanoserve.models.loader import save_checkpoint

    hf, path = _checkpoint(tmp_path / "in", "gpt2",
                           dict(activation_function="quick_gelu", scale_attn_weights=False,
                                                         scale_attn_by_inverse_layer_idx=True), {})
    model, cfg, _ = load_model(path, dtype="float32", device="cpu")
    save_checkpoint(model, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    assert (again.config.activation_function, again.config.scale_attn_weights) == (
        "quick_gelu",
        False,
    )
    assert max_delta(model, cfg, again) <= TOL


@pytest.mark.parametrize("case_id",
                         ["mistral-window", "qwen2-sliding", "qwen3-biases-sliding",
                          "qwen3-qk-norm",
                                     "gemma2-soft-caps", "gemma3-rope-per-layer-type",
                          "smollm3-explicit-lists",
                                     "olmo2-biases", "phi3-longrope", "phi3-partial-window",
                          "mixtral-top3",
                                     "qwen3-moe-dense-layer-window"])
def test_round_trip_keeps_the_family_and_its_windows(tmp_path, case_id):
    """save_checkpoint names the HF class that computes the same thing (Mistral, Qwen2, Qwen3) with
    its window and layer types: transformers reloads a model nanoserve matches."""
    from nanoserve.models.loader import save_checkpoint

    _, family, kwargs, edits = next(c for c in MATCHED if c[0] == case_id)
    hf, path = _checkpoint(tmp_path / "in", family, kwargs, edits)
    model, cfg, _ = load_model(path, dtype="float32", device="cpu")
    save_checkpoint(model, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    assert type(again) is type(hf)
    assert max_delta(model, cfg, again) <= TOL
    again_cfg = read_hf_config(tmp_path / "out" / "config.json")
    assert (again_cfg.sliding_window, again_cfg.layer_types,
            again_cfg.qk_norm) == (cfg.sliding_window, cfg.layer_types,
                                                                                 cfg.qk_norm)


def test_mistral_without_a_window_key_takes_transformers_default(tmp_path):
    """A Mistral config.json without `sliding_window` gets MistralConfig's default, 4096 (not
    None)."""
    _hf_config("mistral", {}).save_pretrained(tmp_path)
    _edit_json(tmp_path, {"sliding_window": DROP})
    window = read_hf_config(tmp_path / "config.json").sliding_window
    assert window == 4096 == transformers.MistralConfig().sliding_window


# ----------------------------------------------------------------------------- (b) the table is
# complete
@pytest.mark.parametrize("hf_type", sorted(CLASSES))
def test_every_transformers_field_is_classified(hf_type):
    fields = CLASSES[hf_type]().to_dict()
    unclassified = sorted(set(fields) - set(HF_FIELDS[hf_type]))
    assert not unclassified, (f"transformers {transformers.__version__} "
                              f"{CLASSES[hf_type].__name__} has fields {unclassified}: classify "
                              "each in nanoserve/models/hf_fields.py (implemented/refused/inert)")


@pytest.mark.parametrize("hf_type", sorted(CLASSES))
def test_every_field_that_matters_has_a_case(hf_type):
    """A field classified as implemented or refused is set by some case above (or by every case)."""
    exercised = set(BASE[hf_type]) | {"architectures", "model_type"}
    for case in MATCHED + REFUSED:
        if case[1] == hf_type:
            exercised |= set(case[2]) | set(case[3])
    missing = sorted(
        name for name, f in HF_FIELDS[hf_type].items() if f.kind != INERT and name not in exercised
    )
    assert not missing, f"{hf_type} fields with no test case: {missing}"


def test_activation_functions_are_transformers_own():
    """Each name means what transformers' ACT2FN means (pointwise, 1e-6 in fp32); erf and tanh GELU
    differ."""
    from transformers.activations import ACT2FN

    assert set(ACTIVATION_FNS) == set(ACTIVATIONS)
    x = torch.linspace(-8, 8, 4001)
    for name in ACTIVATIONS:
        assert torch.allclose(ACTIVATION_FNS[name](x), ACT2FN[name](x), atol=1e-6, rtol=0), name
    # the one the old code confused
    assert (ACTIVATION_FNS["gelu"](x) - gelu_tanh(x)).abs().max() > 1e-4


# ----------------------------------------------------------------------------- (c) negative
# controls
def _set_all(modules, attr, value):
    for m in modules:
        setattr(m, attr, value)


MUTANTS = {  # case id -> a wrong implementation, made by editing nanoserve's loaded model
    "gpt2-gelu": lambda m: _set_all([b.mlp for b in m.transformer.h], "act", gelu_tanh),
    "gpt2-inverse-layer-idx": lambda m: _set_all([b.attn for b in m.transformer.h], "q_scale", 1.0),
    "gpt2-unscaled": lambda m: _set_all([b.attn for b in m.transformer.h], "q_scale", 1.0),
    "gpt2-untied-n-inner-eps": lambda m: _set_all([x for x in m.modules() if isinstance(x, torch.nn.LayerNorm)],
                                                  "eps", 1e-5),
    "llama-biases": lambda m: [layer.mlp.down_proj.bias.data.zero_() for layer in m.model.layers],
    "llama-head-dim-tied-eps": lambda m: _set_all([x for x in m.modules() if isinstance(x, RMSNorm)], "eps", 1e-6),
    # window off
    "mistral-window": lambda m: _set_all([b.self_attn for b in m.model.layers], "window", None),
    # in every layer
    "qwen2-sliding": lambda m: _set_all([b.self_attn for b in m.model.layers], "window", WINDOW),
    # qk-norm off
    "qwen3-qk-norm": lambda m: _set_all([b.self_attn for b in m.model.layers], "qk_norm", None),
    "qwen3-biases-sliding": lambda m: _set_all([b.self_attn for b in m.model.layers], "window",
                                               WINDOW + 1),
    # cap off
    "gemma2-soft-caps": lambda m: _set_all([b.self_attn for b in m.model.layers], "softcap", None),
    "gemma2-defaults": lambda m: setattr(m.config, "final_softcap", None),  # the final cap off
    "gemma2-no-caps-biases": lambda m: _set_all([x for x in m.modules() if isinstance(x, RMSNorm)],
                                                "unit_offset", False),  # w, not 1 + w
    # Llama's layout: the sandwich layers run as plain pre-norm ones
    "gemma2-layer-types-untied": lambda m: _set_all(m.model.layers, "__class__", LlamaDecoderLayer),
    # one RoPE for all layers
    "gemma3-rope-per-layer-type": lambda m: _set_all(m.model.layers, "rope", "global"),
    "gemma3-soft-caps-window-all": lambda m: setattr(m.model, "embed_scale", None),  # no √d
    "smollm3-nope": lambda m: _set_all(m.model.layers, "rope", "global"),  # RoPE in every layer
    # q/k norms off
    "olmo2-qk-norm": lambda m: _set_all([b.self_attn for b in m.model.layers], "qk_norm", None),
    # LongRoPE's attention factor off
    "phi3-longrope": lambda m: setattr(m.model, "attention_factor", 1.0),
    # YaRN's attention factor off
    "llama-rope-yarn": lambda m: setattr(m.model, "attention_factor", 1.0),
    # the global RoPE in the local layers too
    "gemma3-yarn-global": lambda m: setattr(m.model, "inv_freq", {
        "global": m.model.inv_freq["global"], "local": m.model.inv_freq["global"]}),
    # the ramp ignored: all interpolated
    "llama-rope-yarn-knobs": lambda m: m.model.inv_freq["global"].mul_(
        torch.linspace(1, 1 / 8, len(m.model.inv_freq["global"]))),
    # weights not renormed
    "mixtral-top3": lambda m: _set_all([b.mlp for b in m.model.layers], "renormalize", False),
    "qwen3-moe-renormalised": lambda m: _set_all([b.mlp for b in m.model.layers if hasattr(b.mlp, "experts")],
                                                 "renormalize", False),
    "qwen3-moe-dense-layer-window": lambda m: _set_all([b.mlp for b in m.model.layers if hasattr(b.mlp, "experts")],
                                                       "top_k", 1),  # one expert per token
    "mixtral-top1-window": lambda m: _set_all([b.self_attn for b in m.model.layers], "window", None),
    "phi3-partial-window": lambda m: [f.copy_(torch.cat([f,
                                                         1 / 10000 ** (torch.arange(len(f), 2 * len(f)) / (
        # frequencies spread over the whole head
        4 * len(f)))])[::2]) for f in m.model.inv_freq.values()],
}


@pytest.mark.parametrize("case_id", sorted(MUTANTS))
def test_parity_check_catches_a_model_that_ignores_the_field(tmp_path, case_id):
    _, family, kwargs, edits = next(c for c in MATCHED if c[0] == case_id)
    hf, path = _checkpoint(tmp_path, family, kwargs, edits)
    model, cfg, _ = load_model(path, dtype="float32", device="cpu")
    MUTANTS[case_id](model)
    assert max_delta(model, cfg, hf) > TOL


def test_sliding_window_shows_only_past_the_window(tmp_path):
    """Why the lengths are ≥ 3× the window: full attention on Qwen2's weights (the window switched
    off in config.json) matches its sliding-window model for the first WINDOW positions and then
    does not."""
    hf, path = _checkpoint(tmp_path, "qwen2", dict(max_window_layers=0, **SLIDING), {})
    _edit_json(path, {"use_sliding_window": False, "layer_types": DROP})
    cfg = read_hf_config(path / "config.json")
    assert cfg.sliding_window is None
    model = build_from_tensors(cfg, read_weights_dir(path), torch.float32, torch.device("cpu"))
    assert max_delta(model, cfg, hf, length=WINDOW, prefill=2) <= TOL
    assert max_delta(model, cfg, hf, length=3 * WINDOW, prefill=2) > TOL


# ----------------------------------------------------------------------------- (d)
# pytorch_model.bin
def _as_torch_bin(path, hf, shards):
    """Store the checkpoint as transformers 4 did with safe_serialization=False (transformers 5
    always writes safetensors): pytorch_model.bin, or shards named in
    pytorch_model.bin.index.json."""
    (path / "model.safetensors").unlink()
    state = hf.state_dict()
    if shards == 1:
        torch.save(state, path / "pytorch_model.bin")
        return
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: v.clone() for k, v in list(state.items())[i::shards]}
        torch.save(part, path / file)
        weight_map.update(dict.fromkeys(part, file))
    (path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("family, kwargs", [("gpt2", {}), ("llama", dict(attention_bias=True))])
def test_pytorch_model_bin_loads_and_matches_transformers(tmp_path, family, kwargs, shards):
    hf, path = _checkpoint(tmp_path, family, kwargs, {})
    _as_torch_bin(path, hf, shards)
    model, cfg, _ = load_model(path, dtype="float32", device="cpu")
    assert max_delta(model, cfg, hf) <= TOL


def test_safetensors_preferred_when_both_exist(tmp_path):
    hf, path = _checkpoint(tmp_path, "gpt2", {}, {})
    (path / "pytorch_model.bin").write_bytes(b"not read: model.safetensors comes first")
    model, cfg, _ = load_model(path, dtype="float32", device="cpu")
    assert max_delta(model, cfg, hf) <= TOL


class _RunsCode:
    def __reduce__(self):  # unpickling calls print(...): what weights_only=True must not allow
        return (print, ("unpickling ran code",))


@pytest.mark.parametrize("content, message", [
    (b"garbage",
     "pytorch_model.bin cannot be read as a state dict with torch.load\\(weights_only=True\\)"),
    ("truncated", "cannot be read"),
    ({"w": _RunsCode()}, "cannot be read.*weights_only"),
    ([torch.zeros(2)], "holds a list, not a state dict of tensors"),
])
def test_unreadable_pytorch_model_bin_is_named(tmp_path, content, message):
    _, path = _checkpoint(tmp_path, "gpt2", {}, {})
    (path / "model.safetensors").unlink()
    file = path / "pytorch_model.bin"
    if isinstance(content, bytes):
        file.write_bytes(content)
    elif content == "truncated":
        torch.save({"w": torch.zeros(1000)}, file)
        file.write_bytes(file.read_bytes()[:2000])
    else:
        torch.save(content, file)
    with pytest.raises(CheckpointError, match=message):
        load_model(path, dtype="float32", device="cpu")


def test_missing_bin_shard_is_named(tmp_path):
    hf, path = _checkpoint(tmp_path, "llama", {}, {})
    _as_torch_bin(path, hf, 3)
    (path / "pytorch_model-00002-of-00003.bin").unlink()
    with pytest.raises(CheckpointError,
                       match="shard .*pytorch_model-00002-of-00003.bin named in the index is "
                             "missing"):
        load_model(path, dtype="float32", device="cpu")


def test_olmo2_norm_rounds_after_its_scale_as_transformers_does(tmp_path):
    """OLMo 2's RMSNorm multiplies by its weight in float32 and rounds once; Llama's rounds, then
    multiplies. In bf16 the two differ in about a quarter of the values: nanoserve's OLMo 2 norms
    equal transformers' bit for bit."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    torch.manual_seed(0)
    theirs = Olmo2RMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.copy_(1 + 0.3 * torch.randn(64))
    ours = RMSNorm(64, 1e-5, scale_fp32=True).to(torch.bfloat16)
    llama_order = RMSNorm(64, 1e-5).to(torch.bfloat16)
    ours.weight.data.copy_(theirs.weight)
    llama_order.weight.data.copy_(theirs.weight)
    x = torch.randn(32, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
        assert not torch.equal(llama_order(x), theirs(x))  # negative control: Llama's order
    for family in ("olmo2", "llama"):
        _hf_config(family, {}).save_pretrained(tmp_path / family)
    assert read_hf_config(tmp_path / "olmo2" / "config.json").norm_scale_fp32
    assert not read_hf_config(tmp_path / "llama" / "config.json").norm_scale_fp32
