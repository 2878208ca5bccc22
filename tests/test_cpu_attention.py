"""The CPU attention backend: a C kernel (kernels/cpu_paged_attention.c) for decode over the paged
pool.

The kernel is checked against `paged_attention_ref` (plain torch, one sequence at a time) over head
dims, GQA groups, block sizes, sliding windows and soft-caps, with every slot it must not read
poisoned with NaN; then the backend end to end against the torch backend (gather + SDPA): logits
step by step on tiny random HF-shaped models, and greedy tokens through the engine with chunked
prefill and prefix-cache hits. Negative controls: the kernel given one key too few per row, and a
block table with two blocks swapped, miss the reference by far. Where no compiler builds the kernel,
the default falls back to torch, saying why.
"""

from __future__ import annotations

import pytest
import torch
from nanoserve.kernels import cpu_paged_attention as cpa
from nanoserve.kernels.cpu_build import cache_dir
from nanoserve.kernels.cpu_paged_attention import (
    cpu_kernel_problem,
    paged_attention_cpu,
    paged_attention_ref,
)
from test_attention_backend import CASES, _step_logits

from nanoserve import LLM, NanoserveError, SamplingParams
from nanoserve.kv.cache import resolve_attention_backend
from nanoserve.models.loader import load_model

pytestmark = pytest.mark.skipif(cpu_kernel_problem(64) is not None,
                                reason=f"C kernel: {cpu_kernel_problem(64)}")


