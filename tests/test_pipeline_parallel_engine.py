"""The engine in pipeline stages (nanoserve/parallel/stage_runner.py): LLM(model,
pipeline_parallel_size=N) on gloo.

The oracle is the same engine on one process (itself proven against HF transformers elsewhere):
greedy tokens equal and logprobs within 1e-4 under continuous batching with prefix-cache hits,
preemption (a pool too small) and n = 2 samples (copy-on-write copies, sent to every stage),
`LLM.logits` within 1e-5 — on GPT-2, a Qwen3 whose second layer has a sliding window (it sits on
stage 1: layers keep their numbers), a Gemma 3 over 3 stages, and a GQA Llama on the triton backend
(interpreted) over an int8 KV pool. Each rank's pool holds its layers only and its model its blocks
only. Negative control: rank 0's stage reading and writing one layer of its pool for all its blocks
(the layer offset ignored) changes the tokens. A killed stage fails the engine by name; refusals.
The server that finds its engine dead exits by itself: tests/test_server_exit.py.
"""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel_engine import GREEDY, PROMPTS, _one_group_at_a_time, _run  # noqa: F401  (autouse fixture)

from nanoserve import LLM, NanoserveError, SamplingParams
from nanoserve.parallel.workers import WorkerGroupError


@pytest.mark.parametrize("case,stages,extra", [
    ("gpt2", 2, {}),
    ("qwen3-window", 2, {}),
    ("gemma3", 3, {}),
    ("llama-gqa", 2, dict(attention_backend="triton", kv_cache_dtype="int8")),
])
def test_stages_in_the_engine_equal_one_process(hf_checkpoints, case, stages, extra):
    path = str(hf_checkpoints[case][0])
    # too few blocks: preemption
    kw = dict(dtype="float32", block_size=4, num_blocks=24, max_num_seqs=4, **extra)
    one = LLM(path, **kw)
    want_tokens, want_lps = _run(one)
    llm = LLM(path, pipeline_parallel_size=stages, **kw)
    got_tokens, got_lps = _run(llm)
    assert got_tokens == want_tokens
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(got_lps, want_lps))
    assert llm.engine.scheduler.num_preemptions > 0
    # forks: copy-on-write copies
    two = SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True)
    assert _run(llm, PROMPTS[:1], two)[0] == _run(one, PROMPTS[:1], two)[0]
    assert torch.allclose(llm.logits(PROMPTS[1]), one.logits(PROMPTS[1]), atol=1e-5, rtol=1e-5)
    n0 = -(-one.config.n_layers // stages)  # stage 0's blocks (the first stages take the remainder)
    # rank 0: its layers only
    assert llm.engine.runner.kv.k.shape[0] == n0 and len(_blocks(llm.model)) == n0
    assert llm.engine.cuda_graphs_off.startswith("pipeline parallelism runs eagerly")


def _blocks(model):
    body = model.transformer if hasattr(model, "transformer") else model.model
    return body.h if hasattr(body, "h") else body.layers


def test_each_stage_needs_its_own_layers_of_the_pool(hf_checkpoints):
    """The negative control: rank 0's two blocks both reading and writing the first layer of its
    pool (a stage's layers not told apart) — the same engine that gave one process's tokens gives
    others."""
    path = str(hf_checkpoints["gemma3"][0])  # 3 blocks: stage 0 holds two of them
    kw = dict(dtype="float32", block_size=4)
    one, llm = LLM(path, **kw), LLM(path, pipeline_parallel_size=2, **kw)
    assert _run(llm, PROMPTS[:2])[0] == _run(one, PROMPTS[:2])[0]
    # (the pool itself: the runner's view of it also sends copies)
    pool = llm.engine.runner.kv._cache
    layer = pool.layer
    # every block of the stage on one layer of the pool
    pool.layer = lambda i: layer(pool.first_layer)
    assert _run(llm, PROMPTS[2:])[0] != _run(one, PROMPTS[2:])[0]


def test_the_first_stage_starts_the_next_micro_batch_before_the_logits_of_the_last_come_back(
    hf_checkpoints,
):
    """GPipe's order within a step: rank 0 computes every part of a forward (sending each on) before
    it waits for the first part's logits — while stage 1 works on part 0, stage 0 works on part
    1."""
    llm = LLM(str(hf_checkpoints["gpt2"][0]), dtype="float32", pipeline_parallel_size=2)
    stage0, events = llm.engine.runner.runner, []
    compute, receive = stage0._stage, stage0._receive_logits
    stage0._stage = lambda inputs: events.append(("compute",
                                                  len(inputs.input_ids))) or compute(inputs)
    stage0._receive_logits = lambda b, K: events.append(("receive", b)) or receive(b, K)
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([p[:6] for p in PROMPTS] + [PROMPTS[0][2:8]], two, use_tqdm=False)
    # 4 rows of 6 tokens: one forward in 2 parts; then one decode step
    prefill, decode = events[:4], events[4:]
    assert prefill == [("compute", 2), ("compute", 2), ("receive", 2), ("receive", 2)]
    assert decode == prefill


def test_a_killed_stage_fails_the_engine_by_name(hf_checkpoints):
    path = str(hf_checkpoints["gpt2"][0])
    llm = LLM(path, dtype="float32", pipeline_parallel_size=2)
    worker = llm.engine.workers.procs[0]
    worker.kill()
    worker.join()
    with pytest.raises(WorkerGroupError,
                       match=r"pipeline-parallel group failed: rank 1 \(exit code -9\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not torch.distributed.is_initialized()  # the group is gone: another engine may start


def test_an_idle_engine_keeps_its_workers_past_the_exchange_timeout(hf_checkpoints, monkeypatch):
    """A worker waits for rank 0's next message without a time limit (workers.py: the control
    group): an engine idle for longer than the exchanges' timeout (shortened to 5 s in the workers
    here) still runs. Before, the worker's wait timed out with the exchanges' 60 s and an idle
    server lost its worker (found under CI load)."""
    import time

    # read by the spawned workers as they import workers.py
    monkeypatch.setenv("NANOSERVE_DIST_TIMEOUT", "5")
    path = str(hf_checkpoints["gpt2"][0])
    llm = LLM(path, dtype="float32", pipeline_parallel_size=2)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # idle on purpose, longer than the workers' timeout: the condition under test, not a wait on a
    # step
    time.sleep(8)
    assert all(p.is_alive() for p in llm.engine.workers.procs)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == first


def test_what_the_staged_engine_does_not_run_is_refused_by_name(hf_checkpoints):
    path = str(hf_checkpoints["gpt2"][0])  # 2 blocks
    for kw, match in [(dict(pipeline_parallel_size=0),
                       "pipeline_parallel_size=0 must be an integer ≥ 1"),
                      (dict(pipeline_parallel_size=3),
                       "a model of 2 blocks splits into 1..2 stages"),
                      (dict(pipeline_parallel_size=2, tensor_parallel_size=2),
                       "one kind of split at a time"),
                      (dict(pipeline_parallel_size=2, speculative="ngram"),
                       "speculative decoding is not supported with pipeline_parallel_size=2"),
                      (dict(pipeline_parallel_size=2, enable_lora=True),
                       "enable_lora is not supported with pipeline_parallel_size=2")]:
        with pytest.raises(NanoserveError, match=match):
            LLM(path, dtype="float32", **kw)
        assert not torch.distributed.is_initialized()
