"""The attention backend switch: the Triton kernels end to end give what the torch path gives.

`attention_backend="triton"` routes every attention over the KV cache through nanoserve.kernels
(store_kv, paged_attention for decode, flash_attention with a paged prefix for prefill and
chunks); "torch" gathers and runs SDPA. Here the Triton path runs in the interpreter on tiny
random HF-shaped models (MHA and GQA) and must reproduce the torch path: logits step by step
(≤ 1e-4, fp32) over a NaN-poisoned pool, and whole greedy generations through the engine with
chunked prefill, prefix-cache hits and preemption-free multi-request batches, token for token.
Negative control: a Triton view that hides each query's newest key misses by far.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nanoserve import LLM, NanoserveError, SamplingParams
from nanoserve.kv import KVCache, PagedKVCache
from nanoserve.kv.triton_backend import TritonCacheView
from nanoserve.models.loader import load_model

# MHA with a learned position table; GQA 6:2 with RoPE
CASES = ["gpt2", "llama-gqa", "qwen3-window", "gemma2"]
# and an untied head; q/k norms and a window of 6 in one layer (read from its start offset, blocks
# before it never); Gemma 2's soft-capped scores with its own scale, in two windowed layers and one
# global


def _step_logits(model, cfg, backend, batch, prefill, *, num_kv_splits=None, poison=False,
                 view_cls=None,
                 kv_cache_dtype="auto"):
    """Logits [steps, B, V]: a ragged-free prefill of `prefill` tokens, then one decode step per
    token."""
    B, T = batch.shape
    cache = KVCache(cfg, batch_size=B, max_seq_len=T, block_size=4, attention_backend=backend,
                    kv_cache_dtype=kv_cache_dtype)
    cache.pool.num_kv_splits = num_kv_splits
    if poison:  # unused slots hold NaN: a kernel reading past a context returns NaN
        for pool in (cache.pool.k, cache.pool.v, cache.pool.k_scale, cache.pool.v_scale):
            # (int8 codes have no NaN: their NaN scales poison them; 0x7F is FP8's NaN)
            if pool is not None:
                pool.fill_(float("nan") if pool.is_floating_point() else 0x7F)
    if view_cls is not None:
        cache.pool.bind = lambda meta: view_cls(cache.pool, meta)
    steps = [model(batch[:, :prefill], cache=cache, last_only=True)[:, -1]]
    for t in range(prefill, T):
        steps.append(model(batch[:, t:t + 1], cache=cache, last_only=True)[:, -1])
    return torch.stack(steps)  # steps, B, V


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_triton_backend_logits_match_torch(hf_checkpoints, case):
    model, cfg, _ = load_model(hf_checkpoints[case][0])
    batch = torch.randint(0, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0))
    ref = _step_logits(model, cfg, "torch", batch, prefill=9)
    # the plain decode kernel, then split-KV with 3 splits and the LSE merge
    for splits in (None, 3):
        got = _step_logits(model, cfg, "triton", batch, prefill=9, num_kv_splits=splits,
                           poison=True)
        assert torch.isfinite(got).all()
        err = (got - ref).abs().max().item()
        assert err <= 1e-4, f"{case}, num_kv_splits={splits}: max |Δ logits| = {err:.2e}"


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@torch.no_grad()
def test_triton_backend_on_a_quantized_pool_matches_torch(hf_checkpoints, kv_cache_dtype):
    """8-bit pools: store_kv quantizes as kv/quant.py does, bit for bit, and the kernels dequantize
    in registers, so both backends attend over the same values; Gemma 2 for its windows and
    soft-capped scores."""
    model, cfg, _ = load_model(hf_checkpoints["gemma2"][0])
    batch = torch.randint(0, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0))
    ref = _step_logits(model, cfg, "torch", batch, prefill=9, kv_cache_dtype=kv_cache_dtype)
    got = _step_logits(model, cfg, "triton", batch, prefill=9, num_kv_splits=3, poison=True,
                       kv_cache_dtype=kv_cache_dtype)
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max().item()
    assert err <= 1e-4, f"{kv_cache_dtype}: max |Δ logits| = {err:.2e}"
    plain = _step_logits(model, cfg, "torch", batch, prefill=9)
    # the quantization itself shows (8e-3 for int8), far above that
    assert (plain - ref).abs().max().item() > 1e-3


class _DropNewestKey(TritonCacheView):
    """Known-wrong: decode sees context_lens − 1 keys (not its own)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.context_lens_i32 = self.context_lens_i32 - 1