def _paged_case(seed, B, H, Hkv, D, block_size, max_blocks, window=None):
    """Pools with every slot no row may read set to NaN, scattered block tables, ragged context
    lengths."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = B * max_blocks + 3
    k = torch.full((num_blocks, block_size, Hkv, D), float("nan"))
    v = torch.full_like(k, float("nan"))
    tables = torch.randperm(num_blocks, generator=g)[:B * max_blocks].view(B, max_blocks)
    lens = torch.randint(1, max_blocks * block_size + 1, (B,), generator=g)
    lens[0] = max_blocks * block_size  # one row fills its table
    for b in range(B):  # only the keys row b sees hold numbers
        first = max(int(lens[b]) - window, 0) if window else 0
        for t in range(first, int(lens[b])):
            blk, off = tables[b, t // block_size], t % block_size
            k[blk, off] = torch.randn(Hkv, D, generator=g)
            v[blk, off] = torch.randn(Hkv, D, generator=g)
    return torch.randn(B, H, D, generator=g), k, v, tables, lens


@pytest.mark.parametrize("D,H,Hkv,block_size,window,softcap", [
    (64, 6, 6, 16, None, None),  # the peer benchmark's GPT-2 shape
    (64, 8, 2, 4, None, None),  # GQA 4:1
    (80, 4, 4, 1, None, None),  # a head dim no power of two, one token per block
    (128, 8, 1, 8, 5, None),  # MQA, a sliding window: keys before it are NaN and never read
    (32, 4, 2, 16, 19, 30.0),  # a window across blocks, Gemma 2's soft-cap
])
def test_kernel_matches_the_reference(D, H, Hkv, block_size, window, softcap):
    q, k, v, tables, lens = _paged_case(0, 5, H, Hkv, D, block_size, 7, window)
    got = paged_attention_cpu(q, k, v, tables, lens, 0.3, window=window, softcap=softcap)
    want = paged_attention_ref(q, k, v, tables, lens, 0.3, window=window, softcap=softcap)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.equal(got,
                       paged_attention_cpu(q, k, v, tables.int(), lens.int(), 0.3, window=window,
                                                softcap=softcap))  # int32 tables: the same call


def test_negative_controls_one_key_short_and_swapped_blocks_miss():
    q, k, v, tables, lens = _paged_case(1, 4, 4, 4, 64, 4, 6)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    want = paged_attention_ref(q, k, v, tables, lens)
    short = paged_attention_cpu(q, k, v, tables, (lens - 1).clamp(min=1))
    assert (short - want).abs().max().item() > 1e-2
    # (attention is blind to the order of the keys it sees: a window shows the swap)
    swapped = tables.clone()
    swapped[0, [0, -1]] = swapped[0, [-1, 0]]  # row 0 fills its table: both blocks hold its keys
    windowed = paged_attention_ref(q, k, v, tables, lens, window=6)
    assert (paged_attention_cpu(q, k, v, swapped, lens,
                                window=6) - windowed)[0].abs().max().item() > 1e-2


def test_bad_inputs_are_named_before_the_kernel_runs():
    q, k, v, tables, lens = _paged_case(2, 2, 4, 2, 64, 4, 3)
    with pytest.raises(ValueError, match="block ids outside 0 .. "):
        paged_attention_cpu(q, k, v, tables + k.shape[0], lens)
    with pytest.raises(ValueError, match=r"context_lens must lie in 1 \.\. 12"):
        paged_attention_cpu(q, k, v, tables, lens * 0)
    with pytest.raises(ValueError,
                       match="float32 pools in place on the CPU; q is torch.bfloat16 on cpu"):
        paged_attention_cpu(q.bfloat16(), k.bfloat16(), v.bfloat16(), tables, lens)
    with pytest.raises(ValueError, match="v_cache .* not contiguous"):
        paged_attention_cpu(q, k, v.transpose(0, 1).contiguous().transpose(0, 1), tables, lens)
    with pytest.raises(ValueError, match="window must be None or an int"):
        paged_attention_cpu(q, k, v, tables, lens, window=0)
    # no sequence: no call
    assert paged_attention_cpu(q[:0], k, v, tables[:0], lens[:0]).shape == (0, 4, 64)


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_backend_logits_match_torch(hf_checkpoints, case):
    model, cfg, _ = load_model(hf_checkpoints[case][0])
    batch = torch.randint(0, cfg.vocab_size, (3, 14), generator=torch.Generator().manual_seed(0))
    ref = _step_logits(model, cfg, "torch", batch, prefill=9)
    got = _step_logits(model, cfg, "cpu", batch, prefill=9)
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", ["llama-gqa", "gemma2"])
def test_backend_engine_same_tokens(hf_checkpoints, case):
    """Greedy generations: chunked prefill (8 tokens a step), a prefix-cache hit, decodes across
    blocks."""
    path = str(hf_checkpoints[case][0])
    prompts = [list(range(5, 24)), [40, 41, 42], [7] * 9]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    runs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(path, attention_backend=backend, block_size=4, max_num_batched_tokens=8)
        assert llm.engine.attention_backend == backend
        runs[backend] = [
            o.outputs[0].token_ids
            for o in llm.generate(prompts + [prompts[0][:12] + [99]], params, use_tqdm=False)
        ]
        assert llm.block_allocator.stats.hits >= 3
    assert runs["cpu"] == runs["torch"]


def test_default_on_the_cpu_and_the_fallback_without_a_compiler(monkeypatch, caplog, tmp_path):
    assert resolve_attention_backend(None, "cpu", 64, torch.float32) == "cpu"
    # the kernel is float32 only
    assert resolve_attention_backend(None, "cpu", 64, torch.bfloat16) == "torch"
    with pytest.raises(NanoserveError,
                       match="'cpu' cannot serve this model here: the C decode kernel computes in "
                             "float32, and the model is torch.bfloat16; use 'torch'"):
        resolve_attention_backend("cpu", "cpu", 64, torch.bfloat16)
    with pytest.raises(NanoserveError, match="it runs on the CPU, and this model is on CUDA"):
        resolve_attention_backend("cpu", "cuda", 64, torch.float32)
    # no cached answers
    monkeypatch.setattr(cpa, "cpu_kernel_problem", cpa.cpu_kernel_problem.__wrapped__)
    monkeypatch.setattr(cpa, "load_library", cpa.load_library.__wrapped__)
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))  # nothing built before is found
    for cc, reason in (("no-such-cc", "no C compiler: 'no-such-cc' is not on PATH"),
                       ("false", "building cpu_paged_attention.c failed")):
        monkeypatch.setenv("CC", cc)
        caplog.clear()
        with caplog.at_level("WARNING", logger="nanoserve"):
            assert resolve_attention_backend(None, "cpu", 48, torch.float32) == "torch"
        assert reason in caplog.text
        with pytest.raises(NanoserveError, match=reason):
            resolve_attention_backend("cpu", "cpu", 48, torch.float32)


def test_an_unwritable_cache_falls_back_to_a_temporary_folder(monkeypatch, tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("NANOSERVE_CACHE", str(not_a_folder))  # mkdir under a file fails
    folder = cache_dir()
    assert folder.name == "cpu_kernels" and not_a_folder not in folder.parents
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path / "cpu_kernels"  # the control: a writable one is used
