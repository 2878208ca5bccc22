"""Shared test fixtures: ../shared lookup, tiny random HF checkpoints, threads, Triton interpreter."""

from __future__ import annotations

import os
from pathlib import Path

# Kernels run in Triton's interpreter on machines without CUDA; it must be set before any
# @triton.jit function is defined (DESIGN.md §5).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


# --------------------------------------------------------------------------- exercises (tests/exercises)
IMPLS = ("reference", "exercises")


def pytest_addoption(parser):
    # here, not in tests/exercises/conftest.py: pytest reads options only from the root conftest
    parser.addoption("--impl", choices=IMPLS, default=os.environ.get("NANOSERVE_IMPL", "reference"),
                     help="what tests/exercises check: the reference (nanoserve) or your code in exercises/ "
                          "(default: $NANOSERVE_IMPL, else reference)")
    parser.addoption("--expect-stubs", action="store_true",
                     help="CI: exercises/ holds the untouched stubs, so every exercise test must fail with "
                          "NotImplementedError (strict xfail: a test that passes on a stub proves nothing)")


def shared_path(*parts: str) -> Path:
    """A path under ../shared: skips the test when it is missing, fails loudly in CI (CI=true)."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        message = f"../shared not found: {path} (tests that use the shared models and corpora need it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


# --------------------------------------------------------------------------- tiny HF checkpoints
def _hf_configs():
    import transformers

    small = dict(vocab_size=257, max_position_embeddings=256)  # 257 = the byte-level tokenizer
    return {
        "gpt2": transformers.GPT2Config(n_layer=2, n_embd=48, n_head=4, n_positions=256, vocab_size=257,
                                        bos_token_id=0, eos_token_id=0),
        "llama-mha": transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=4,
                                              tie_word_embeddings=True, **small),
        # GQA (6 query heads share 2 kv heads), untied head, hidden not a power of two
        "llama-gqa": transformers.LlamaConfig(hidden_size=72, intermediate_size=100, num_hidden_layers=2,
                                              num_attention_heads=6, num_key_value_heads=2,
                                              tie_word_embeddings=False, **small),
        "llama3-rope": transformers.LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **small),
        "qwen2-bias": transformers.Qwen2Config(hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                               num_attention_heads=6, num_key_value_heads=2,
                                               tie_word_embeddings=False, **small),
    }


HF_CASES = ["gpt2", "llama-mha", "llama-gqa", "llama3-rope", "qwen2-bias"]


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{name: (directory, HF model)} for tiny random checkpoints saved offline with save_pretrained."""
    import transformers

    from nanoserve.tokenizer import byte_level_tokenizer, save_tiktoken

    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, cfg) in enumerate(_hf_configs().items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():  # HF initialises some weights to exact 0/1; randomise so every weight matters
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        path = root / name
        model.save_pretrained(path)
        save_tiktoken(byte_level_tokenizer(), path)
        out[name] = (path, model)
    return out


# ----------------------------------------------------------------------------- quantization test data
def outlier_layer(seed=0, n=256, k=512, frac=0.01, mult=20.0):
    """W [n, k] and a sampler of inputs x = z·A (correlated), with frac of the channels × mult.

    Used by test_quant_gptq.py and test_quant_awq.py; calibration and held-out sets share A and
    the outliers.
    """
    g = torch.Generator().manual_seed(seed)
    outliers = torch.randperm(k, generator=g)[: max(1, int(k * frac))]
    W = torch.randn(n, k, generator=g, dtype=torch.float64)                 # N, K
    A = torch.randn(k, k, generator=g, dtype=torch.float64) / k**0.5        # K, K   mixing: correlated channels

    def sample(tokens, sample_seed):
        z = torch.randn(tokens, k, generator=torch.Generator().manual_seed(sample_seed), dtype=torch.float64)
        x = z @ A                                                            # T, K
        x[:, outliers] *= mult
        return x

    return W, sample


def rel_error(W, W_hat, X):
    return ((X @ (W - W_hat).T).norm() / (X @ W.T).norm()).item()
