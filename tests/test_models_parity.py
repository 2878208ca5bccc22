"""Model parity with HF transformers (an implementation nobody here wrote) on tiny random
checkpoints.

Tolerance: 1e-4 max |Δ| on fp32 logits (docs/TESTING.md §A); the two implementations differ only in
the order of floating-point operations, which on these sizes moves logits by ~1e-6.
"""

from __future__ import annotations

import pytest
import torch
from testdata import HF_CASES

from nanoserve.kv import KVCache
from nanoserve.models.layers import attention, naive_attention
from nanoserve.models.loader import load_model

TOL = 1e-4


def _load(hf_checkpoints, name):
    path, hf = hf_checkpoints[name]
    model, cfg, _ = load_model(path, dtype="float32", device="cpu")
    return model, cfg, hf


@pytest.mark.parametrize("name", HF_CASES)
def test_prefill_and_cached_decode_match_hf(hf_checkpoints, name):
    """Prompt logits, then 20 single-token cached decode steps, each against HF's full forward."""
    model, cfg, hf = _load(hf_checkpoints, name)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 36))
    with torch.no_grad():
        ref = hf(ids).logits  # 1, 36, V
        cache = KVCache(cfg, 1, 64)
        prefill = model(ids[:, :16], cache=cache)
        errors = [(prefill - ref[:, :16]).abs().max().item()]
        for t in range(16, 36):  # 20 decode steps
            step = model(ids[:, t:t + 1], cache=cache)
            errors.append((step[:, 0] - ref[:, t]).abs().max().item())
    assert max(errors) <= TOL, f"{name}: max |Δ| per step {errors}"


@pytest.mark.parametrize("name", HF_CASES)
def test_no_cache_equals_cache(hf_checkpoints, name):
    model, cfg, _ = _load(hf_checkpoints, name)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(cfg, 2, 24)
        parts = [model(ids[:, :5], cache=cache)] + [model(ids[:, t:t + 1],
                                                          cache=cache) for t in range(5, 24)]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", HF_CASES)
def test_greedy_64_tokens_match_hf_generate(hf_checkpoints, name):
    from nanoserve import LLM, SamplingParams

    path, hf = hf_checkpoints[name]
    llm = LLM(str(path), dtype="float32", device="cpu")
    prompt = [3, 17, 42, 5, 99, 7]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64,
                          do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    assert out.token_ids == ref
    assert out.finish_reason == "length"


def test_parity_test_has_power(hf_checkpoints):
    """Negative control: a subtly wrong model (RoPE pairs from llama2.c's interleaved layout, i.e.
    q/k weights not permuted) must fail the 1e-4 parity check."""
    model, cfg, hf = _load(hf_checkpoints, "llama-gqa")
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        w = attn.q_proj.weight
        D = cfg.head_dim
        perm = torch.cat(
            [
                torch.arange(h * D, (h + 1) * D).view(2, D // 2).t().reshape(-1)
                for h in range(cfg.n_heads)
            ]
        )
        attn.q_proj.weight.copy_(w[perm])
        ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
        err = (model(ids) - hf(ids).logits).abs().max().item()
    assert err > TOL


@pytest.mark.parametrize("T,S,H,Hkv", [(7, 7, 4, 4), (1, 9, 6, 2), (3, 11, 8, 2)])
def test_sdpa_attention_equals_naive(T, S, H, Hkv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, T, H, 16, generator=g)
    k, v = torch.randn(2, S, Hkv, 16, generator=g), torch.randn(2, S, Hkv, 16, generator=g)
    positions = torch.arange(S - T, S).expand(2, T)
    assert torch.allclose(
        attention(q, k, v, positions), naive_attention(q, k, v, positions), atol=1e-5
    )
    if T == S:
        assert torch.allclose(attention(q, k, v), naive_attention(q, k, v), atol=1e-5)
    # the causal mask matters: without it the last-but-one query would see the last key
    if T > 1:
        unmasked = naive_attention(q, k, v, torch.full_like(positions, S - 1))
        assert not torch.allclose(unmasked, attention(q, k, v, positions), atol=1e-3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_half_precision_close_to_fp32(hf_checkpoints, name, dtype):
    """16-bit weights on CPU: logits close to fp32 (bf16 keeps 8 mantissa bits, so |Δ| ~ 1e-2)."""
    path, _ = hf_checkpoints[name]
    m32, cfg, _ = load_model(path, dtype="float32", device="cpu")
    m16, _, _ = load_model(path, dtype=dtype, device="cpu")
    assert next(m16.parameters()).dtype == getattr(torch, dtype)
    ids = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = m32(ids)
        cache = KVCache(cfg, 1, 16, dtype=getattr(torch, dtype))
        out = torch.cat(
            [m16(ids[:, :6], cache=cache)]
            + [m16(ids[:, t : t + 1], cache=cache) for t in range(6, 10)], 1,
        )
    assert (out.float() - ref).abs().max().item() < 0.05


def test_llama3_rope_scaling_changes_frequencies(hf_checkpoints):
    """The scaled model is not the unscaled one: HF parity above is on a config where it matters."""
    from nanoserve.models.config import ModelConfig, llama3_rope_inv_freq
    from nanoserve.models.layers import rope_inv_freq

    _, cfg, _ = _load(hf_checkpoints, "llama3-rope")
    plain = ModelConfig(**{**cfg.to_dict(), "rope_scaling": None})
    scaled, unscaled = rope_inv_freq(cfg), rope_inv_freq(plain)
    assert not torch.allclose(scaled, unscaled)
    assert torch.allclose(scaled, llama3_rope_inv_freq(unscaled, cfg.rope_scaling))
    assert torch.equal(scaled[0], unscaled[0])  # the highest frequency is untouched
