"""vLLM's sampling extras (engine/sampling_params.py): min-p, presence / frequency penalties,
logit_bias, min_tokens, include_stop_str_in_output — against HF transformers' logits processors
where HF has one, against OpenAI's written formula where it does not, and end to end through the
engine."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from sampling_reference import reference_sample

from nanoserve import LLM
from nanoserve.engine.sampler import (
    SamplingParams,
    make_generator,
    probs_from_logits,
    probs_from_logits_batch,
    process_logits,
    sample_batch,
)
from nanoserve.errors import NanoserveError

transformers = pytest.importorskip("transformers")


def test_min_p_equals_transformers():
    """probs_from_logits(T, min_p) keeps exactly the tokens HF's TemperatureLogitsWarper +
    MinPLogitsWarper keep, with the same renormalised probabilities."""
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    for T, m in [(1.0, 0.05), (0.7, 0.2), (1.5, 0.01), (1.0, 1.0)]:
        hf = MinPLogitsWarper(m)(None, TemperatureLogitsWarper(T)(None, logits.clone())).softmax(-1)
        ours = probs_from_logits(logits, T, min_p=m)
        assert torch.equal(ours > 0, hf > 0)
        torch.testing.assert_close(ours, hf, atol=1e-6, rtol=1e-5)
    # per-row settings: each row of one batch against HF with that row's setting
    settings = [(1.0, 0.05), (0.7, 0.2), (1.5, 0.01), (1.0, 1.0), (0.7, 0.0), (1.2, 0.5)]
    temperatures = [T for T, _ in settings]
    min_ps = [m for _, m in settings]
    batch = probs_from_logits_batch(logits, temperatures, [0] * 6, [1.0] * 6, min_ps)
    for row, (T, m) in enumerate(settings):
        one = logits[row:row + 1].clone()
        hf = MinPLogitsWarper(m)(None, TemperatureLogitsWarper(T)(None, one)).softmax(-1)[0]
        assert torch.equal(batch[row] > 0, hf > 0)
        torch.testing.assert_close(batch[row], hf, atol=1e-6, rtol=1e-5)
    # the control: min-p off keeps every token
    assert (probs_from_logits(logits, 1.0) > 0).all()


def test_min_tokens_equals_transformers():
    """The stop tokens are banned exactly while fewer than min_tokens are out (HF's
    MinNewTokensLength)."""
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    torch.manual_seed(1)
    logits, prompt, eos = torch.randn(50), [5, 6, 7], [3, 9]
    for generated in range(6):
        out_ids = list(range(10, 10 + generated))
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), 4,
                                               eos)(torch.tensor([prompt + out_ids]),
                                                    logits[None])[0]
        ours = process_logits(logits, SamplingParams(min_tokens=4, max_tokens=8),
                              output_ids=out_ids, stop_ids={3, 9})
        assert torch.equal(ours, hf), generated


def test_presence_and_frequency_penalties_follow_openai_formula():
    """OpenAI: mu[j] − c[j]·frequency − [c[j] > 0]·presence, c counting generated tokens only (not
    the prompt)."""
    torch.manual_seed(2)
    logits = torch.randn(40)
    output = [3, 3, 3, 7, 11, 3, 7]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3)
    counts = Counter(output)
    expected = logits.clone()
    for j, c in counts.items():
        expected[j] -= c * 0.3 + 0.5
    # prompt ids ignored
    ours = process_logits(logits, params, seen_ids=torch.tensor([1, 2, 3]), output_ids=output)
    torch.testing.assert_close(ours, expected)
    # control: off
    assert torch.equal(process_logits(logits, SamplingParams(), output_ids=output), logits)


def test_logit_bias_adds_to_the_logits():
    logits = torch.zeros(10)
    ours = process_logits(logits, SamplingParams(logit_bias={2: 5.0, 7: -100}))
    assert ours[2] == 5.0 and ours[7] == -100 and ours.count_nonzero() == 2


def test_sample_batch_draws_the_written_out_law_with_extras():
    """Row by row, the batched sampler draws exactly what the written-out law
    (tests/sampling_reference.py) draws, extras included."""
    torch.manual_seed(3)
    logits = torch.randn(5, 64)
    params = [SamplingParams(temperature=0.9, min_p=0.1, seed=1),
              SamplingParams(temperature=0, logit_bias={5: 9}),
              SamplingParams(temperature=1.2, frequency_penalty=1.5, presence_penalty=-0.5, seed=2),
              SamplingParams(temperature=0.8, min_tokens=3, max_tokens=9, top_k=10, seed=3),
              SamplingParams(temperature=1.0, repetition_penalty=1.3, top_p=0.8, seed=4)]
    outputs = [[1, 2], [], [4, 4, 4, 5], [6], [7, 8]]
    seen = [None, None, None, None, torch.tensor([0, 7, 8])]
    stops = [{0}, {0}, {0}, {60, 61, 62}, {0}]

    def generators():
        return [make_generator(p.seed) for p in params]

    batch, _ = sample_batch(logits, params, seen, generators(), outputs, stops)
    rows = zip(logits, params, seen, generators(), outputs, stops)
    single = [reference_sample(*row) for row in rows]
    assert batch == single
    assert batch[1] == 5


@pytest.fixture(scope="module")
def llm():
    return LLM("demo")


def test_min_tokens_and_stop_strings_end_to_end(llm):
    """With EOS made certain by a bias, the request stops at once — unless min_tokens holds it
    back."""
    eos = llm.engine.tokenizer.eos_id
    assert eos is not None
    bias = {eos: 100}
    out = llm.generate(["ROMEO:"], SamplingParams(temperature=0, logit_bias=bias, max_tokens=20))[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"  # the control
    out = llm.generate(["ROMEO:"],
                       SamplingParams(temperature=0, logit_bias=bias, min_tokens=5,
                                      max_tokens=20))[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]


def test_include_stop_str_in_output(llm):
    plain = llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=40))[0].text
    stop = plain[10:13]
    assert stop and stop in plain
    cut = llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0]
    kept = llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                                   include_stop_str_in_output=True))[0]
    assert (
        kept.text == cut.text + stop and plain.startswith(kept.text) and not cut.text.endswith(stop)
    )


def test_stop_strings_wait_for_min_tokens(llm):
    plain = llm.generate(["ROMEO:"],
                         SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop = plain.text[:3]  # hit by the first few tokens
    early = llm.generate(["ROMEO:"],
                         SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                        ignore_eos=True))[0]
    late = llm.generate(["ROMEO:"],
                        SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True,
                                                   min_tokens=20))[0]
    assert len(early.token_ids) < 20 <= len(late.token_ids)


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(NanoserveError,
                       match="logit_bias: token id 999999 is outside the vocabulary"):
        llm.generate(["x"], SamplingParams(logit_bias={999999: 1.0}))


@pytest.mark.parametrize("kw,field", [
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(logit_bias={1: 101}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"), (dict(logit_bias={"a": 1}), "logit_bias"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"), (dict(min_tokens=-1), "min_tokens")])
def test_bad_extras_are_refused_by_name(kw, field):
    with pytest.raises(NanoserveError, match=field):
        SamplingParams(**kw)


def test_stop_strings_are_looked_for_from_the_min_tokens_th_token(llm):
    """vLLM checks stop strings once len(output) >= min_tokens: a stop string the 2nd token
    completes stops a min_tokens=2 request right there (a check from the 3rd token on would miss it
    for good)."""
    plain = llm.generate(["ROMEO:"],
                         SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].text
    # a char not seen before it
    i = next(i for i in range(1, len(plain)) if plain[i] not in plain[:i])
    out = llm.generate(["ROMEO:"],
                       SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                      stop=[plain[i]],
                                                  min_tokens=i + 1))[0]
    assert len(out.token_ids) == i + 1 and out.text == plain[:i] and out.finish_reason == "stop"
