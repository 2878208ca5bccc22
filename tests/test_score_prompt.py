"""`SamplingParams(max_tokens=0, prompt_logprobs=k)`: the engine scores a prompt and samples
nothing (what the server's `echo` with `max_tokens: 0` runs on). The request is prefilled, its
prompt logprobs equal the model's own log-softmax (LLM.logits) and a max_tokens=1 run's, it
ends with finish reason "length" and no token, and its blocks return to the pool. The draw is never
called: with a draw that raises, such a request still finishes, while the control (max_tokens=1)
fails. max_tokens=0 without prompt_logprobs stays an error.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.errors import NanoserveError, RequestFailedError

PROMPT = "ROMEO: But soft, what light through yonder window breaks?"


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", dtype="float32")


def _pool_whole(llm: LLM) -> bool:
    allocator = llm.engine.block_allocator
    return allocator.num_free_blocks() == allocator.num_blocks


def _scored(llm: LLM, prompt=PROMPT, k: int = 2, **params):
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=k, **params),
                       use_tqdm=False)[0]
    return out


def test_the_prompt_is_scored_and_nothing_is_generated(llm):
    out = _scored(llm)
    (sample,) = out.outputs
    assert sample.token_ids == [] and sample.text == "" and sample.finish_reason == "length"
    assert out.first_token_time is None and out.finished and _pool_whole(llm)
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    want = llm.logits(ids).float().log_softmax(-1)  # T, V: position p scores token p + 1
    got = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]
    assert got == pytest.approx(want[torch.arange(len(ids) - 1), ids[1:]].tolist(), abs=1e-4)
    one = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs == one.prompt_logprobs  # the same scores, top-k included


def test_n_samples_all_end_at_the_prefill(llm):
    out = _scored(llm, n=3, k=0)
    assert [(o.index, o.token_ids, o.finish_reason) for o in out.outputs] == [
        (i, [], "length") for i in range(3)]
    assert _pool_whole(llm)


def test_a_prompt_prefilled_in_chunks_ends_after_its_last_chunk():
    chunked = LLM("demo", dtype="float32", max_num_batched_tokens=8)
    whole = LLM("demo", dtype="float32")
    got, want = _scored(chunked), _scored(whole)
    assert len(got.prompt_token_ids) > 3 * 8  # several chunks
    assert got.outputs[0].finish_reason == "length" and got.outputs[0].token_ids == []
    assert [e and e.keys() for e in got.prompt_logprobs] == [
        e and e.keys() for e in want.prompt_logprobs]
    assert _pool_whole(chunked)


def test_async_scheduling_gives_the_same_scores(llm):
    overlapped = LLM("demo", dtype="float32", async_scheduling=True)
    assert _scored(overlapped).prompt_logprobs == _scored(llm).prompt_logprobs
    assert _pool_whole(overlapped)


def test_no_token_is_drawn_and_the_control_draws_one(llm, monkeypatch):
    def no_draw(*args):
        raise RuntimeError("the draw ran")

    monkeypatch.setattr(llm.engine, "_draw", no_draw)
    assert _scored(llm).outputs[0].finish_reason == "length"
    with pytest.raises(RequestFailedError, match="the draw ran"):  # the control: max_tokens=1
        llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    monkeypatch.undo()
    assert _pool_whole(llm)


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"max_tokens": 0, "logprobs": 2},
                                    {"max_tokens": -1, "prompt_logprobs": 1}])
def test_max_tokens_zero_needs_prompt_logprobs(kwargs):
    with pytest.raises(NanoserveError, match=rf"max_tokens={kwargs['max_tokens']} must be an "
                                             r"integer ≥ 1 \(0 only with prompt_logprobs"):
        SamplingParams(**kwargs)
