"""Async scheduling (engine/async_step.py): each step is launched before the last one's tokens
reach the host, and the tokens it produces are those of the synchronous loop.

The reference is the synchronous engine itself (`LLMEngine.sync_step`, the path every other test
proves against transformers): the same requests through both loops give the same tokens, text and
finish reasons — with requests joining mid-run, chunked prefill, preemption under a small pool,
stop strings and stop tokens one step late, max_tokens=1, seeded sampling and aborts, on both
attention backends. The overlap itself is checked where a CPU can see it: when a steady step's
forward runs, its rows' newest tokens are not on the host yet (placeholders), and the step reads
one value back, after the forward. Negative controls: feeding the forward a wrong id where a
placeholder is, and the synchronous loop under the overlap check.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from test_no_host_sync import SyncSpy

from nanoserve import SamplingParams
from nanoserve.engine import async_step
from nanoserve.engine.async_step import PLACEHOLDER
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.errors import NanoserveError
from nanoserve.kv.metadata import CommonAttentionMetadata

PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo", "KING:", "To be, or not to be", "First Citizen:",
           "MENENIUS:", "All:"]
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, max_tokens=17),
          SamplingParams(temperature=0, max_tokens=1),
          SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=30, stop=["e"]),
          SamplingParams(temperature=0.7, top_k=20, seed=11, max_tokens=20, stop_token_ids=[10]),
          SamplingParams(temperature=0, max_tokens=9, stop=["\n"]),
          SamplingParams(temperature=1.0, seed=7, max_tokens=26, ignore_eos=True)]


def _run(engine: LLMEngine, prompts=PROMPTS, params=PARAMS, abort: dict | None = None) -> dict:
    """Every request to the end, `abort` = {request id: step} aborted at that step; the outputs
    (token ids, text, finish reason) by request id."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, request_id=str(i))
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 1000, "the engine made no progress"
        for rid, at in (abort or {}).items():
            if at == steps and rid in engine.requests:
                done[rid] = engine.requests[rid].output
                engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    allocator = engine.block_allocator
    allocator.check_invariants()
    assert allocator.num_free_blocks() == allocator.num_blocks, "blocks leaked"
    assert not engine.scheduler.has_unfinished()
    return {rid: [(o.token_ids, o.text, o.finish_reason) for o in out.outputs]
            for rid, out in done.items()}


def _both(abort=None, prompts=PROMPTS, params=PARAMS, **kwargs) -> tuple[dict, dict, LLMEngine]:
    """The same requests through the synchronous and the overlapped loop."""
    sync = _run(LLMEngine.from_kwargs("demo", **kwargs), prompts, params, abort)
    engine = LLMEngine.from_kwargs("demo", async_scheduling=True, **kwargs)
    return sync, _run(engine, prompts, params, abort), engine


WORKLOADS = {
    "requests join mid-run": dict(max_num_seqs=3),
    "chunked prefill": dict(max_num_seqs=4, max_num_batched_tokens=8),
    "preemption": dict(max_num_seqs=7, num_blocks=12, block_size=4),
    "prefix hits": dict(max_num_seqs=2, block_size=4),
}


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_the_overlapped_loop_gives_the_synchronous_loops_tokens(workload):
    prompts, params = PROMPTS, PARAMS
    if workload == "prefix hits":  # the same prompt again: its blocks come from the prefix cache
        prompts, params = PROMPTS[:3] * 2, PARAMS[:3] * 2
    sync, overlapped, engine = _both(prompts=prompts, params=params, **WORKLOADS[workload])
    assert overlapped == sync
    assert engine.overlap.num_sync_steps == 0  # nothing here needs its tokens on the host
    if workload == "preemption":
        assert engine.scheduler.num_preemptions > 0
    lengths = [len(outs[0][0]) for outs in sync.values()]
    assert 1 in lengths and max(lengths) >= 20  # max_tokens=1 and long runs both happened


def test_the_overlapped_loop_gives_the_synchronous_loops_tokens_on_the_triton_backend():
    """Fewer and shorter requests (Triton's interpreter is slow), joining mid-run, preempted."""
    params = [dataclasses.replace(p, max_tokens=min(p.max_tokens, 8)) for p in PARAMS[:4]]
    sync, overlapped, engine = _both(prompts=PROMPTS[:4], params=params, max_num_seqs=3,
                                     num_blocks=9, block_size=4, attention_backend="triton")
    assert overlapped == sync and engine.scheduler.num_preemptions > 0


