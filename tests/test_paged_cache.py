"""The paged KV cache gives exactly the contiguous cache's results (docs/TESTING.md §A).

Bitwise: the contiguous cache is the paged code path with block_table = arange, so shuffled,
fragmented physical blocks from a NaN-poisoned pool must give identical logits; an off-by-one
block index must not. Then prefix caching, copy-on-write and the pool-is-whole invariant
through the real engine.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, NanoserveError, SamplingParams
from nanoserve.engine.block_allocator import BlockAllocator
from nanoserve.kv import KVCache, PagedKVCache
from nanoserve.models.loader import load_model

BS = 4  # small blocks: many block boundaries in short sequences


def _contiguous_run(model, cfg, ids, n_prefill):
    cache = KVCache(cfg, 1, ids.shape[1], block_size=BS)
    with torch.no_grad():
        out = [model(ids[:, :n_prefill], cache=cache)]
        out += [model(ids[:, t:t + 1], cache=cache) for t in range(n_prefill, ids.shape[1])]
    return torch.cat(out, dim=1)


def _paged_run(model, cfg, ids, n_prefill, table, pool_blocks, off_by_one=False):
    """The same tokens through a NaN-poisoned pool, the sequence's blocks at `table`."""
    pool = PagedKVCache(cfg, pool_blocks, BS)
    pool.k.fill_(float("nan"))
    pool.v.fill_(float("nan"))
    table = torch.tensor(table)
    out, start = [], 0
    with torch.no_grad():
        for end in [n_prefill] + list(range(n_prefill + 1, ids.shape[1] + 1)):
            pos = torch.arange(start, end)
            blk = pos // BS + (1 if off_by_one else 0)
            slots = (table[blk.clamp(max=len(table) - 1)] * BS + pos % BS)[None]  # 1, T
            used = table[None, : -(-end // BS)]  # 1, blocks holding tokens so far
            view = pool.view(slots, used, torch.tensor([end]))
            out.append(model(ids[:, start:end], pos[None], cache=view))
            start = end
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
@pytest.mark.parametrize("length", [1, BS - 1, BS, BS + 1, 40])
def test_paged_equals_contiguous_bitwise(hf_checkpoints, name, length):
    model, cfg, _ = load_model(hf_checkpoints[name][0])
    g = torch.Generator().manual_seed(length)
    total = length + 6  # prompt of `length`, then 6 decode steps
    ids = torch.randint(0, cfg.vocab_size, (1, total), generator=g)
    ref = _contiguous_run(model, cfg, ids, length)
    n_blocks = -(-total // BS)
    pool_blocks = 4 * n_blocks + 3
    table = torch.randperm(pool_blocks, generator=g)[:n_blocks].tolist()  # shuffled, fragmented
    out = _paged_run(model, cfg, ids, length, table, pool_blocks)
    assert not out.isnan().any()
    assert torch.equal(out, ref)


def test_off_by_one_block_index_is_caught(hf_checkpoints):
    """Negative control: writing each token one block too far reads NaN or wrong keys."""
    model, cfg, _ = load_model(hf_checkpoints["llama-gqa"][0])
    ids = torch.randint(0, cfg.vocab_size, (1, 14), generator=torch.Generator().manual_seed(0))
    ref = _contiguous_run(model, cfg, ids, 9)
    out = _paged_run(model, cfg, ids, 9, [7, 2, 11, 5], 16, off_by_one=True)
    assert out.isnan().any() or not torch.equal(out, ref)


# --------------------------------------------------------------------------- through the engine
@pytest.fixture()
def engines(hf_checkpoints):
    """A prefix-caching engine and a cold one on the same checkpoint; both must end with a whole
    pool."""
    path = str(hf_checkpoints["llama-gqa"][0])
    warm = LLM(path, block_size=BS, num_blocks=64)
    cold = LLM(path, block_size=BS, num_blocks=64, enable_prefix_caching=False)
    yield warm, cold
    for llm in (warm, cold):
        bm = llm.block_allocator
        bm.check_invariants()
        assert bm.num_free_blocks() == bm.num_blocks, "a test leaked KV blocks"


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_prefix_hit_gives_the_cold_result(engines):
    warm, cold = engines
    shared = list(range(10, 31))  # 21 tokens: 5 full blocks
    warm.generate([shared + [1, 2]], GREEDY)
    hit = warm.generate([shared + [7, 8, 9]], GREEDY)[0]
    assert hit.num_cached_tokens == 20  # 5 blocks reused
    assert hit.token_ids == cold.generate([shared + [7, 8, 9]], GREEDY)[0].token_ids
    assert warm.block_allocator.stats.hits >= 5


def test_full_prompt_hit_still_computes_the_last_token(engines):
    warm, cold = engines
    prompt = list(range(40, 56))  # exactly 4 blocks
    first = warm.generate([prompt], GREEDY)[0]
    again = warm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 12  # the block holding the last token is recomputed
    assert first.token_ids == again.token_ids == cold.generate([prompt], GREEDY)[0].token_ids


def test_forced_hash_collision_never_corrupts_output(engines):
    warm, cold = engines
    bm = warm.block_allocator
    colliding = BlockAllocator(
        bm.num_blocks, bm.block_size, True, hash_fn=lambda parent, tokens: 42
    )
    warm.engine.scheduler.block_allocator = colliding
    a, b = list(range(60, 72)), list(range(80, 92))  # different tokens, same (forced) hashes
    warm.generate([a], GREEDY)
    out_b = warm.generate([b], GREEDY)[0]
    assert out_b.num_cached_tokens == 0
    assert out_b.token_ids == cold.generate([b], GREEDY)[0].token_ids
    warm.engine.scheduler.block_allocator = bm
    colliding.check_invariants()
    assert colliding.num_free_blocks() == colliding.num_blocks


def test_parallel_samples_share_the_prompt_and_match_single_runs(engines):
    """n = 3 seeded samples fork the prompt's blocks (copy-on-write on the shared partial block);
    sample i equals a single run with seed + i."""
    warm, cold = engines
    prompt = list(range(100, 110))  # 10 tokens: the last block is partial and shared
    p = SamplingParams(temperature=1.0, max_tokens=10, seed=11, n=3, ignore_eos=True)
    out = warm.generate([prompt], p)[0]
    assert len(out.outputs) == 3
    singles = [
        cold.generate(
            [prompt], SamplingParams(temperature=1.0, max_tokens=10, seed=11 + i, ignore_eos=True)
        )[0].token_ids
        for i in range(3)
    ]
    assert [o.token_ids for o in out.outputs] == singles
    assert len({tuple(s) for s in singles}) == 3  # the samples really diverged


def test_abandoned_stream_returns_its_blocks(engines):
    warm, _ = engines
    it = warm.stream([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(it), next(it)
    assert warm.block_allocator.num_free_blocks() < warm.block_allocator.num_blocks
    it.close()  # the caller walks away mid-generation


def test_request_that_can_never_fit_is_refused_with_numbers(hf_checkpoints):
    llm = LLM(str(hf_checkpoints["gpt2"][0]), block_size=BS, num_blocks=8)  # 32 token slots
    with pytest.raises(NanoserveError, match=r"needs up to \d+ KV blocks .* the whole pool has 8"):
        llm.generate([list(range(20))], SamplingParams(max_tokens=30))
    assert llm.block_allocator.num_free_blocks() == 8


def test_bad_pool_configuration_fails_at_construction(hf_checkpoints):
    path = str(hf_checkpoints["gpt2"][0])
    with pytest.raises(NanoserveError, match="block_size"):
        LLM(path, block_size=12)
    with pytest.raises(NanoserveError, match=r"needs? .*bytes"):
        LLM(path, kv_cache_memory=10_000)