@torch.no_grad()
def test_negative_control_wrong_context_is_caught(hf_checkpoints):
    model, cfg, _ = load_model(hf_checkpoints["llama-gqa"][0])
    batch = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = _step_logits(model, cfg, "torch", batch, prefill=8)
    bad = _step_logits(model, cfg, "triton", batch, prefill=8, view_cls=_DropNewestKey)
    # the decode steps are off by far more than 1e-4
    assert (bad[1:] - ref[1:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("case", CASES)
def test_triton_backend_engine_same_tokens(hf_checkpoints, case):
    """Greedy generations through the engine: mixed prompt lengths, chunked prefill (a budget of 8
    tokens per step cuts the long prompt into chunks that attend to their paged prefix),
    prefix-cache hits (the second call shares the first prompts' blocks), decode across block
    boundaries."""
    path = hf_checkpoints[case][0]
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
               [40, 41, 42], [7] * 9]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(path), attention_backend=backend, block_size=4, max_num_batched_tokens=8)
        assert llm.engine.attention_backend == backend
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        hits_before = llm.block_allocator.stats.hits
        # share whole blocks with the first
        again = [p[:12] + [99] for p in prompts[:1]] + [[40, 41, 42, 43, 44]]
        second = [o.outputs[0].token_ids for o in llm.generate(again, params, use_tqdm=False)]
        bm = llm.block_allocator
        # the 12 shared tokens (3 full blocks) came from the cache
        assert bm.stats.hits - hits_before >= 3
        # every block back in the pool (cached ones evictable)
        assert bm.num_free_blocks() == bm.num_blocks
        bm.check_invariants()
        runs[backend] = (first, second)
    assert runs["triton"][0] == runs["torch"][0]
    assert runs["triton"][1] == runs["torch"][1]
    assert all(len(t) == 7 for t in runs["triton"][0] + runs["triton"][1])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_triton_backend_engine_same_tokens_on_a_quantized_pool(hf_checkpoints, kv_cache_dtype):
    """The allocator's paths on 8-bit blocks with the kernels: chunked prefill, a prefix-cache hit,
    n = 2 forks (copy-on-write), and preemption in a pool too small for three requests — the torch
    backend's tokens."""
    path = str(hf_checkpoints["llama-gqa"][0])
    prompts = [list(range(5, 24)), [40, 41, 42], [7] * 9]
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, attention_backend=backend, block_size=4, max_num_batched_tokens=8,
                  kv_cache_dtype=kv_cache_dtype)
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        hit = llm.generate([prompts[0][:12] + [99]], params, use_tqdm=False)[0]
        assert hit.num_cached_tokens == 12
        forks = llm.generate([prompts[1]],
                             SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, n=2),
                             use_tqdm=False)[0]
        small = LLM(path, attention_backend=backend, block_size=4, num_blocks=9,
                    kv_cache_dtype=kv_cache_dtype,
                    enable_prefix_caching=False)
        tight = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
        assert small.engine.scheduler.num_preemptions > 0, (
            "the pool must be small enough to preempt"
        )
        runs[backend] = (
            first, hit.outputs[0].token_ids, [c.token_ids for c in forks.outputs], tight,
        )
    assert runs["triton"] == runs["torch"]
    first, _, forks, tight = runs["triton"]
    assert forks == [first[1], first[1]] and tight == first


def test_default_backend_and_bad_name(hf_checkpoints):
    path = str(hf_checkpoints["gpt2"][0])
    from nanoserve.kernels.cpu_paged_attention import cpu_kernel_problem

    # the CPU's default: the C decode kernel where it builds (the Triton interpreter is slow)
    llm = LLM(path)
    assert llm.engine.attention_backend == (
        "torch" if cpu_kernel_problem(llm.model.config.head_dim) else "cpu"
    )
    with pytest.raises(NanoserveError,
                       match=r"attention_backend='flash'; allowed: None .*torch, triton, cpu"):
        LLM(path, attention_backend="flash")
    with pytest.raises(NanoserveError, match="attention_backend must be one of"):
        PagedKVCache(load_model(path)[1], 4, 4, attention_backend="cuda")


def test_triton_imported_without_interpreter_gives_a_clear_error(hf_checkpoints):
    """Triton imported (here through torch._dynamo) before the interpreter is on: a clear message,
    not a failure deep inside Triton."""
    code = (
        "import torch._dynamo, torch\n"
        "from nanoserve import LLM, SamplingParams\n"
        f"llm = LLM({str(hf_checkpoints['gpt2'][0])!r}, attention_backend='triton')\n"
        "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "set TRITON_INTERPRET=1" in proc.stderr, proc.stderr[-2000:]
