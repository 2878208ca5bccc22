"""Continuous batching is invisible in the output: 64 ragged requests batched together produce,
token for token (greedy, fp32), what each produces alone — also when blocks run out and requests
are preempted, with chunked prefill on and off, and with prefix caching. Plus abort, priority,
the bounded queue, and that no request or block is ever lost."""

from __future__ import annotations

import random

import pytest

from nanoserve import LLM, NanoserveError, SamplingParams
from nanoserve.engine import LLMEngine
from nanoserve.engine.scheduler import QueueFullError

BS = 4


def _workload(n=64, seed=0, shared_prefix=()):
    rng = random.Random(seed)
    prompts = [
        list(shared_prefix) + [rng.randrange(1, 256) for _ in range(rng.randint(1, 40))]
        for _ in range(n)
    ]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 24),
                             ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def path(hf_checkpoints):
    return str(hf_checkpoints["llama-gqa"][0])


@pytest.fixture(scope="module")
def reference(path):
    """Each request alone (max_num_seqs=1: one sequence per forward, no batching at all)."""
    solo = LLM(path, block_size=BS, num_blocks=256, max_num_seqs=1, enable_prefix_caching=False)

    def run(prompts, params):
        return [solo.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    return run


def _run_batched(engine: LLMEngine, prompts, params):
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    done, max_batch = {}, 0
    while engine.has_unfinished_requests():
        max_batch = max(max_batch, len(engine.scheduler.running))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == set(ids), "a request was lost"
    bm = engine.block_allocator
    bm.check_invariants()
    assert bm.num_free_blocks() == bm.num_blocks, "blocks leaked"
    return [done[i].token_ids for i in ids], max_batch


@pytest.mark.parametrize("chunked", [True, False])
def test_batched_equals_alone(path, reference, chunked):
    prompts, params = _workload()
    engine = LLMEngine.from_kwargs(path, block_size=BS, num_blocks=512, max_num_seqs=16,
                                   max_num_batched_tokens=256,
                       enable_chunked_prefill=chunked, enable_prefix_caching=False)
    got, max_batch = _run_batched(engine, prompts, params)
    assert max_batch > 8  # it really batched
    assert got == reference(prompts, params)


def test_small_pool_preempts_and_still_equals_alone(path, reference):
    prompts, params = _workload(seed=1)
    engine = LLMEngine.from_kwargs(path, block_size=BS, num_blocks=40, max_num_seqs=32,
                                   max_num_batched_tokens=64,
                       enable_prefix_caching=False)
    got, _ = _run_batched(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert got == reference(prompts, params)


def test_chunked_prefill_splits_long_prompts(path, reference):
    prompts, params = _workload(n=8, seed=2)
    prompts = [p * 4 for p in prompts]  # up to 160 tokens
    engine = LLMEngine.from_kwargs(path, block_size=BS, num_blocks=512, max_num_batched_tokens=16)
    seen_chunks = []
    orig = engine.runner.run

    def spy(seqs, num_new, num_logits=None):
        seen_chunks.append(max(num_new))
        return orig(seqs, num_new, num_logits)
    engine.runner.run = spy
    got, _ = _run_batched(engine, prompts, params)
    assert max(seen_chunks) <= 16
    assert got == reference(prompts, params)


def test_prefix_caching_in_a_batch_equals_alone(path, reference):
    prompts, params = _workload(n=32, seed=3, shared_prefix=list(range(30, 50)))
    engine = LLMEngine.from_kwargs(path, block_size=BS, num_blocks=512, max_num_batched_tokens=64)
    got, _ = _run_batched(engine, prompts, params)
    assert engine.block_allocator.stats.hits > 0
    assert got == reference(prompts, params)


def test_abort_mid_generation_frees_every_block(path):
    engine = LLMEngine.from_kwargs(path, block_size=BS, num_blocks=128)
    keep = engine.add_request([1, 2, 3],
                              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    gone = engine.add_request(list(range(5, 30)),
                              SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(5):
        engine.step()
    engine.abort_request(gone)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert keep in outs and gone not in outs and len(outs[keep].token_ids) == 20
    assert engine.block_allocator.num_free_blocks() == engine.block_allocator.num_blocks


def test_priority_order_is_respected(path):
    """One sequence per step: requests start in (priority, arrival) order."""
    engine = LLMEngine.from_kwargs(path, block_size=BS, num_blocks=128, max_num_seqs=1)
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ids = {prio: engine.add_request([prio + 1, 7], p, priority=prio) for prio in (5, 0, 3, 1)}
    order = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id not in order:
                order.append(o.request_id)
    assert order == [ids[0], ids[1], ids[3], ids[5]]


def test_full_waiting_queue_rejects_instead_of_growing(path):
    engine = LLMEngine.from_kwargs(path, block_size=BS, num_blocks=64, max_waiting=2)
    engine.add_request([1, 2])
    engine.add_request([3, 4])
    with pytest.raises(QueueFullError, match="waiting queue is full .*max_waiting=2"):
        engine.add_request([5, 6])
    assert len(engine.requests) == 2


@pytest.mark.parametrize("kwargs,match", [
    ({"max_num_seqs": 0}, "max_num_seqs=0 must be an integer ≥ 1"),
    ({"max_num_batched_tokens": -4}, "max_num_batched_tokens=-4"),
    ({"max_waiting": 0}, "max_waiting=0"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64},
     "must be ≥ the context length 256"),
])
def test_bad_scheduler_settings_fail_at_construction(path, kwargs, match):
    with pytest.raises(NanoserveError, match=match):
        LLMEngine.from_kwargs(path, **kwargs)


def test_timestamps_feed_the_metrics(path):
    from nanoserve.tools.metrics import RequestMetrics, summarize

    llm = LLM(path, block_size=BS, num_blocks=128)
    outs = llm.generate([[1, 2, 3], [4, 5]],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    ms = [RequestMetrics.from_output(o) for o in outs]
    for m in ms:
        assert len(m.token_times) == 6 and m.ttft >= 0 and m.queue_time >= 0
        assert m.tpot == pytest.approx((m.e2e - m.ttft) / 5)
    assert summarize(ms).num_requests == 2


def test_preemption_without_recompute_is_caught(path, reference):
    """Negative control: resuming a preempted sequence as if its KV were still there (no recompute)
    must break the equality above."""
    prompts, params = _workload(seed=1)
    engine = LLMEngine.from_kwargs(path, block_size=BS, num_blocks=40, max_num_seqs=32,
                                   max_num_batched_tokens=64,
                       enable_prefix_caching=False)
    bm = engine.block_allocator
    allocate = bm.allocate

    def resume_without_recompute(seq):
        allocate(seq)
        if seq.num_preemptions:
            seq.num_computed_tokens = len(seq) - 1
    bm.allocate = resume_without_recompute
    got, _ = _run_batched(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert got != reference(prompts, params)


@pytest.mark.parametrize("kind", ["static", "dynamic", "continuous"])
def test_every_batcher_equals_alone(path, reference, kind):
    from nanoserve.tools.batching import ContinuousBatcher, DynamicBatcher, StaticBatcher

    prompts, params = _workload(n=24, seed=4)
    engine = LLMEngine.from_kwargs(path, block_size=BS, num_blocks=512, max_num_seqs=8)
    batcher = {"static": lambda: StaticBatcher(engine, batch_size=8),
               "dynamic": lambda: DynamicBatcher(engine, max_batch_size=8, max_wait_ms=5),
               "continuous": lambda: ContinuousBatcher(engine)}[kind]()
    arrivals = [i * 0.002 for i in range(len(prompts))]
    outs = batcher.generate(prompts, params, arrivals=arrivals)
    assert [o.token_ids for o in outs] == reference(prompts, params)
    assert all(o.finished and o.ttft is not None for o in outs)
    assert max(batcher.batch_sizes) > 1
    assert engine.block_allocator.num_free_blocks() == engine.block_allocator.num_blocks


def test_async_engine_serves_concurrent_consumers_and_aborts_the_abandoned(path):
    import asyncio

    from nanoserve import AsyncLLMEngine

    engine = LLMEngine.from_kwargs(path, block_size=BS, num_blocks=128)
    aengine = AsyncLLMEngine(engine)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def full(prompt):
        last = None
        async for out in aengine.generate(prompt, p):
            last = out
        return last.token_ids

    async def abandon(prompt):
        async for out in aengine.generate(prompt,
                                          SamplingParams(temperature=0, max_tokens=100,
                                                         ignore_eos=True)):
            if len(out.token_ids) >= 2:
                break  # the client goes away

    async def main():
        return await asyncio.gather(full([1, 2, 3]), full([4, 5]), abandon([6, 7, 8]), full([9]))

    results = asyncio.run(main())
    solo = LLM(path, block_size=BS, num_blocks=128)
    expected = [solo.generate([pr], p)[0].token_ids for pr in ([1, 2, 3], [4, 5], [9])]
    assert [results[0], results[1], results[3]] == expected
    assert not engine.has_unfinished_requests()
    assert engine.block_allocator.num_free_blocks() == engine.block_allocator.num_blocks


def test_enqueue_compares_log_n_keys_and_keeps_the_order(monkeypatch):
    """Inserting into the waiting queue reads O(log n) sort keys (a binary search), not the whole
    queue's: 4,000 arrivals read at most n·(log2 n + 2) keys. Control: rebuilding the key list on
    every insert (the old way) reads ~n²/2. Mixed priorities, so inserts land mid-queue too."""
    import math

    from nanoserve.engine import scheduler as sched_module
    from nanoserve.engine.block_allocator import BlockAllocator
    from nanoserve.engine.scheduler import Scheduler, SchedulerConfig
    from nanoserve.engine.sequence import Sequence

    reads = [0]
    plain_key = Sequence.sort_key.fget

    def counted(seq):
        reads[0] += 1
        return plain_key(seq)

    monkeypatch.setattr(Sequence, "sort_key", property(counted))
    rng, n = random.Random(0), 4000
    seqs = [Sequence([1], priority=rng.choice([0, 0, 0, 1, -1]),
                     arrival_time=float(i)) for i in range(n)]

    def fill() -> list:
        s = Scheduler(SchedulerConfig(), BlockAllocator(8, BS), max_model_len=64)
        reads[0] = 0
        for seq in seqs:
            s.add(seq)
        return s.waiting

    waiting = fill()
    assert reads[0] <= n * (math.log2(n) + 2)
    assert waiting == sorted(seqs, key=plain_key)  # in (priority, arrival) order
    # control: the old insert, which rebuilt every key each time
    def rebuild_keys(self, seq):
        keys = [s.sort_key for s in self.waiting]
        self.waiting.insert(sched_module.bisect.bisect(keys, seq.sort_key), seq)

    monkeypatch.setattr(Scheduler, "_enqueue", rebuild_keys)
    assert fill() == waiting and reads[0] > n * n / 4
