"""No request can hurt another (issue 16): a fault while serving one request fails that request
alone — its output carries the error, its blocks return to the pool — and the others produce,
token for token, what they produce without it. Only broken shared state stops the engine.

Faults are injected where a real one would strike: in one row's sampling, in the logits of one
row (NaN, as an fp16 overflow gives), in the batched forward, in the draft forward, and in the
block pool's bookkeeping. Each isolation test has a negative control: an engine that lets the
fault escape `step()` (the behaviour before issue 16) must fail the same check.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine import LLMEngine
from nanoserve.errors import EngineStateError, NanoserveError, RequestFailedError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = {"a": "ROMEO:", "bad": "JULIET:", "c": "First Citizen:"}


class Injected(RuntimeError):
    """The fault the tests inject (a plain bug: not fatal)."""


def faulty_sampling(engine: LLMEngine, rid: str = "bad", after: int = 3) -> LLMEngine:
    """Handling request `rid`'s sampled token raises once it has `after` tokens."""
    emit = engine._emit

    def _emit(req, s, token, *rest):
        if req.output.request_id == rid and len(s.out.token_ids) >= after:
            raise Injected(f"injected fault while sampling request {rid!r}")
        return emit(req, s, token, *rest)

    engine._emit = _emit
    return engine


def unisolated(engine: LLMEngine) -> LLMEngine:
    """Negative control: a request's fault escapes step(), as before issue 16."""

    def _fail_request(req, error):
        raise error

    engine._fail_request = _fail_request
    return engine


@pytest.fixture(scope="module")
def solo() -> dict[str, list[int]]:
    llm = LLM("demo")
    return {rid: llm.generate(p, GREEDY)[0].token_ids for rid, p in PROMPTS.items()}


def _drive(engine: LLMEngine, params=GREEDY) -> dict:
    for rid, prompt in PROMPTS.items():
        engine.add_request(prompt, params, request_id=rid)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 500, "the engine made no progress"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _assert_isolated(engine: LLMEngine, done: dict, solo: dict, says: str) -> None:
    bad = done["bad"]
    assert bad.error is not None and says in bad.error, bad.error
    assert {o.finish_reason for o in bad.outputs} == {"error"}
    for rid in ("a", "c"):
        assert done[rid].error is None and done[rid].token_ids == solo[rid], rid
    bm = engine.block_allocator
    bm.check_invariants()
    assert bm.num_free_blocks() == bm.num_blocks and not engine.scheduler.has_unfinished()


def test_a_fault_in_one_row_fails_that_request_alone(solo):
    engine = faulty_sampling(LLMEngine.from_kwargs("demo"))
    _assert_isolated(engine, _drive(engine), solo, "Injected: injected fault while sampling")
    assert len(_drive(engine)["a"].token_ids) == 12  # and the engine serves on


def test_isolation_negative_control_an_escaping_fault_fails_the_check(solo):
    engine = unisolated(faulty_sampling(LLMEngine.from_kwargs("demo")))
    with pytest.raises(Injected):
        _drive(engine)
    assert engine.has_unfinished_requests()  # the others were cut off with it


def test_a_fault_while_forking_n_samples_frees_every_child(solo):
    engine = LLMEngine.from_kwargs("demo")
    new_sample = engine.inputs.new_sample

    def faulty_fork(req, seq, i):
        if req.output.request_id == "bad" and i == 2:
            raise Injected("fault while forking sample 2")
        return new_sample(req, seq, i)

    engine.inputs.new_sample = faulty_fork
    engine.add_request(PROMPTS["bad"], SamplingParams(n=4, max_tokens=5, seed=1), request_id="bad")
    engine.add_request(PROMPTS["a"], GREEDY, request_id="a")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert "fault while forking" in done["bad"].error and done["a"].token_ids == solo["a"]
    assert engine.block_allocator.num_free_blocks() == engine.block_allocator.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_nan_logits_in_one_row_fail_that_request(solo, async_scheduling):
    engine = LLMEngine.from_kwargs("demo", async_scheduling=async_scheduling)
    run = engine.runner.run

    def poisoned(seqs, num_new, num_logits=None):  # as an fp16 overflow in one sequence would
        logits = run(seqs, num_new, num_logits)
        with torch.inference_mode():
            for i, seq in enumerate(seqs):
                if seq.request_id == "bad" and seq.num_computed_tokens > 10:
                    logits[i] = float("nan")
        return logits

    engine.runner.run = poisoned
    _assert_isolated(engine, _drive(engine), solo, "NaN logits for request 'bad'")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_forward_fails_its_batch_and_the_engine_serves_on(solo, async_scheduling):
    # "c" waits outside the failing batch
    engine = LLMEngine.from_kwargs("demo", max_num_seqs=2, async_scheduling=async_scheduling)
    run, calls = engine.runner.run, []

    def once(seqs, num_new, num_logits=None):
        calls.append(len(seqs))
        if len(calls) == 2:
            raise Injected("fault in the batched forward")
        return run(seqs, num_new, num_logits)

    engine.runner.run = once
    done = _drive(engine)
    assert (
        "fault in the batched forward" in done["a"].error
        and "fault in the batched forward" in done["bad"].error
    )
    assert done["c"].error is None and done["c"].token_ids == solo["c"]
    assert engine.block_allocator.num_free_blocks() == engine.block_allocator.num_blocks


