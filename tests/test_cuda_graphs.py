"""CUDA graphs for decode (nanoserve/engine/cuda_graph.py).

On the CPU: the buckets, and the static buffers — a decode step copied into a bucket's buffers and
run through the very forward a graph would replay computes the eager step's logits, and its
padding rows write no K/V. On a GPU (`-m gpu`): graph replay gives the eager engine's tokens.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.cuda_graph import DecodeBuffers, graph_buckets, pick_bucket
from nanoserve.engine.llm_engine import LLMEngine


@pytest.mark.parametrize("max_num_seqs, buckets", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (16, [1, 2, 4, 8, 16]), (20, [1, 2, 4, 8, 16, 20]),
    (64, [1, 2, 4, 8, 16, 32, 48, 64]),
])
def test_buckets(max_num_seqs, buckets):
    assert graph_buckets(max_num_seqs) == buckets
    assert [pick_bucket(b, buckets) for b in range(1, max_num_seqs + 1)] == [
        min(x for x in buckets if x >= b) for b in range(1, max_num_seqs + 1)]
    assert pick_bucket(max_num_seqs + 1, buckets) is None


def _decode_step(backend: str, rows: int):
    """An engine after its prefill, and the prepared inputs of its first decode step."""
    engine = LLMEngine.from_kwargs("demo", attention_backend=backend, block_size=4, num_blocks=96)
    for i in range(rows):
        engine.add_request("ROMEO:" * (i + 1),
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill (and the first tokens)
    sched = engine.scheduler.schedule()
    assert sched.num_new == [1] * rows
    return engine, engine.runner.prepare(sched.seqs, sched.num_new, [1] * rows)


def test_a_bucket_forward_on_the_static_buffers_equals_the_eager_step():
    engine, inputs = _decode_step("triton", rows=3)  # graphs serve the triton backend only
    runner = engine.runner
    b = pick_bucket(3, graph_buckets(8))  # 4: one padding row
    buf = DecodeBuffers(8, max_blocks=32, max_context=engine.max_model_len, device="cpu")
    pool_k, pool_v = runner.kv.k.clone(), runner.kv.v.clone()
    eager = runner.execute(inputs)  # 3, 1, V  (writes the 3 new tokens' K/V)
    runner.kv.k.copy_(pool_k)
    runner.kv.v.copy_(pool_v)
    assert buf.fill(inputs, b) == 3
    static = runner.execute(_graph_inputs(buf, b))  # what the graph of bucket 4 records
    # the same rows in a batch of 4 instead of 3: equal up to the matmuls' summation order
    assert static.shape[0] == b and (static[:3] - eager).abs().max() < 1e-4
    slots = inputs.meta.slot_mapping.flatten().tolist()  # the only slots the step may write
    changed = (
        ((runner.kv.k != pool_k) | (runner.kv.v != pool_v)).any(dim=(0, 3, 4)).flatten().nonzero()
    )
    assert set(changed.flatten().tolist()) <= set(slots)


def _graph_inputs(buf: DecodeBuffers, b: int):
    from nanoserve.engine.model_runner import ForwardInputs

    return ForwardInputs(buf.input_ids[:b], buf.positions[:b], buf.logit_index[:b], buf.meta(b))


def test_fill_pads_and_keeps_the_addresses():
    engine, inputs = _decode_step("torch", rows=2)
    buf = DecodeBuffers(4, max_blocks=8, max_context=128, device="cpu")
    meta = buf.meta(4)
    before = [
        t.data_ptr() for t in (meta.slot_mapping, meta.block_tables, meta.context_lens, meta.dst)
    ]
    buf.block_tables.fill_(7)  # stale values from an earlier step
    buf.fill(inputs, 4)
    after = buf.meta(4)
    assert [t.data_ptr() for t in (after.slot_mapping, after.block_tables, after.context_lens,
                                   after.dst)] == before
    M = inputs.meta.block_tables.shape[1]
    assert torch.equal(buf.block_tables[:2, :M],
                       inputs.meta.block_tables) and (buf.block_tables[:2, M:] == 0).all()
    assert (
        buf.slot_mapping[2:].eq(-1).all() and buf.context_lens[2:].eq(1).all()
        and buf.block_tables[2:].eq(0).all()
    )
    assert torch.equal(after.dst, buf.slot_mapping[:4].flatten())


def test_fill_negative_control_without_padding_the_stale_rows_write_kv():
    """The padding matters: rows left from an earlier, larger step would write their old slots."""
    engine, inputs = _decode_step("triton", rows=2)
    buf = DecodeBuffers(4, max_blocks=32, max_context=128, device="cpu")
    buf.slot_mapping[2:] = torch.tensor([[40], [41]])  # a stale step's rows
    buf.pad = lambda start, end: None  # the bug
    buf.fill(inputs, 4)
    before = engine.runner.kv.k[:, 10].clone()  # block 10 holds slots 40..43
    engine.runner.execute(_graph_inputs(buf, 4))
    assert not torch.equal(engine.runner.kv.k[:, 10], before)


def test_graphs_are_off_on_a_cpu_and_with_enforce_eager():
    assert "CUDA device" in LLMEngine.from_kwargs("demo").cuda_graphs_off
    assert LLMEngine.from_kwargs("demo", enforce_eager=True).cuda_graphs_off == "enforce_eager=True"


@pytest.mark.gpu
@pytest.mark.parametrize("num_prompts", [1, 3, 5, 17])
def test_graph_replay_gives_the_eager_tokens(num_prompts):
    prompts = [("ROMEO:" * (1 + i % 5))[: 8 + 3 * i] for i in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    graphs = LLM("demo", device="cuda", dtype="float32", max_num_seqs=32)
    eager = LLM("demo", device="cuda", dtype="float32", max_num_seqs=32, enforce_eager=True)
    assert graphs.engine.cuda_graphs_off is None and graphs.runner.graphs is not None
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert got == [o.token_ids for o in eager.generate(prompts, params)]
    assert graphs.runner.graphs.num_replays > 0
