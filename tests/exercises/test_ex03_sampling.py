"""Exercise 3: from logits to a token (nanoserve/engine/sampler.py: probs_from_logits,
apply_repetition_penalty, apply_penalties, process_logits, sample_next).

Oracles: Hugging Face transformers' logits processors (TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
MinNewTokensLengthLogitsProcessor; not our code), OpenAI's written definition of the presence /
frequency penalties, distributions worked out by hand on probabilities we chose (0.1, 0.4, 0.2,
0.3), the law written from the definitions in float64, and for sample_next a Pearson χ² test on
seeded draws (fail at p < 1e-4, docs/TESTING.md).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from chi2 import goodness_of_fit
from explain import expect, expect_close, expect_equal, explained_failure
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nanoserve.engine.sampler import SamplingParams

REFERENCE = "nanoserve.engine.sampler"
EXERCISE = "sampler"
pytestmark = pytest.mark.ex03

P_FAIL = 1e-4  # docs/TESTING.md: fail a goodness-of-fit test at p < 1e-4
N_DRAWS = 5_000  # sample_next is one call per draw; enough to see a wrong temperature or penalty


def _randn(*shape, seed=0, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the law, from the
# definitions
def intended_probs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """softmax(logits / T) over the top-k set (ties at the k-th logit kept), then the top-p nucleus:
    going down in probability, a token is kept while the tokens before it hold less than top_p.
    Float64, logits [V] -> [V]."""
    z = [float(v) / temperature for v in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept = order
    if 0 < top_k < len(z):
        kth = z[order[top_k - 1]]
        kept = [i for i in order if z[i] >= kth]
    weight = {i: math.exp(z[i] - z[order[0]]) for i in kept}
    total = math.fsum(weight.values())
    if top_p < 1.0:
        nucleus, mass = [], 0.0
        for i in kept:
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += weight[i] / total
        kept = nucleus
    total = math.fsum(weight[i] for i in kept)
    return torch.tensor([weight[i] / total if i in kept else 0.0 for i in range(len(z))],
                        dtype=torch.float64)


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """HF's warpers in generate()'s order (temperature, top-k, top-p), then a softmax. logits [V] ->
    [V]."""
    scores, ids = logits[None].clone(), torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores[0].softmax(-1)




# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
CHOSEN = torch.tensor([0.1, 0.4, 0.2, 0.3])
CHOSEN_TEXT = "[0.1, 0.4, 0.2, 0.3]"  # as a failure names it
LOGITS4 = CHOSEN.log()  # softmax(LOGITS4) is CHOSEN; mixed signs once shifted below
SQRT = (CHOSEN.sqrt() / CHOSEN.sqrt().sum()).tolist()  # the law at temperature 2
# (temperature, top_k, top_p) -> expected probabilities, worked out by hand from CHOSEN
BY_HAND = {
    (1.0, 0, 1.0): [0.1, 0.4, 0.2, 0.3],
    (1.0, 2, 1.0): [0, 4 / 7, 0, 3 / 7],
    (1.0, 3, 1.0): [0, 4 / 9, 2 / 9, 3 / 9],
    # 0.4 < 0.65: keep the next, 0.3 (it crosses); 0.7 ≥ 0.65: stop
    (1.0, 0, 0.65): [0, 4 / 7, 0, 3 / 7],
    (1.0, 0, 0.75): [0, 4 / 9, 2 / 9, 3 / 9],
    (1.0, 0, 0.35): [0, 1, 0, 0],  # the first token already crosses 0.35
    (1.0, 2, 0.5): [0, 1, 0, 0],  # top-k first: 4/7 ≥ 0.5 (top-p first would keep 0.4 and 0.3)
    (0.5, 0, 1.0): [1 / 30, 16 / 30, 4 / 30, 9 / 30],  # T = 0.5 squares the probabilities
    (0.5, 0, 0.5): [0, 1, 0, 0],  # 16/30 ≥ 0.5 (at T = 1 the nucleus would hold 0.4 and 0.3)
    (0.5, 2, 0.9): [0, 16 / 25, 0, 9 / 25],
    (2.0, 0, 1.0): SQRT,  # T = 2 takes square roots
    # 0.33 < 0.5, then 0.28
    (2.0, 0, 0.5): [0, SQRT[1] / (SQRT[1] + SQRT[3]), 0, SQRT[3] / (SQRT[1] + SQRT[3])],
}


def check_by_hand(impl):
    # softmax ignores a shift: the same laws with positive and negative logits
    for shift in (0.0, 1.7):
        for (temperature, top_k, top_p), want in BY_HAND.items():
            probs = impl.probs_from_logits(LOGITS4 + shift, temperature, top_k, top_p)
            case = (f"probs_from_logits(log {CHOSEN_TEXT} + {shift}, temperature={temperature}"
                    f", top_k={top_k}, top_p={top_p})")
            expect(probs.dtype == torch.float32, case, "float32 probabilities", probs.dtype)
            expect_close(probs, torch.tensor(want, dtype=torch.float32), case, atol=1e-6)


HF_GRID = [
    (vocab, t, k, p) for vocab in (5, 50, 1000) for t in (0.6, 1.0, 1.8) for k in (0, 1, 3, 40)
    for p in (1.0, 0.9, 0.5, 0.05)
]


def expect_kept_sets_equal(probs, want, case):
    """The tokens with probability > 0 are the same; else the first one that differs."""
    if torch.equal(probs > 0, want > 0):
        return
    token = int(((probs > 0) != (want > 0)).nonzero()[0])
    raise AssertionError(f"{case}: the kept sets differ; {int((want > 0).sum())} tokens expected, "
                         f"{int((probs > 0).sum())} kept; the first difference, token {token}: "
                         f"expected p = {float(want[token]):.6g}, got {float(probs[token]):.6g}")


def check_matches_hf(impl):
    for i, (vocab, temperature, top_k, top_p) in enumerate(HF_GRID):
        logits = _randn(vocab, seed=i, scale=3.0)  # continuous: no ties, no boundary hit exactly
        want = hf_probs(logits, temperature, top_k, top_p)
        probs = impl.probs_from_logits(logits, temperature, top_k, top_p)
        case = (f"probs_from_logits(random logits over V={vocab}, temperature={temperature}, "
                f"top_k={top_k}, top_p={top_p}) against HF's warpers")
        expect_kept_sets_equal(probs, want, case)
        expect_close(probs, want, case, atol=1e-6, dims="token")


def check_ties(impl):
    # top-k keeps every token tied with the k-th largest logit, as HF does
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0, 2.0, -1.0])
    for k in (2, 3, 4):
        want = torch.tensor([0.0, *torch.tensor([3.0, 2, 2, 2]).softmax(-1).tolist(), 0.0])
        torch.testing.assert_close(impl.probs_from_logits(logits, 1.0, k), want, rtol=0, atol=1e-6)
        assert torch.equal(impl.probs_from_logits(logits, 1.0, k) > 0,
                           hf_probs(logits, 1.0, k, 1.0) > 0)
    torch.testing.assert_close(impl.probs_from_logits(torch.tensor([3.0, -1, 3]), 1.0, 1),
                               torch.tensor([0.5, 0.0, 0.5]), rtol=0, atol=1e-6)
    # top-p among equal probabilities: any 3 of 4 tokens at 1/4 (the 3rd starts at 0.5 < 0.6, the
    # 4th at 0.75)
    probs = impl.probs_from_logits(torch.zeros(4), 1.0, 0, 0.6)
    assert int((probs > 0).sum()) == 3
    torch.testing.assert_close(probs[probs > 0], torch.full((3,), 1 / 3), rtol=0, atol=1e-6)


def check_off_switches(impl):
    """top_k = 0, top_k ≥ V and top_p = 1 keep every token, even where float32's cumulative sum
    reaches 1 early."""
    logits = _randn(1000, seed=0, scale=6.0)
    plain = (logits / 0.9).softmax(-1)
    ranked = plain.sort(descending=True).values
    # a rounding trap: see the docstring
    assert int(((ranked.cumsum(-1) - ranked) >= 1.0).sum()) > 100
    for top_k, top_p in ((0, 1.0), (1000, 1.0), (1005, 1.0)):
        probs = impl.probs_from_logits(logits, 0.9, top_k, top_p)
        assert bool((probs > 0).all()), f"top_k={top_k} top_p={top_p} dropped tokens"
        torch.testing.assert_close(probs, plain, rtol=1e-5, atol=1e-7)


def check_batches_and_dtypes(impl):
    logits = _randn(2, 3, 50, seed=7, scale=2.5)  # B, T, V
    probs = impl.probs_from_logits(logits.half(), 0.8, 7, 0.7)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    for b in range(2):
        for t in range(3):
            want = intended_probs(logits[b, t].half().float(), 0.8, 7, 0.7)
            assert torch.equal(probs[b, t] > 0, want > 0), f"kept sets differ in row {b}, {t}"
            torch.testing.assert_close(probs[b, t].double(), want, rtol=0, atol=1e-6)


def _penalty_inputs():
    logits = _randn(2, 40, seed=11, scale=4.0)  # B, V
    logits[:, 3] = 0.0  # zero: unchanged by both rules
    seen = torch.tensor([5, 3, 17, 5, 0, 39, 17, 17, 22])  # repeats, out of order
    assert (logits[:, seen] > 0).any() and (logits[:, seen] < 0).any()
    return logits, seen


def check_penalty_matches_hf(impl):
    logits, seen = _penalty_inputs()
    before = logits.clone()
    for penalty in (1.3, 0.7, 1.0):
        hf = RepetitionPenaltyLogitsProcessor(penalty)
        for row in range(2):  # [V]
            want = hf(seen[None], logits[row][None].clone())[0]
            expect_close(impl.apply_repetition_penalty(logits[row], seen, penalty), want,
                         f"apply_repetition_penalty(logits [40], seen_ids={seen.tolist()}, "
                         f"penalty={penalty}) against HF's processor", atol=0, rtol=1e-6,
                         dims="token")
        want = hf(seen[None].expand(2, -1), logits.clone())  # [B, V], one history for every row
        expect_close(impl.apply_repetition_penalty(logits, seen, penalty), want,
                     f"apply_repetition_penalty(logits [2, 40], seen_ids={seen.tolist()}, "
                     f"penalty={penalty}) against HF's processor", atol=0, rtol=1e-6,
                     dims="row, token")
        assert torch.equal(logits, before), "the input logits were modified in place"
    nothing_seen = impl.apply_repetition_penalty(logits, torch.tensor([], dtype=torch.long), 1.3)
    assert torch.equal(nothing_seen, logits)


def check_greedy(impl):
    """Temperature 0: the argmax after the penalty, whatever top_k / top_p say, and no random
    numbers drawn."""
    logits = _randn(100, seed=5)
    for params in (SamplingParams(temperature=0),
                   SamplingParams(temperature=0, top_k=3, top_p=0.2)):
        gen = torch.Generator().manual_seed(42)
        gen_state, global_state = gen.get_state(), torch.get_rng_state()
        picks = {impl.sample_next(logits, params, generator=gen) for _ in range(5)} | {
            impl.sample_next(logits, params)
        }
        expect(picks == {int(logits.argmax())}, f"sample_next(temperature 0, {params.top_k=}, "
               f"{params.top_p=}), six calls", f"the argmax every time, {int(logits.argmax())}",
               sorted(picks))
        assert torch.equal(gen.get_state(), gen_state), "greedy drew from the request's generator"
        assert torch.equal(torch.get_rng_state(),
                           global_state), "greedy drew from torch's global generator"
    # (logits, seen, penalty) -> the greedy token, by hand
    for values, seen, penalty, want in [
        ([0.5, 2.0, -1.0, 1.8], [1], 1.3, 3),  # 2.0 / 1.3 = 1.54 < 1.8
        ([0.5, 2.0, -1.0, 1.8], [1], 1.05, 1),  # 2.0 / 1.05 = 1.90 > 1.8
        ([-0.5, -0.6, -3.0, -0.9], [0, 0], 1.3, 1),  # -0.5 · 1.3 = -0.65 < -0.6
        # penalty < 1 favours seen tokens: -0.6 · 0.7 = -0.42
        ([-0.5, -0.6, -3.0, -0.9], [1, 3], 0.7, 1),
    ]:
        params = SamplingParams(temperature=0, repetition_penalty=penalty)
        got = impl.sample_next(torch.tensor(values), params, seen_ids=torch.tensor(seen))
        expect(type(got) is int and got == want,
               f"sample_next(logits {values}, temperature 0, repetition_penalty={penalty}, "
               f"seen_ids={seen})", f"token {want} (an int)", repr(got))
        assert impl.sample_next(torch.tensor(values), params) == max(
            range(4), key=values.__getitem__
        )


SAMPLED = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, repetition_penalty=1.5)
SAMPLED_LOGITS = torch.tensor([0.3, 2.6, -1.8, 1.4, -0.4, 3.1, 0.0, -3.2, 1.9, -0.9, 0.7, 2.2, -2.5,
                               1.0, -1.3, 0.45])
SAMPLED_SEEN = torch.tensor([5, 5, 9, 13])  # 3.1 -> 2.07, -0.9 -> -1.35, 1.0 -> 0.67


def check_sampling_law(impl):
    """Seeded draws follow the law (penalty, then T / top-k / top-p), reproducibly, on the request's
    generator."""
    seen = set(SAMPLED_SEEN.tolist())
    penalized = torch.tensor([(v / 1.5 if v > 0 else v * 1.5) if i in seen else v
                              for i, v in enumerate(SAMPLED_LOGITS.tolist())])
    law = intended_probs(penalized, SAMPLED.temperature, SAMPLED.top_k, SAMPLED.top_p)
    gen = torch.Generator().manual_seed(1234)
    global_state = torch.get_rng_state()
    draws = [impl.sample_next(SAMPLED_LOGITS, SAMPLED, SAMPLED_SEEN, gen) for _ in range(N_DRAWS)]
    assert torch.equal(torch.get_rng_state(),
                       global_state), "a seeded draw used torch's global generator"
    assert all(type(d) is int for d in draws[:10])
    chi2, dof, pvalue = goodness_of_fit(torch.bincount(torch.tensor(draws), minlength=16), law)
    assert pvalue >= P_FAIL, f"χ² = {chi2:.1f} with {dof} dof, p = {pvalue:.2e}"
    again = torch.Generator().manual_seed(1234)
    assert [impl.sample_next(SAMPLED_LOGITS, SAMPLED, SAMPLED_SEEN,
                             again) for _ in range(50)] == draws[:50]


def check_min_p_matches_hf(impl):
    """min-p at temperature T keeps exactly what HF's TemperatureLogitsWarper + MinPLogitsWarper
    keep."""
    for i, (T, m) in enumerate([(1.0, 0.05), (0.6, 0.2), (1.8, 0.1), (1.0, 1.0), (0.9, 0.0)]):
        logits = _randn(300, seed=40 + i, scale=3.0)
        ids = torch.zeros(1, 1, dtype=torch.long)
        want = (
            MinPLogitsWarper(m)(ids, TemperatureLogitsWarper(T)(ids, logits[None].clone()))[
                0
            ].softmax(-1)
            if m > 0
            else (logits / T).softmax(-1)
        )
        probs = impl.probs_from_logits(logits, T, 0, 1.0, m)
        case = (f"probs_from_logits(random logits over V=300, temperature={T}, min_p={m}) "
                "against HF's warpers")
        expect_kept_sets_equal(probs, want, case)
        expect_close(probs, want, case, atol=1e-6, dims="token")
    # by hand: CHOSEN at T = 1 with min_p = 0.6 keeps p ≥ 0.24: 0.4 and 0.3; at T = 0.5 (16:9) both
    # stay
    expect_close(impl.probs_from_logits(LOGITS4, 1.0, 0, 1.0, 0.6),
                 torch.tensor([0, 4 / 7, 0, 3 / 7]),
                 f"probs_from_logits(log {CHOSEN_TEXT}, temperature=1, min_p=0.6)", atol=1e-6)
    # sqrt: 0.63 0.45 0.55 / 0.63
    expect_close(impl.probs_from_logits(LOGITS4, 2.0, 0, 1.0, 0.6),
                 torch.tensor([0, SQRT[1], SQRT[2], SQRT[3]]) / sum(SQRT[1:]),
                 f"probs_from_logits(log {CHOSEN_TEXT}, temperature=2, min_p=0.6)", atol=1e-6)


def check_penalties_formula(impl):
    """OpenAI: mu[j] − c[j]·frequency − [c[j] > 0]·presence, over the generated tokens."""
    logits = _randn(30, seed=21)
    before = logits.clone()
    output = [4, 4, 9, 4, 17, 9]
    want = logits.clone()
    for j, c in {4: 3, 9: 2, 17: 1}.items():
        want[j] -= c * 0.4 + 0.7
    expect_close(impl.apply_penalties(logits, output, 0.7, 0.4), want,
                 f"apply_penalties(logits [30], output_ids={output}, presence=0.7, frequency=0.4)",
                 atol=1e-6, dims="token")
    expect_close(impl.apply_penalties(logits, output, -0.5, 0.0),
                 logits + 0.5 * torch.isin(torch.arange(30), torch.tensor(output)),
                 f"apply_penalties(logits [30], output_ids={output}, presence=-0.5, frequency=0)",
                 atol=1e-6, dims="token")
    assert torch.equal(impl.apply_penalties(logits, [], 0.7, 0.4), logits)
    assert torch.equal(logits, before), "the input logits were modified in place"


def check_process_logits(impl):
    """The order (bias, then min_tokens, then the penalties) worked out by hand, and min_tokens
    against HF."""
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5, 3.0])
    params = SamplingParams(logit_bias={0: -2.0, 4: 1.0}, repetition_penalty=2.0,
                            frequency_penalty=0.5)
    got = impl.process_logits(logits, params, seen_ids=torch.tensor([0, 3]), output_ids=[3, 3])
    # token 0: 1 − 2 = −1, seen: × 2 → −2;  token 3: 0.5 / 2 = 0.25, twice out: − 1 → −0.75;  token
    # 4: 3 + 1 = 4
    expect_close(got, torch.tensor([-2.0, 2.0, -1.0, -0.75, 4.0]),
                 "process_logits([1, 2, -1, 0.5, 3], logit_bias {0: -2, 4: 1}, repetition_penalty 2"
                 " over seen [0, 3], frequency_penalty 0.5 over output [3, 3])", atol=1e-6)
    assert torch.equal(logits,
                       torch.tensor([1.0, 2.0, -1.0, 0.5,
                                     3.0])), "the input logits were modified in place"
    row, prompt = _randn(50, seed=8), [5, 6, 7]
    for generated in range(6):
        out_ids = list(range(10, 10 + generated))
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), 4,
                                               [3, 9])(torch.tensor([prompt + out_ids]),
                                                       row[None])[0]
        ours = impl.process_logits(row, SamplingParams(min_tokens=4, max_tokens=8),
                                   output_ids=out_ids,
                                   stop_ids={3, 9, 99})  # 99 is past the vocabulary: ignored
        expect_equal(ours, hf, f"process_logits(min_tokens=4, stop ids {{3, 9, 99}}) with "
                     f"{generated} tokens out, against HF's MinNewTokensLengthLogitsProcessor",
                     dims="token")


# ----------------------------------------------------------------------------- the tests
def test_ex03_1_laws_worked_out_by_hand(impl):
    check_by_hand(impl)


def test_ex03_1_matches_hf_warpers(impl):
    check_matches_hf(impl)


def test_ex03_1_ties_at_the_top_k_and_top_p_boundaries(impl):
    check_ties(impl)


def test_ex03_1_top_k_zero_or_at_least_vocab_and_top_p_one_are_off(impl):
    check_off_switches(impl)


def test_ex03_1_batches_and_half_precision_logits(impl):
    check_batches_and_dtypes(impl)


def test_ex03_2_repetition_penalty_matches_hf(impl):
    check_penalty_matches_hf(impl)


def test_ex03_3_temperature_zero_is_greedy_after_the_penalty(impl):
    check_greedy(impl)


def test_ex03_3_seeded_draws_follow_the_law_chi2(impl):
    check_sampling_law(impl)


def test_ex03_1_min_p_matches_hf(impl):
    check_min_p_matches_hf(impl)


def test_ex03_4_presence_and_frequency_penalties(impl):
    check_penalties_formula(impl)


def test_ex03_5_process_logits_order_and_min_tokens(impl):
    check_process_logits(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _sampler(top_k_extra=0, keep_crossing=True, temperature_first=True, penalty_rule="ctrl",
             min_p_at_t1=False, renormalise=True,
             count_prompt=False, presence_per_count=False, bias_last=False):
    """A sampler; the arguments put one bug each in a known place."""
    def probs_from_logits(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
        logits = logits.float()
        scaled = logits / temperature
        chooser = scaled if temperature_first else logits  # wrong: the kept sets chosen at T = 1
        keep = torch.ones_like(logits, dtype=torch.bool)
        if min_p > 0:
            # wrong: min-p judged before the temperature
            p = (logits if min_p_at_t1 else scaled).softmax(-1)
            keep = p >= min_p * p.amax(-1, keepdim=True)
        k = top_k + top_k_extra if top_k else 0
        if k and k < logits.shape[-1]:
            keep = keep & (chooser.masked_fill(~keep, float("-inf")) >= torch.topk(
                chooser.masked_fill(~keep, float("-inf")), k, dim=-1).values[..., -1:])
        if top_p < 1.0:
            ranked, order = (
                chooser.masked_fill(~keep, float("-inf")).softmax(-1).sort(dim=-1, descending=True)
            )
            # wrong: the crossing token counts too
            before = ranked.cumsum(-1) - (ranked if keep_crossing else 0)
            keep_sorted = before < top_p
            keep = keep & keep_sorted.scatter(-1, order, keep_sorted)
        if not renormalise:  # wrong: the kept tokens' probabilities left as they were
            return scaled.softmax(-1).masked_fill(~keep, 0.0)
        return scaled.masked_fill(~keep, float("-inf")).softmax(-1)

    def apply_repetition_penalty(logits, seen_ids, penalty):
        seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
        seen[seen_ids] = True
        if penalty_rule == "ctrl":
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        else:  # wrong: a negative logit divided by a penalty > 1 becomes more likely
            penalized = logits / penalty
        return torch.where(seen, penalized, logits)

    def apply_penalties(logits, output_ids, presence, frequency):
        if not output_ids:
            return logits
        counts = torch.bincount(torch.tensor(list(output_ids)),
                                minlength=logits.shape[-1])[:logits.shape[-1]].float()
        # wrong: presence grows with the count
        present = counts if presence_per_count else (counts > 0).float()
        return logits - frequency * counts - presence * present

    def process_logits(logits, params, seen_ids=None, output_ids=(), stop_ids=()):
        def bias(x):
            for t, b in params.logit_bias.items():
                x = x.index_add(0, torch.tensor([t]), torch.tensor([float(b)]))
            return x
        if not bias_last:
            logits = bias(logits)
        if len(output_ids) < params.min_tokens:
            banned = [t for t in stop_ids if t < logits.shape[-1]]
            logits = logits.index_fill(0, torch.tensor(banned, dtype=torch.long), float("-inf"))
        if seen_ids is not None:
            logits = apply_repetition_penalty(logits, seen_ids, params.repetition_penalty)
        counted = list(output_ids) + (
            seen_ids.tolist() if count_prompt and seen_ids is not None else []
        )  # wrong
        logits = apply_penalties(logits, counted, params.presence_penalty, params.frequency_penalty)
        return bias(logits) if bias_last else logits  # wrong: the bias after the penalties

    def sample_next(logits, params, seen_ids=None, generator=None, output_ids=(), stop_ids=()):
        logits = process_logits(logits, params, seen_ids, output_ids, stop_ids)
        if params.temperature == 0:
            return int(logits.argmax())
        probs = probs_from_logits(logits, params.temperature, params.top_k, params.top_p,
                                  params.min_p)
        return int(torch.multinomial(probs, 1, generator=generator))

    return SimpleNamespace(probs_from_logits=probs_from_logits,
                           apply_repetition_penalty=apply_repetition_penalty,
                           apply_penalties=apply_penalties, process_logits=process_logits,
                           sample_next=sample_next)


WRONG = {
    "top-p drops the token that crosses top_p": (_sampler(keep_crossing=False),
                                                 [check_by_hand, check_matches_hf]),
    "top-k keeps k + 1": (_sampler(top_k_extra=1), [check_by_hand, check_matches_hf]),
    "the kept tokens not renormalised": (_sampler(renormalise=False),
                                         [check_by_hand, check_matches_hf]),
    "temperature applied after top-k / top-p": (_sampler(temperature_first=False),
                                                [check_by_hand, check_matches_hf]),
    "repetition penalty always divides": (_sampler(penalty_rule="divide"),
                                          [check_penalty_matches_hf, check_greedy]),
    "min-p judged before the temperature": (_sampler(min_p_at_t1=True), [check_min_p_matches_hf]),
    "presence penalty grows with the count": (_sampler(presence_per_count=True),
                                              [check_penalties_formula]),
    "presence / frequency count the prompt": (_sampler(count_prompt=True), [check_process_logits]),
    "logit_bias after the penalties": (_sampler(bias_last=True), [check_process_logits]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex03_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex03_the_checks_pass_on_a_right_variant_built_the_same_way():
    """The mutants differ from this one in exactly one place, so their failures are that place's."""
    right = _sampler()
    for check in (check_by_hand, check_matches_hf, check_ties, check_off_switches,
                  check_batches_and_dtypes,
                  check_penalty_matches_hf, check_greedy, check_sampling_law,
                  check_min_p_matches_hf,
                  check_penalties_formula, check_process_logits):
        check(right)