def test_a_failed_draft_forward_fails_the_speculating_requests_only(solo):
    engine = LLMEngine.from_kwargs("demo", speculative="ngram", num_speculative_tokens=3,
                                   speculative_adaptive=False)
    propose, in_failed_batch = engine.spec.propose_and_extend, set()

    def faulty(rows, *rest):
        if any(seq.request_id == "bad" and len(seq) > 12 for seq, *_ in rows):
            in_failed_batch.update(seq.request_id for seq, *_ in rows)
            raise Injected("fault while drafting")
        return propose(rows, *rest)

    engine.spec.propose_and_extend = faulty
    done = _drive(engine)
    failed = {rid for rid, out in done.items() if out.error is not None}
    # the requests drafting in that one forward
    assert failed == in_failed_batch and "bad" in failed
    assert all("fault while drafting" in done[rid].error for rid in failed)
    assert all(done[rid].token_ids == solo[rid] for rid in set(done) - failed)
    assert engine.block_allocator.num_free_blocks() == engine.block_allocator.num_blocks
    engine.spec.propose_and_extend = propose
    # the engine serves on
    assert {rid: out.token_ids for rid, out in _drive(engine).items()} == solo


def test_broken_shared_state_stops_the_engine():
    engine = LLMEngine.from_kwargs("demo")
    engine.add_request("ROMEO:", GREEDY, request_id="a")
    engine.step()
    seq = engine.requests["a"].samples[0].seq
    # the pool now believes these blocks are free while seq uses them
    engine.block_allocator.free(seq)
    seq.block_table = [0]
    with pytest.raises(EngineStateError):
        while engine.has_unfinished_requests():
            engine.step()


def test_a_running_sequence_with_nothing_to_compute_is_an_error_not_a_hang():
    engine = LLMEngine.from_kwargs("demo")
    engine.add_request("ROMEO:", GREEDY, request_id="a")
    engine.step()
    seq = engine.requests["a"].samples[0].seq
    seq.needs_slot = False  # as a step that sampled a token but forgot to ask for its slot
    seq.num_computed_tokens = len(seq)
    with pytest.raises(EngineStateError,
                       match=rf"sequence {seq.seq_id} of request 'a' is running with all"):
        engine.step()


def test_hang_negative_control_without_the_guard_steps_make_no_progress(monkeypatch):
    import nanoserve.engine.scheduler as scheduler

    monkeypatch.setattr(scheduler, "_check_has_work", lambda seq: None)
    engine = LLMEngine.from_kwargs("demo")
    engine.add_request("ROMEO:", GREEDY, request_id="a")
    engine.step()
    seq = engine.requests["a"].samples[0].seq
    seq.needs_slot, seq.num_computed_tokens = False, len(seq)
    assert [engine.step() for _ in range(3)] == [[], [], []] and engine.has_unfinished_requests()


# ----------------------------------------------------------------------------- LLM.generate's
# params
def test_generate_takes_one_params_per_prompt_as_vllm_does(solo):
    llm = LLM("demo")
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([PROMPTS["a"], PROMPTS["c"]], [GREEDY, short])
    assert outs[0].token_ids == solo["a"] and outs[1].token_ids == solo["c"][:3]
    assert [o.token_ids for o in llm.generate([PROMPTS["a"]], GREEDY)] == [solo["a"]]


@pytest.mark.parametrize("params, says", [
    ([GREEDY], "got 1 SamplingParams for 2 prompts"),
    ([GREEDY, {"max_tokens": 3}], "params[1] is a dict, not a SamplingParams"),
    ({"max_tokens": 3}, "got dict"),
])
def test_generate_refuses_params_of_the_wrong_length_or_type(params, says):
    llm = LLM("demo")
    with pytest.raises(NanoserveError, match=says.replace("[", r"\[").replace("]", r"\]")):
        llm.generate(["a", "b"], params)
    assert not llm.engine.has_unfinished_requests()


def test_generate_raises_the_failed_request_and_leaves_nothing_behind():
    llm = LLM("demo")
    faulty_sampling(llm.engine, rid="1")
    with pytest.raises(RequestFailedError, match="request 1 failed: Injected"):
        llm.generate(["ROMEO:", "JULIET:"], GREEDY)  # request ids "0" and "1"
    bm = llm.block_allocator
    assert not llm.engine.has_unfinished_requests() and bm.num_free_blocks() == bm.num_blocks


def test_the_seed_is_checked_with_room_for_n_samples():
    llm = LLM("demo")
    out = llm.generate("ab", SamplingParams(n=2, seed=2**63 - 2, max_tokens=3))[0]
    assert len(out.outputs) == 2
    gen = torch.Generator().manual_seed(2**63 - 1)  # the last sample's seed is a valid torch seed
    assert gen.initial_seed() == 2**63 - 1
