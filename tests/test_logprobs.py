"""Logprobs (engine/logprobs.py): each sampled and prompt token's log-probability and the top-k, raw
(log_softmax of the model's logits), against a full forward without a cache (`LLM.logits`) and
against HF transformers on a tiny random checkpoint; through chunked prefill, the prefix cache, n >
1, preemption and speculative decoding."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM
from nanoserve.engine.logprobs import compute_logprobs
from nanoserve.engine.sampler import SamplingParams
from nanoserve.errors import NanoserveError

# fp32: decode attention over the cache (the CPU's C kernel) sums in another order than a full
# forward
TOL = 5e-5
PROMPT = "ROMEO: what light through yonder window breaks? It is the east, and Juliet is the sun."


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", max_num_batched_tokens=24)  # prompts of ~90 tokens prefill in 4 chunks


def check_entry(entry: dict, token: int, ref_row: torch.Tensor, k: int) -> float:
    """entry == the reference row's: chosen token first with its logprob and rank, then the top-k;
    returns the largest |Δ|."""
    assert next(iter(entry)) == token, "the chosen token comes first"
    top = ref_row.topk(k)
    assert set(entry) == {token, *top.indices.tolist()}, "the chosen token and exactly the top-k"
    err = abs(entry[token].logprob - ref_row[token].item())
    assert entry[token].rank == int((ref_row > ref_row[token]).sum()) + 1
    for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
        if t != token:
            assert entry[t].rank == r + 1
        err = max(err, abs(entry[t].logprob - v))
    return err


def test_sampled_and_prompt_logprobs_equal_a_full_forward(llm):
    """Chunked prefill (4 chunks), sampling at T = 0.8 with top-k (the logprobs stay raw), k = 3 and
    2."""
    params = SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=12, logprobs=3,
                            prompt_logprobs=2,
                            ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    ids, gen = out.prompt_token_ids, out.token_ids
    ref = llm.logits(ids + gen).log_softmax(-1)  # T, V
    P = len(ids)
    assert len(out.prompt_logprobs) == P and out.prompt_logprobs[0] is None
    errs = [check_entry(out.prompt_logprobs[i], ids[i], ref[i - 1], 2) for i in range(1, P)]
    c = out.outputs[0]
    assert len(c.logprobs) == len(gen) == 12
    errs += [check_entry(c.logprobs[i], t, ref[P - 1 + i], 3) for i, t in enumerate(gen)]
    assert max(errs) <= TOL
    assert c.cumulative_logprob == pytest.approx(
        sum(c.logprobs[i][t].logprob for i, t in enumerate(gen))
    )
    assert c.logprobs[0][gen[0]].decoded_token == llm.engine.tokenizer.decode([gen[0]])


def test_logprobs_match_hf_transformers(hf_checkpoints):
    """An outside oracle: HF's log_softmax on a tiny random Llama (randomised norms), greedy, k =
    4."""
    path, hf = hf_checkpoints["llama-gqa"]
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=8)
    prompt = list(range(3, 40, 2))  # 19 token ids
    out = llm.generate([prompt],
                       SamplingParams(temperature=0, max_tokens=6, logprobs=4, prompt_logprobs=4,
                                                ignore_eos=True))[0]
    full = prompt + out.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([full])).logits[0].float().log_softmax(-1)  # T, V
    errs = [
        check_entry(out.prompt_logprobs[i], prompt[i], ref[i - 1], 4) for i in range(1, len(prompt))
    ]
    errs += [check_entry(e, t, ref[len(prompt) - 1 + i], 4) for i, (e, t) in enumerate(zip(
        out.outputs[0].logprobs, out.token_ids))]
    # two implementations: float order differs (tests/test_models_parity.py)
    assert max(errs) <= 1e-4
    assert all(e[t].rank == 1 for e, t in zip(out.outputs[0].logprobs,
                                              out.token_ids)), "greedy = rank 1"


def test_logprobs_are_raw_whatever_the_sampling_settings(llm):
    """The same tokens forced through greedy and through a hot, penalised sampler give the same
    logprobs: they are the model's, not the sampler's (vLLM's raw_logprobs)."""
    ids = llm.encode_prompt(PROMPT)
    greedy = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    t = greedy.token_ids[0]
    hot = SamplingParams(temperature=3.0, repetition_penalty=1.5, presence_penalty=1.0,
                         logit_bias={t: 100},
                         max_tokens=1, logprobs=5, seed=0)
    other = llm.generate([ids], hot)[0]
    assert other.token_ids == [t]  # forced by the bias
    assert other.outputs[0].logprobs[0][t] == greedy.outputs[0].logprobs[0][t]


def test_logprob_zero_returns_only_the_chosen_token(llm):
    out = llm.generate([PROMPT],
                       SamplingParams(temperature=0, max_tokens=3, logprobs=0,
                                      prompt_logprobs=0))[0]
    assert all(
        len(e) == 1 and next(iter(e)) == t for e, t in zip(out.outputs[0].logprobs, out.token_ids)
    )
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_prompt_logprobs_bypass_the_prefix_cache(llm):
    """A cached prompt still gets every prompt logprob (the request recomputes it); a request
    without prompt logprobs does hit the cache (the control)."""
    ids = llm.encode_prompt(PROMPT + " Arise, fair sun")
    plain = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([ids], plain)[0]
    again = llm.generate([ids], plain)[0]
    # the control: the cache serves
    assert again.num_cached_tokens > 0 and first.token_ids == again.token_ids
    scored = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    assert scored.num_cached_tokens == 0 and len(scored.prompt_logprobs) == len(ids)
    ref = llm.logits(ids).log_softmax(-1)
    assert max(abs(scored.prompt_logprobs[i][ids[i]].logprob - ref[i - 1, ids[i]].item())
               for i in range(1, len(ids))) <= TOL


def test_batch_of_mixed_requests_and_n_samples(llm):
    """Requests with and without logprobs in one step; n = 3 samples each carry their own, the
    prompt's once."""
    params = [SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=5, logprobs=2,
                             prompt_logprobs=1,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5),
              SamplingParams(temperature=0.7, seed=1, max_tokens=5,
                                                                          logprobs=1,
                             ignore_eos=True)]
    prompts = [PROMPT, "JULIET: O Romeo", "To be, or not to be"]
    outs = llm.generate(prompts, params)
    assert outs[1].outputs[0].logprobs is None and outs[1].prompt_logprobs is None
    assert outs[2].prompt_logprobs is None and len(outs[2].outputs[0].logprobs) == 5
    assert len(outs[0].outputs) == 3 and len(outs[0].prompt_logprobs) == len(
        outs[0].prompt_token_ids
    )
    for out in (outs[0], outs[2]):
        for c in out.outputs:
            ref = llm.logits(out.prompt_token_ids + c.token_ids).log_softmax(-1)
            P = len(out.prompt_token_ids)
            assert max(abs(e[t].logprob - ref[P - 1 + i, t].item())
                       for i, (e, t) in enumerate(zip(c.logprobs, c.token_ids))) <= TOL