def test_aborts_while_a_token_is_in_flight():
    """An aborted request's output lacks the token that was in flight (at most one); the others
    are untouched."""
    aborts = {"0": 5, "3": 9, "6": 2}
    sync, overlapped, _ = _both(abort=aborts, max_num_seqs=4)
    for rid, outs in sync.items():
        if rid not in aborts:
            assert overlapped[rid] == outs
            continue
        (tokens, _, reason), = outs
        (late, _, late_reason), = overlapped[rid]
        assert reason == late_reason == "abort" and late == tokens[: len(late)]
        assert len(tokens) - len(late) <= 1


def test_requests_that_need_their_tokens_on_the_host_run_synchronously():
    """A grammar, logprobs, a penalty or n > 1 make the loop fall back while such a request
    lives; the tokens stay those of the synchronous loop, and the overlap resumes after."""
    needy = [SamplingParams(temperature=0, max_tokens=6, logprobs=2),
             SamplingParams(temperature=0, max_tokens=5, repetition_penalty=1.3),
             SamplingParams(n=2, seed=4, max_tokens=4),
             SamplingParams(temperature=0, max_tokens=6, structured_outputs={"regex": "[a-z]+"})]
    prompts = PROMPTS[:4] + ["KING:", "QUEEN:", "All:", "ROMEO:"]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] + needy[:1] + \
        PARAMS[1:3] + needy[1:]
    sync, overlapped, engine = _both(prompts=prompts, params=params, max_num_seqs=8)
    assert overlapped == sync
    stepper = engine.overlap
    assert 0 < stepper.num_sync_steps < 30  # the 40-token request overlapped once alone


def test_a_steady_step_launches_before_the_last_steps_tokens_are_on_the_host(monkeypatch):
    engine = LLMEngine.from_kwargs("demo", async_scheduling=True, attention_backend="triton")
    calls = _watch_steady_steps(engine, monkeypatch)
    for newest, reads in calls:
        assert newest == [PLACEHOLDER] * 3  # every row's newest token is still on the device
        # the forward, then the one read: the tokens of the step before it
        assert reads == [("forward", "-"), ("tolist", "nanoserve.engine.async_step")], reads


def test_overlap_negative_control_the_synchronous_loop_has_its_tokens_first(monkeypatch):
    engine = LLMEngine.from_kwargs("demo", attention_backend="triton")
    for newest, reads in _watch_steady_steps(engine, monkeypatch):
        assert PLACEHOLDER not in newest
        assert reads == [("forward", "-"), ("tolist", "nanoserve.engine.sampler")], reads


def _watch_steady_steps(engine: LLMEngine, monkeypatch) -> list[tuple[list[int], list]]:
    """Three decoding requests, three steps watched after two: per step, each row's newest token
    on the host when the forward starts, and the forward among the step's reads of device values
    (the host-side building of the inputs is not watched: it reads CPU tensors by design)."""
    for prompt in PROMPTS[:3]:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    spy, newest = SyncSpy(), []
    execute, prepare = ModelRunner.execute, ModelRunner.prepare
    build = CommonAttentionMetadata.build

    def watched_execute(runner, inputs):
        newest.append([s.token_ids[-1] for s in engine.scheduler.running])
        spy.calls.append(("forward", "-"))
        return execute(runner, inputs)  # (watched too: it reads nothing back)

    fill, fills = async_step.LateTokens.fill, []

    def watched_fill(late, *args):  # inside prepare, but on the device: its reads count
        before = len(spy.calls)
        fill(late, *args)
        fills.append(spy.calls[before:])

    monkeypatch.setattr(async_step.LateTokens, "fill", watched_fill)
    monkeypatch.setattr(ModelRunner, "execute", watched_execute)
    monkeypatch.setattr(ModelRunner, "prepare", spy.unwatched(prepare))
    monkeypatch.setattr(CommonAttentionMetadata, "build", staticmethod(spy.unwatched(build)))
    steps = []
    for _ in range(3):
        spy.calls, newest[:] = [], []
        with spy:
            engine.step()
        steps.append((newest[0], spy.calls))
    monkeypatch.undo()
    assert all(reads == [] for reads in fills), fills  # the device's tokens put in place unread
    assert len(fills) == (3 if engine.overlap is not None else 0)
    return steps


def test_overlap_negative_control_a_wrong_id_where_a_placeholder_is_is_caught(monkeypatch):
    def wrong_ids(self, tokens, index_of):  # the right places, the wrong ids
        self.tokens = torch.zeros_like(tokens)
        self.index_of = index_of

    monkeypatch.setattr(async_step.LateTokens, "__init__", wrong_ids)
    sync, overlapped, _ = _both(max_num_seqs=3)
    assert overlapped != sync


