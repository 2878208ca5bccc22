"""Test data shared by many test files: ../shared lookup, the tiny HF configs, synthetic
quantization layers.

Imported by name (`from testdata import shared_path`): pytest puts tests/ on sys.path when it loads
tests/conftest.py, for tests/exercises too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def shared_path(*parts: str) -> Path:
    """A path under ../shared: skips the test when it is missing, fails loudly in CI (CI=true)."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        message = (
            f"../shared not found: {path} (tests that use the shared models and corpora need it)"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


# --------------------------------------------------------------------------- tiny HF checkpoints
def hf_configs():
    import transformers

    small = dict(vocab_size=257, max_position_embeddings=256)  # 257 = the byte-level tokenizer
    return {
        "gpt2": transformers.GPT2Config(n_layer=2, n_embd=48, n_head=4, n_positions=256,
                                        vocab_size=257,
                                        bos_token_id=0, eos_token_id=0),
        "llama-mha": transformers.LlamaConfig(hidden_size=64, intermediate_size=96,
                                              num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=4,
                                              tie_word_embeddings=True, **small),
        # GQA (6 query heads share 2 kv heads), untied head, hidden not a power of two
        "llama-gqa": transformers.LlamaConfig(hidden_size=72, intermediate_size=100,
                                              num_hidden_layers=2,
                                              num_attention_heads=6, num_key_value_heads=2,
                                              tie_word_embeddings=False, **small),
        "llama3-rope": transformers.LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **small),
        "qwen2-bias": transformers.Qwen2Config(hidden_size=48, intermediate_size=80,
                                               num_hidden_layers=2,
                                               num_attention_heads=6, num_key_value_heads=2,
                                               tie_word_embeddings=False, **small),
        # a window of 8 in every layer: a 64-token generation runs 8× past it
        "mistral-window": transformers.MistralConfig(hidden_size=64, intermediate_size=96,
                                                     num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=2,
                                                     sliding_window=8,
                                                     **small),
        # q/k norms, explicit head_dim, and a window of 6 in layer 1 only (max_window_layers=1)
        "qwen3-window": transformers.Qwen3Config(hidden_size=48, intermediate_size=80,
                                                 num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=16,
                                                 use_sliding_window=True, sliding_window=6,
                                                 max_window_layers=1,
                                                 tie_word_embeddings=True, **small),
        # sandwich norms, (1 + w) RMSNorm, √d embeddings, GeGLU, scores × 24^−½ soft-capped at 5,
        # logits at 8, windows of 8 in layers 0 and 2 (every second layer)
        "gemma2": transformers.Gemma2Config(hidden_size=48, intermediate_size=80,
                                            num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16,
                                            query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                            final_logit_softcapping=8.0, sliding_window=8, **small),
        # q/k norms; windows of 6 in layers 0 and 2 with RoPE base 100, layer 1 global: base 1e5,
        # linear × 4
        "gemma3": transformers.Gemma3TextConfig(
            hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16, query_pre_attn_scalar=16, sliding_window=6, sliding_window_pattern=2,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 1e5},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}, **small),
        # NoPE in layer 3 (every 4th), a window of 6 there too, biases everywhere
        "smollm3": transformers.SmolLM3Config(hidden_size=48, intermediate_size=80,
                                              num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              use_sliding_window=True,
                                              sliding_window=6, attention_bias=True, mlp_bias=True,
                                              pad_token_id=0,
                                              **small),
        # post-norm blocks, q/k norms over the whole projections
        "olmo2": transformers.Olmo2Config(hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                          num_attention_heads=6, num_key_value_heads=2,
                                          pad_token_id=0, **small),
        # fused qkv / gate-up weights, RoPE on 3/4 of each head, LongRoPE's short factors (context
        # 128 of 512, attention factor √(1 + ln 4 / ln 128)), a window of 8 in every layer
        "phi3": transformers.Phi3Config(hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        partial_rotary_factor=0.75,
                                        sliding_window=8, original_max_position_embeddings=128,
                                        pad_token_id=0,
                                        rope_scaling={"type": "longrope",
                                                      "short_factor": [1 + 0.3 * i for i in range(6)],
                                                      "long_factor": [2.0 + i for i in range(6)]},
                                        **dict(small, max_position_embeddings=512)),
        # 4 experts, top 2 (renormalised), a window of 8
        "mixtral": transformers.MixtralConfig(hidden_size=48, intermediate_size=64,
                                              num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              num_local_experts=4,
                                              num_experts_per_tok=2, sliding_window=8,
                                              pad_token_id=0, **small),
        # 6 experts of width 32, top 3 not renormalised; layer 1 keeps a dense MLP
        "qwen3-moe": transformers.Qwen3MoeConfig(hidden_size=48, intermediate_size=64,
                                                 num_hidden_layers=3,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 num_experts=6,
                                                 num_experts_per_tok=3, moe_intermediate_size=32,
                                                 mlp_only_layers=[1],
                                                 norm_topk_prob=False, pad_token_id=0, **small),
    }