def test_prompt_logprobs_survive_preemption():
    """A pool so small that requests are preempted and recomputed: no prompt entry is lost or
    doubled."""
    llm = LLM("demo", num_blocks=24, block_size=8, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=40, prompt_logprobs=1, logprobs=1,
                            ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT[::-1], "ROMEO: " * 6], params)
    assert llm.engine.scheduler.num_preemptions > 0, "the test must preempt"
    for out in outs:
        ids = out.prompt_token_ids
        assert len(out.prompt_logprobs) == len(ids)
        ref = llm.logits(ids + out.token_ids).log_softmax(-1)
        assert max(abs(out.prompt_logprobs[i][ids[i]].logprob - ref[i - 1, ids[i]].item())
                   for i in range(1, len(ids))) <= TOL
        assert len(out.outputs[0].logprobs) == 40


def test_logprobs_with_speculative_decoding():
    """Emitted drafts carry the target's logprobs, equal to a plain run's (greedy: the same
    tokens)."""
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    spec = LLM("demo", speculative_model="demo-draft", num_speculative_tokens=3,
               # pinned: measured costs may switch the draft off on a slow machine
               speculative_cost=0.1)
    out = spec.generate([PROMPT], params)[0]
    assert out.outputs[0].spec_stats.num_accepted_tokens > 0, (
        "drafts must be accepted for this to test anything"
    )
    ref = spec.logits(out.prompt_token_ids + out.token_ids).log_softmax(-1)
    P = len(out.prompt_token_ids)
    assert max(check_entry(e, t, ref[P - 1 + i], 2) for i, (e, t) in enumerate(
        zip(out.outputs[0].logprobs, out.token_ids))) <= TOL