def test_a_failed_draw_fails_its_rows_and_a_prefill_beside_it_goes_on(monkeypatch):
    prompts = ["KING:", PROMPTS[1] * 4]  # the second fills several steps of 16 tokens
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 2
    sync = _run(LLMEngine.from_kwargs("demo", max_num_batched_tokens=16), prompts, params)
    draw, calls = async_step.OverlappedStep._draw, []

    def failing(self, logits, due, seqs):
        calls.append([seq.request_id for seq in seqs])
        if len(calls) == 3:
            raise RuntimeError("injected fault in the draw")
        return draw(self, logits, due, seqs)

    monkeypatch.setattr(async_step.OverlappedStep, "_draw", failing)
    engine = LLMEngine.from_kwargs("demo", max_num_batched_tokens=16, async_scheduling=True)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, request_id=str(i))
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    assert calls[2] == ["0"]  # the third draw: request 0's alone, while 1 was mid-prefill
    assert "injected fault in the draw" in done["0"].error
    assert done["1"].error is None and done["1"].outputs[0].token_ids == sync["1"][0][0]
    assert engine.block_allocator.num_free_blocks() == engine.block_allocator.num_blocks


def test_a_request_id_reused_while_the_old_token_is_in_flight_gets_its_own_tokens():
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sync = _run(LLMEngine.from_kwargs("demo"), ["KING:"], [params])
    engine = LLMEngine.from_kwargs("demo", async_scheduling=True)
    engine.add_request("ROMEO:", params, request_id="0")
    engine.step()
    engine.step()
    engine.abort_request("0")  # its token is in flight
    assert _run(engine, ["KING:"], [params]) == sync


def test_a_failed_forward_after_a_stop_token_in_flight_does_not_fail_the_stopped_request():
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[32])
    sync = _run(LLMEngine.from_kwargs("demo"), ["ROMEO:"], [params])
    assert sync["0"][0][2] == "stop" and len(sync["0"][0][0]) == 3  # it stops at its third token
    engine = LLMEngine.from_kwargs("demo", async_scheduling=True)
    run, calls = engine.runner.run, []

    def fourth_fails(*args, **kwargs):  # the forward launched while the stop token is in flight
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected fault in the forward")
        return run(*args, **kwargs)

    engine.runner.run = fourth_fails
    assert _run(engine, ["ROMEO:"], [params]) == sync and len(calls) == 4


def test_a_sequence_whose_last_token_is_known_by_length_costs_no_extra_forward():
    counts = {}
    for overlap in (False, True):
        engine = LLMEngine.from_kwargs("demo", async_scheduling=overlap)
        calls = _count_forwards(engine)
        _run(engine, ["ROMEO:", "KING:"], [SamplingParams(temperature=0, max_tokens=n,
                                                          ignore_eos=True) for n in (1, 7)])
        counts[overlap] = len(calls)
    assert counts[True] == counts[False] == 7


def _count_forwards(engine: LLMEngine) -> list:
    run, calls = engine.runner.run, []

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    engine.runner.run = counted
    return calls


def test_the_servers_async_engine_streams_the_same_tokens():
    """What `nanoserve serve --async-scheduling` runs: concurrent requests through AsyncLLMEngine,
    each stream's last output equal to the synchronous engine's."""
    from nanoserve.serving.async_engine import AsyncLLMEngine

    async def serve(engine: LLMEngine) -> list:
        server = AsyncLLMEngine(engine)

        async def one(prompt, params):
            last = None
            async for out in server.generate(prompt, params):
                last = out
            return last.outputs[0].token_ids, last.outputs[0].text, last.outputs[0].finish_reason

        try:
            return await asyncio.gather(*(one(p, sp) for p, sp in zip(PROMPTS, PARAMS)))
        finally:
            await server.shutdown()

    sync = asyncio.run(serve(LLMEngine.from_kwargs("demo", max_num_seqs=4)))
    overlapped = asyncio.run(serve(LLMEngine.from_kwargs("demo", max_num_seqs=4,
                                                         async_scheduling=True)))
    assert overlapped == sync


def test_async_scheduling_is_refused_where_it_cannot_run():
    with pytest.raises(NanoserveError, match="async_scheduling does not combine with speculative"):
        LLMEngine.from_kwargs("demo", async_scheduling=True, speculative="ngram",
                              num_speculative_tokens=2)
    with pytest.raises(NanoserveError, match="async_scheduling must be True or False, got 'yes'"):
        LLMEngine.from_kwargs("demo", async_scheduling="yes")
