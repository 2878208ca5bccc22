"""CUDA graphs for decode (nanoserve/engine/cuda_graph.py).

On the CPU: the buckets, and the static buffers — a decode step or a speculative verification
copied into a bucket's buffers and run through the very forward a graph would replay computes the
eager step's logits, and its padding writes no K/V; the engine's whole graph path with each
"graph" replayed by running its forward again gives plain greedy decoding's tokens. On a GPU
(`-m gpu`): graph replay gives the eager engine's tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.cuda_graph import (
    CudaGraphRunner,
    DecodeBuffers,
    VerifyBuffers,
    graph_buckets,
    pick_bucket,
)
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


# --------------------------------------------------------------------------- verification graphs
def _verify_step(num_drafts: list[int]):
    """An engine after its prefill (triton backend), each row extended by its drafts, and the
    prepared inputs of the verification forward: row i computes 1 + num_drafts[i] tokens and
    returns every position's logits."""
    engine = LLMEngine.from_kwargs("demo", attention_backend="triton", block_size=4,
                                   num_blocks=96)
    for i in range(len(num_drafts)):
        engine.add_request("ROMEO:" * (i + 1),
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    seqs = engine.scheduler.schedule().seqs  # a decode step: each last token gets its slot
    for seq, n in zip(seqs, num_drafts):
        engine.scheduler.extend(seq, [5 + j for j in range(n)])  # any drafts will do
    num_new = [len(s) - s.num_computed_tokens for s in seqs]
    assert num_new == [1 + n for n in num_drafts]
    return engine, seqs, engine.runner.prepare(seqs, num_new, num_new)


def _verify_inputs(buf: VerifyBuffers, b: int, T: int):
    from nanoserve.engine.model_runner import ForwardInputs

    v = buf.views(b, T)
    return ForwardInputs(v["input_ids"], v["positions"], v["logit_index"], buf.meta(b, T))


def _eager_and_static(num_drafts: list[int], b: int, T: int):
    """The eager verification's logits and the (b, T) bucket's on the static buffers, from the
    same pool, and the slots the static forward changed."""
    engine, seqs, inputs = _verify_step(num_drafts)
    runner = engine.runner
    pool_k, pool_v = runner.kv.k.clone(), runner.kv.v.clone()
    eager = runner.execute(inputs)  # B, T_in, V
    runner.kv.k.copy_(pool_k)
    runner.kv.v.copy_(pool_v)
    buf = VerifyBuffers(8, max_tokens=6, max_blocks=32, max_context=engine.max_model_len,
                        device="cpu")
    assert buf.fill(inputs, b, T) == len(num_drafts)
    static = runner.execute(_verify_inputs(buf, b, T))  # b, T, V
    changed = (
        ((runner.kv.k != pool_k) | (runner.kv.v != pool_v)).any(dim=(0, 3, 4)).flatten().nonzero()
    )
    return eager, static, set(changed.flatten().tolist()), inputs


def test_a_verification_on_the_static_buffers_equals_the_eager_one():
    """Rows of 4, 2 and 3 tokens in the bucket (4 rows, 5 tokens): one padding row, and padding
    tokens at the end of every row; each row's own positions give the eager logits, and only the
    real tokens' slots are written."""
    drafts = [3, 1, 2]
    eager, static, changed, inputs = _eager_and_static(drafts, b=4, T=5)
    assert static.shape[:2] == (4, 5)
    for i, n in enumerate(drafts):
        assert (static[i, :n + 1] - eager[i, :n + 1]).abs().max() < 1e-4
    real = [s for s in inputs.meta.slot_mapping.flatten().tolist() if s >= 0]
    assert changed <= set(real) and len(real) == sum(drafts) + len(drafts)


def test_verification_buffers_negative_control_a_stale_prefix_changes_the_logits():
    """Each row's cached prefix must be copied: left at zero, its tokens see no context."""
    drafts = [3, 1, 2]

    def fill_without_prefix(buffers):
        def fill(inputs, b, T):
            B = buffers.fill(inputs, b, T)
            buffers.prefix_lens.zero_()
            return B
        return fill

    engine, _, inputs = _verify_step(drafts)
    buf = VerifyBuffers(8, max_tokens=6, max_blocks=32, max_context=engine.max_model_len,
                        device="cpu")
    eager = engine.runner.execute(inputs)
    fill_without_prefix(buf)(inputs, 4, 5)
    static = engine.runner.execute(_verify_inputs(buf, 4, 5))
    assert (static[0, :4] - eager[0, :4]).abs().max() > 1e-2


class EagerReplays(CudaGraphRunner):
    """A CudaGraphRunner whose "graphs" run their recorded forward again on each replay: on a CPU,
    the engine's whole graph path (buckets, buffers, shared logits) with only the capture left
    out."""

    def _record(self, forward):
        forward()  # the warm-up a capture runs first
        return SimpleNamespace(replay=forward)

    def run_verify(self, inputs):
        """(Each replay's real tokens per row recorded.)"""
        self.verified = getattr(self, "verified", [])
        self.verified.append((inputs.meta.slot_mapping >= 0).sum(1).tolist())
        return super().run_verify(inputs)


def test_speculation_through_replayed_graphs_gives_the_eager_tokens():
    """Greedy speculation whose verifications and draft steps go through the graph path (replayed
    eagerly on this CPU) gives the tokens of plain greedy decoding, rows of different γ in one
    bucket included."""
    prompts = ["ROMEO:", "To be, or not to be", "KING"]
    # γ is capped by the tokens a row has left: near the end the rows' γ differ
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (13, 10, 8)]
    plain = LLM("demo", attention_backend="triton", block_size=4)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM("demo", attention_backend="triton", block_size=4, max_num_seqs=4,
               speculative_model="demo-draft", num_speculative_tokens=3,
               speculative_adaptive=False)
    engine = spec.engine
    for runner, tokens in ((engine.runner, 4), (engine.spec.proposer.runner, 1)):
        runner.graphs = EagerReplays(runner, 4, engine.max_model_len, tokens)
        runner.graphs.capture()
    got = [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    verified = engine.runner.graphs.verified
    assert len(verified) >= 3 and any(len(set(rows)) > 1 for rows in verified), verified
    assert engine.spec.proposer.runner.graphs.num_replays > 3


@pytest.mark.gpu
def test_speculative_graph_replay_gives_the_eager_tokens():
    """Verification graphs (and the draft's decode graphs) on a GPU: the eager engine's tokens."""
    prompts = ["ROMEO:", "To be, or not to be", "KING", "First Citizen:"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 33, 27, 9)]
    kwargs = dict(device="cuda", dtype="float32", max_num_seqs=8, speculative_model="demo-draft",
                  num_speculative_tokens=3, speculative_adaptive=False)
    graphs = LLM("demo", **kwargs)
    eager = LLM("demo", enforce_eager=True, **kwargs)
    assert graphs.engine.cuda_graphs_off is None and graphs.runner.graphs.verify_graphs
    got = [o.token_ids for o in graphs.generate(prompts, params)]
    assert got == [o.token_ids for o in eager.generate(prompts, params)]
    assert graphs.runner.graphs.num_replays > 0