def test_compute_logprobs_negative_control():
    """Scoring with the logits one position off (the classic bug) is caught by the comparison
    above."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    ref = logits.log_softmax(-1)
    tokens = [1, 2, 3, 4]
    right = compute_logprobs(logits, tokens, [3] * 4)
    shifted = compute_logprobs(logits.roll(1, 0), tokens, [3] * 4)
    assert (
        max(abs(e[t].logprob - ref[i, t].item()) for i, (e, t) in enumerate(zip(right, tokens)))
        <= 1e-6
    )
    assert (
        max(abs(e[t].logprob - ref[i, t].item()) for i, (e, t) in enumerate(zip(shifted, tokens)))
        > 0.1
    )


@pytest.mark.parametrize("field,value",
                         [("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("logprobs", 1.5),
                                         ("prompt_logprobs", 100), ("prompt_logprobs", "2")])
def test_bad_logprobs_values_are_refused_by_name(field, value):
    with pytest.raises(NanoserveError, match=field):
        SamplingParams(**{field: value})


def test_an_undecodable_top_k_id_gives_no_text_not_a_failed_batch():
    """decoded_token is None for an id the tokenizer has no text for (the draw must not raise for
    every row)."""
    class Holes:
        def decode(self, ids):
            if ids == [3]:
                raise NanoserveError("token id 3 has no text")
            return f"<{ids[0]}>"

    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0]])
    (entry,) = compute_logprobs(logits, [2], [2], Holes())
    assert entry[3].decoded_token is None and entry[2].decoded_token == "<2>"


def test_detokenize_false_keeps_the_ids_and_skips_every_decode(llm, monkeypatch):
    """detokenize=False (vLLM's field): the same token ids and logprobs, no text, no decoded tokens,
    and the tokenizer is never asked to decode; stop strings (which need the text) are refused by
    name."""
    kw = dict(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    want = llm.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)[0]
    decodes = []
    tok = llm.engine.tokenizer
    monkeypatch.setattr(tok, "decode", lambda ids, *a, **k: decodes.append(ids) or "")
    got = llm.generate(PROMPT, SamplingParams(**kw, detokenize=False), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and decodes == []
    # control: with the default there is text
    assert got.outputs[0].text == "" and want.outputs[0].text
    for mine, ref in zip(got.outputs[0].logprobs + got.prompt_logprobs[1:],
                         want.outputs[0].logprobs + want.prompt_logprobs[1:]):
        assert {t: (e.logprob, e.rank) for t, e in mine.items()} == {
            t: (e.logprob, e.rank) for t, e in ref.items()
        }
        assert all(e.decoded_token is None for e in mine.values())
        assert any(e.decoded_token for e in ref.values())
    llm.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)
    assert decodes  # control: the default decodes through the same patched tokenizer
    with pytest.raises(NanoserveError, match="stop=.*needs detokenize=True"):
        SamplingParams(stop=["\n"], detokenize=False)
    with pytest.raises(NanoserveError, match="detokenize='no' must be True or False"):
        SamplingParams(detokenize="no")