HF_CASES = ["gpt2", "llama-mha", "llama-gqa", "llama3-rope", "qwen2-bias", "mistral-window",
            "qwen3-window", "gemma2",
            "gemma3", "smollm3", "olmo2", "phi3", "mixtral", "qwen3-moe"]


def tiny_hf_checkpoint(cfg, path: Path, seed: int = 0, **from_config_kwargs):
    """A random HF model for `cfg` (eval mode), saved to `path` with a byte-level tokenizer; returns
    it.

    Norm weights 1 + N(0, 0.1) and biases N(0, 0.1) (docs/TESTING.md §A): HF's init leaves them at
    exactly 1 and 0, where a wrong norm epsilon or a dropped bias changes nothing."""
    import transformers

    from nanoserve.tokenizers import byte_level_tokenizer, save_tiktoken

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, **from_config_kwargs).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif p.ndim == 1:  # the only 1-D weights are norm scales
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    save_tiktoken(byte_level_tokenizer(), path)
    return model


# ----------------------------------------------------------------------------- quantization
# (docs/TESTING.md §C)
def outlier_layer(seed=0, n=256, k=512, frac=0.01, mult=20.0):
    """W [n, k] and a sampler of inputs x = z·A (correlated), with frac of the channels × mult.

    Calibration and held-out sets share A and the outliers.
    """
    g = torch.Generator().manual_seed(seed)
    outliers = torch.randperm(k, generator=g)[: max(1, int(k * frac))]
    W = torch.randn(n, k, generator=g, dtype=torch.float64)                 # N, K
    # K, K   mixing: correlated channels
    A = torch.randn(k, k, generator=g, dtype=torch.float64) / k**0.5

    def sample(tokens, sample_seed):
        z = torch.randn(tokens, k, generator=torch.Generator().manual_seed(sample_seed),
                        dtype=torch.float64)
        x = z @ A                                                            # T, K
        x[:, outliers] *= mult
        return x

    return W, sample


def rel_error(W, W_hat, X):
    return ((X @ (W - W_hat).T).norm() / (X @ W.T).norm()).item()


# ----------------------------------------------------------------------------- mixture of experts
def hf_moe_block_like(ours, family: str):
    """transformers' sparse MoE block (MixtralSparseMoeBlock or Qwen3MoeSparseMoeBlock) holding the
    weights of nanoserve's SparseMoeBlock `ours` (transformers 5 stacks the experts: gate_up [E, 2F,
    C], down [E, C, F])."""
    import transformers

    E, F, C = len(ours.experts), ours.experts[0].gate_proj.out_features, ours.gate.in_features
    if family == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=C, intermediate_size=F, num_local_experts=E,
                                         num_experts_per_tok=ours.top_k)
        hf = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(hidden_size=C, intermediate_size=F,
                                          moe_intermediate_size=F, num_experts=E,
                                          num_experts_per_tok=ours.top_k,
                                          norm_topk_prob=ours.renormalize)
        hf = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        hf.gate.weight.copy_(ours.gate.weight)
        for e, expert in enumerate(ours.experts):
            hf.experts.gate_up_proj[e].copy_(torch.cat([expert.gate_proj.weight,
                                                        expert.up_proj.weight]))
            hf.experts.down_proj[e].copy_(expert.down_proj.weight)
    return lambda x: (lambda out: out[0] if isinstance(out, tuple) else out)(hf(x))


def tree_path(parents: list[int], i: int) -> list[int]:
    """Node i of a token tree (parents[i] < i, the root's −1): its ancestors and itself, root first
    — the keys its path would hold as a chain, what tests compare a tree mask against."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]
