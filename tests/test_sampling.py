"""Tests for nanoserve.engine.sampler, checked against laws and references the module did not write.

* Goodness of fit: `sample_next` draws, counted over a fixed 16-token logits vector, against the
  intended law computed here in float64 from the definitions (softmax(logits / T), top-k, the
  smallest top-p set, renormalise). Pearson χ², fail at p < 1e-4 (docs/TESTING.md). Negative
  controls draw from deliberately wrong laws (temperature ignored, top-k or top-p off by one token,
  the top-p mask left in sorted order, top-p before top-k) and must fail the same statistic.
* Truncation properties with hypothesis: nothing outside the top-k / top-p set, kept mass sums to 1.
* HF `transformers` as an outside oracle: Temperature / TopK / TopP warpers and the repetition
  penalty.
* Greedy, seeding (private generators untouched by the global RNG) and SamplingParams validation.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from chi2 import goodness_of_fit
from hypothesis import given, settings
from hypothesis import strategies as st
from sampling_reference import reference_probs, reference_sample
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nanoserve.engine.sampler import (
    SamplingParams,
    apply_repetition_penalty,
    make_generator,
    probs_from_logits,
    probs_from_logits_batch,
    sample_batch,
    sample_next,
)
from nanoserve.errors import NanoserveError

P_FAIL = 1e-4  # docs/TESTING.md: fail a goodness-of-fit test at p < 1e-4
N_DRAWS = 20_000

# Large, small and negative logits, shuffled so that no kept set is a prefix of the vocabulary.
LOGITS = torch.tensor([0.3, 2.6, -1.8, 1.4, -0.4, 3.1, 0.0, -3.2, 1.9, -0.9, 0.7, 2.2, -2.5, 1.0,
                       -1.3, 0.45])
V = LOGITS.numel()


# --------------------------------------------------------------------------- reference law
# (float64)
def kept_sets(logits, temperature: float, top_k: int,
              top_p: float) -> tuple[list[int], list[int], list[float]]:
    """(top-k set, final kept set, softmax(logits / T) over the top-k set), written from the
    definitions.

    Sets are lists of token ids, most likely first. Ties at the k-th logit are all kept (as HF and
    vLLM do).
    """
    x = [float(v) / temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if 0 < top_k < len(x):
        kth = x[order[top_k - 1]]
        after_k = [i for i in order if x[i] >= kth]
    else:
        after_k = list(order)
    top = max(x)
    weights = [math.exp(x[i] - top) if i in after_k else 0.0 for i in range(len(x))]
    total = math.fsum(weights)
    q = [w / total for w in weights]
    kept: list[int] = []
    mass = 0.0
    for i in after_k:  # the smallest set of most likely tokens whose mass reaches top_p
        if top_p < 1.0 and mass >= top_p:
            break
        kept.append(i)
        mass += q[i]
    return after_k, kept, q


def intended_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    _, kept, q = kept_sets(logits, temperature, top_k, top_p)
    mass = math.fsum(q[i] for i in kept)
    return torch.tensor([q[i] / mass if i in kept else 0.0 for i in range(len(q))],
                        dtype=torch.float64)


# --------------------------------------------------------------------------- Pearson χ²


# --------------------------------------------------------------------------- 1. χ² goodness of fit
# name: (temperature, top_k, top_p). Each top-p boundary sits > 0.01 away from a cumulative sum.
CASES = {
    "T0.7": (0.7, 0, 1.0),
    "T1.0": (1.0, 0, 1.0),
    "T1.5": (1.5, 0, 1.0),
    "top_k5": (1.0, 5, 1.0),
    "top_p0.8": (1.0, 0, 0.8),
    "T1.5_top_k10_top_p0.9": (1.5, 10, 0.9),
}


def _topp_margin(temperature: float, top_k: int, top_p: float) -> float:
    after_k, _, q = kept_sets(LOGITS, temperature, top_k, 1.0)
    cums = [math.fsum(q[i] for i in after_k[: n + 1]) for n in range(len(after_k))]
    return min(abs(c - top_p) for c in cums)


def _mutant_law(kind: str, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """A deliberately wrong law, as a buggy sampler would draw from it."""
    if kind == "temperature ignored":
        return intended_probs(LOGITS, 1.0, top_k, top_p)
    if kind == "top-k keeps k+1":
        return intended_probs(LOGITS, temperature, top_k + 1, top_p)
    if kind == "top-k keeps k-1":
        return intended_probs(LOGITS, temperature, top_k - 1, top_p)
    if kind == "top-p before top-k":
        _, kept_p, _ = kept_sets(LOGITS, temperature, 0, top_p)
        after_k, _, q = kept_sets(LOGITS, temperature, top_k, 1.0)
        kept = [i for i in after_k if i in kept_p]
    else:
        after_k, kept, q = kept_sets(LOGITS, temperature, top_k, top_p)
        if kind == "top-p drops the crossing token":
            kept = kept[:-1]
        elif kind == "top-p keeps one token too many":
            kept = after_k[: len(kept) + 1]
        elif kind == "top-p mask left in sorted order":
            # the mask is not scattered back to vocabulary ids
            kept = list(range(len(kept)))
        else:
            raise ValueError(kind)
    w = torch.tensor([q[i] if i in kept else 0.0 for i in range(V)], dtype=torch.float64)
    return w / w.sum()


MUTANTS = {
    "T0.7": ["temperature ignored"],
    "T1.0": [],
    "T1.5": ["temperature ignored"],
    "top_k5": ["top-k keeps k+1", "top-k keeps k-1"],
    "top_p0.8": ["top-p drops the crossing token", "top-p keeps one token too many",
                 "top-p mask left in sorted order"],
    "T1.5_top_k10_top_p0.9": ["top-p before top-k", "top-p drops the crossing token",
                              "top-k keeps k-1",
                              "temperature ignored"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_sample_next_matches_intended_law_chi2(name):
    temperature, top_k, top_p = CASES[name]
    if top_p < 1.0:
        assert _topp_margin(temperature, top_k, top_p) > 0.01  # the case is well posed in float32
    intended = intended_probs(LOGITS, temperature, top_k, top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)

    # probs_from_logits is the exact law (what speculative decoding relies on)
    probs = probs_from_logits(LOGITS, temperature, top_k, top_p)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.double(), intended, atol=1e-6, rtol=0)
    assert torch.equal(probs > 0, intended > 0)

    # sample_next, one call per draw, with a private seeded generator
    generator = make_generator(1234 + list(CASES).index(name))
    draws = torch.tensor([sample_next(LOGITS, params, generator=generator) for _ in range(N_DRAWS)])
    counts = torch.bincount(draws, minlength=V)
    assert counts[intended == 0].sum() == 0, "a token outside the kept set was drawn"
    chi2, df, p = goodness_of_fit(counts, intended)
    assert df >= 3
    assert p >= P_FAIL, f"{name}: χ² = {chi2:.1f} with {df} dof, p = {p:.2e}"

    # negative controls: the same statistic on as many draws from a wrong law must reject it
    for i, kind in enumerate(MUTANTS[name]):
        wrong = _mutant_law(kind, temperature, top_k, top_p)
        assert not torch.allclose(wrong, intended), kind
        g = torch.Generator().manual_seed(99 + i)
        wrong_counts = torch.bincount(torch.multinomial(wrong, N_DRAWS, replacement=True,
                                                        generator=g),
                                      minlength=V)
        chi2_w, df_w, p_w = goodness_of_fit(wrong_counts, intended)
        assert p_w < P_FAIL, (
            f"{name}: mutant {kind!r} not rejected: χ² = {chi2_w:.1f}, p = {p_w:.2e}"
        )


def test_temperature_mutant_is_rejected_with_same_support():
    """Power where the support cannot give a bug away: T = 0.7 vs the T = 1 law, both full
    support."""
    intended = intended_probs(LOGITS, 0.7)
    wrong = intended_probs(LOGITS, 1.0)
    assert torch.equal(intended > 0, wrong > 0)
    g = torch.Generator().manual_seed(7)
    counts = torch.bincount(torch.multinomial(wrong, N_DRAWS, replacement=True, generator=g),
                            minlength=V)
    assert goodness_of_fit(counts, intended)[2] < P_FAIL


# --------------------------------------------------------------------------- 2. truncation
# properties
def check_truncation(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     probs: torch.Tensor):
    """Assert that probs is softmax(logits / T) truncated to a valid top-k / top-p set and
    renormalised.

    Robust to ties: among tokens of equal probability any choice is allowed.
    """
    assert probs.shape == logits.shape
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert abs(float(probs.double().sum()) - 1.0) <= 1e-5, "kept probabilities do not sum to 1"
    after_k, _, q = kept_sets(logits, temperature, top_k, 1.0)
    support = torch.nonzero(probs > 0).flatten().tolist()
    dropped = [i for i in range(len(q)) if i not in support]
    x = logits.tolist()
    assert support, "no token kept"
    assert set(support) <= set(after_k), "a token outside the top-k set has non-zero probability"
    if dropped:  # the kept set holds the most likely tokens
        assert min(x[i] for i in support) >= max(x[i] for i in dropped)
    mass = math.fsum(q[i] for i in support)
    if top_p < 1.0:
        least = min(support, key=lambda i: q[i])
        assert mass >= top_p - 1e-5, "the kept set does not reach top_p"
        assert mass - q[least] < top_p + 1e-5, "the kept set is not the smallest one reaching top_p"
    else:
        assert set(support) == set(after_k)
    expected = torch.tensor([q[i] / mass if i in support else 0.0 for i in range(len(q))],
                            dtype=torch.float64)
    torch.testing.assert_close(probs.double(), expected, atol=1e-6, rtol=1e-4)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    logits=st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=2, max_size=40),
    temperature=st.floats(0.25, 4.0),
    top_k=st.integers(0, 45),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0, exclude_max=True)),
)
def test_truncation_properties_random_logits(logits, temperature, top_k, top_p):
    # |logit / T| ≤ 40, so no kept token underflows to probability 0 in float32
    t = torch.tensor(logits)
    probs = probs_from_logits(t, temperature, top_k, top_p)
    check_truncation(t, temperature, top_k, top_p, probs)


def test_truncation_check_rejects_wrong_probs():
    """Negative controls for check_truncation: each classic bug must be caught."""
    logits = LOGITS
    good = probs_from_logits(logits, 1.0, 5, 0.8)
    check_truncation(logits, 1.0, 5, 0.8, good)

    # top-p mask not renormalised (multinomial would hide this: it accepts unnormalised weights)
    probs = torch.softmax(logits / 1.0, -1)
    unnormalised = probs.masked_fill(good == 0, 0.0)
    with pytest.raises(AssertionError, match="sum to 1"):
        check_truncation(logits, 1.0, 5, 0.8, unnormalised)
    # filtered logits set to a large negative number instead of -inf: dropped tokens keep a little
    # mass
    soft = torch.softmax(logits.masked_fill(good == 0, -30.0), -1)
    assert (soft > 0).all()
    with pytest.raises(AssertionError, match="top-k set"):
        check_truncation(logits, 1.0, 5, 0.8, soft)
    # top-p that drops the token crossing the threshold
    kept = torch.nonzero(good).flatten()
    least = kept[good[kept].argmin()]
    short = good.clone()
    short[least] = 0
    short /= short.sum()
    with pytest.raises(AssertionError, match="does not reach top_p"):
        check_truncation(logits, 1.0, 5, 0.8, short)
    # top-k = 5 ignored
    with pytest.raises(AssertionError, match="top-k set"):
        check_truncation(logits, 1.0, 5, 1.0, probs_from_logits(logits, 1.0, 0, 1.0))


def test_batched_probs_match_rows():
    g = torch.Generator().manual_seed(3)
    batch = torch.randn(4, 50, generator=g) * 3
    probs = probs_from_logits(batch, 0.8, 7, 0.6)
    for row in range(4):
        assert torch.equal(probs[row], reference_probs(batch[row], 0.8, 7, 0.6))
        check_truncation(batch[row], 0.8, 7, 0.6, probs[row])


@pytest.mark.parametrize("vocab", [7, 300])
def test_probs_equal_the_written_out_law_bit_for_bit(vocab):
    """The engine's batched law, per row settings, against tests/sampling_reference.py's row-by-row
    law: every combination of temperature, top-k, top-p and min-p, huge logits included."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=g) * 4
    logits[2] *= 1e30  # overflows when scaled: the clamp must act the same way
    grid = list(itertools.product((0.05, 1.0, 3.0), (0, 1, 5, vocab + 1), (1.0, 0.9, 1e-9),
                                  (0.0, 0.1, 0.9)))
    rows = [(logits[i % 3], setting) for i, setting in enumerate(grid)]
    batch = torch.stack([row for row, _ in rows])
    settings = list(zip(*[setting for _, setting in rows]))
    probs = probs_from_logits_batch(batch, *settings)
    for i, (row, setting) in enumerate(rows):
        assert torch.equal(probs[i], reference_probs(row, *setting)), setting


def test_bit_for_bit_comparison_has_power():
    """Negative control: the reference with top-p applied before top-k is a different law, and
    the comparison above sees it."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(300, generator=g) * 4
    right = reference_probs(logits, 1.0, 20, 0.5)
    wrong = reference_probs(logits, 1.0, 0, 0.5)
    assert not torch.equal(right, wrong)
    assert torch.equal(probs_from_logits(logits, 1.0, 20, 0.5), right)


# --------------------------------------------------------------------------- 3. HF as an outside
# oracle
def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
             top_p_first: bool = False) -> torch.Tensor:
    """HF's sampling warpers in generate()'s order: temperature, top-k, top-p."""
    scores = logits[None].clone()
    input_ids = torch.zeros(1, 1, dtype=torch.long)
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.insert(1 if top_p_first else len(warpers), TopPLogitsWarper(top_p))
    for w in warpers:
        scores = w(input_ids, scores)
    return scores[0]


HF_GRID = [
    (V_, T, k, p) for V_ in (7, 64, 1000) for T in (0.5, 0.8, 1.0, 1.7) for k in (0, 1, 5, 40)
    for p in (1.0, 0.95, 0.8, 0.5, 0.1)
]


def _hf_logits(i: int, vocab: int) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(i)) * 3  # continuous: no ties


def test_probs_match_hf_warpers():
    for i, (vocab, temperature, top_k, top_p) in enumerate(HF_GRID):
        logits = _hf_logits(i, vocab)
        scores = hf_probs(logits, temperature, top_k, top_p)
        ours = probs_from_logits(logits, temperature, top_k, top_p)
        case = f"V={vocab} T={temperature} top_k={top_k} top_p={top_p}"
        assert torch.equal(torch.isfinite(scores), ours > 0), f"kept sets differ for {case}"
        torch.testing.assert_close(ours, scores.softmax(-1), atol=1e-6, rtol=0, msg=case)


def test_hf_comparison_has_power():
    """Negative controls: top-p applied before top-k, or dropping the crossing token, disagrees with
    HF."""
    order_diffs = crossing_diffs = 0
    for i, (vocab, temperature, top_k, top_p) in enumerate(HF_GRID):
        logits = _hf_logits(i, vocab)
        ours = probs_from_logits(logits, temperature, top_k, top_p)
        if top_k and top_p < 1.0:
            swapped = hf_probs(logits, temperature, top_k, top_p, top_p_first=True)
            order_diffs += not torch.equal(torch.isfinite(swapped), ours > 0)
        if top_p < 1.0:
            no_crossing = ours.clone()
            no_crossing[ours == ours[ours > 0].min()] = 0
            crossing_diffs += not torch.equal(
                torch.isfinite(hf_probs(logits, temperature, top_k, top_p)), no_crossing > 0
            )
    assert order_diffs >= 10
    assert crossing_diffs == sum(p < 1.0 for *_, p in HF_GRID)


def _penalty_inputs():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 40, generator=g) * 4
    logits[:, 3] = 0.0  # exactly zero is left alone by both rules
    seen = torch.tensor([5, 3, 17, 5, 0, 39, 17, 17, 22])  # repeats and out of order
    assert (logits[:, seen] > 0).any() and (logits[:, seen] < 0).any()
    return logits, seen


@pytest.mark.parametrize("penalty", [1.3, 0.7, 1.0])
def test_repetition_penalty_matches_hf(penalty):
    logits, seen = _penalty_inputs()
    before = logits.clone()
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for row in range(2):  # [V]
        expected = hf(seen[None], logits[row][None].clone())[0]
        assert torch.equal(apply_repetition_penalty(logits[row], seen, penalty), expected)
    expected = hf(seen[None].expand(2, -1), logits.clone())  # [B, V], the same history per row
    assert torch.equal(apply_repetition_penalty(logits, seen, penalty), expected)
    assert torch.equal(logits, before), "the input logits were modified in place"
    unseen = torch.ones(40, dtype=torch.bool)
    unseen[seen] = False
    assert torch.equal(apply_repetition_penalty(logits, seen, penalty)[:, unseen],
                       logits[:, unseen])
    assert torch.equal(apply_repetition_penalty(logits, torch.tensor([], dtype=torch.long),
                                                penalty), logits)


def test_repetition_penalty_comparison_has_power():
    """Negative control: 'always divide by the penalty' (wrong for negative logits) differs from
    HF."""
    logits, seen = _penalty_inputs()
    naive = logits.clone()
    naive[:, seen] = naive[:, seen] / 1.3
    hf = RepetitionPenaltyLogitsProcessor(1.3)(seen[None].expand(2, -1), logits.clone())
    assert not torch.equal(naive, hf)
    assert torch.equal(apply_repetition_penalty(logits, seen, 1.3), hf)


# --------------------------------------------------------------------------- 4. greedy
def test_greedy_is_argmax_deterministic_and_consumes_no_randomness():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(100, generator=g)
    best = int(logits.argmax())
    for params in (SamplingParams(temperature=0),
                   SamplingParams(temperature=0, top_k=3, top_p=0.2)):
        global_state = torch.get_rng_state()
        gen = make_generator(42)
        gen_state = gen.get_state()
        picks = {sample_next(logits, params, generator=gen) for _ in range(20)}
        picks |= {sample_next(logits, params, generator=make_generator(s)) for s in range(5)}
        picks.add(sample_next(logits, params))
        assert picks == {best}
        assert torch.equal(gen.get_state(), gen_state), "greedy consumed the private generator"
        assert torch.equal(torch.get_rng_state(),
                           global_state), "greedy consumed the global generator"


@pytest.mark.parametrize(
    ("values", "seen", "penalty", "expected"),
    [
        ([0.5, 2.0, -1.0, 1.8], [1], 1.3, 3),  # 2.0 / 1.3 = 1.54 < 1.8
        ([0.5, 2.0, -1.0, 1.8], [1], 1.05, 1),  # 2.0 / 1.05 = 1.90 > 1.8
        ([-0.5, -0.6, -3.0, -0.9], [0, 0], 1.3, 1),  # -0.5 · 1.3 = -0.65 < -0.6
        # penalty < 1 favours seen tokens: -0.6 · 0.7 = -0.42
        ([-0.5, -0.6, -3.0, -0.9], [1, 3], 0.7, 1),
        ([1.0, 1.5, 0.2, 1.2], [], 2.0, 1),  # nothing seen
    ],
)
def test_greedy_with_repetition_penalty(values, seen, penalty, expected):
    logits = torch.tensor(values)
    seen_ids = torch.tensor(seen, dtype=torch.long)
    params = SamplingParams(temperature=0, repetition_penalty=penalty)
    got = sample_next(logits, params, seen_ids=seen_ids)
    assert got == expected == int(apply_repetition_penalty(logits, seen_ids, penalty).argmax())
    if seen:  # without the history the penalty does not apply
        assert sample_next(logits, params) == int(logits.argmax())


# --------------------------------------------------------------------------- 5. seeds
FLAT = SamplingParams(temperature=1.5)


def _draws(generator, n=50, params=FLAT, between=None):
    out = []
    for i in range(n):
        out.append(sample_next(LOGITS, params, generator=generator))
        if between is not None:
            between(i)
    return out


def test_same_seed_same_draws_different_seeds_differ():
    assert make_generator(None) is None
    assert make_generator(17).initial_seed() == 17
    assert _draws(make_generator(123)) == _draws(make_generator(123))
    runs = [tuple(_draws(make_generator(seed))) for seed in range(10)]
    assert len(set(runs)) == 10
    # with top-k / top-p too
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.9)
    assert _draws(make_generator(8), params=params) == _draws(make_generator(8), params=params)
    assert _draws(make_generator(8), params=params) != _draws(make_generator(9), params=params)


def test_seeded_generator_ignores_global_rng_use():
    reference = _draws(make_generator(2024))
    other = make_generator(7)

    def noise(i):
        torch.manual_seed(i)
        torch.rand(1000)
        torch.randn(3, 3)
        sample_next(LOGITS, FLAT)  # unseeded request on the global RNG
        sample_next(LOGITS, FLAT, generator=other)  # another seeded request beside it

    assert _draws(make_generator(2024), between=noise) == reference
    global_state = torch.get_rng_state()
    _draws(make_generator(5))
    assert torch.equal(torch.get_rng_state(), global_state), "a seeded draw consumed the global RNG"


def test_global_rng_interleaving_negative_control():
    """The isolation test has power: unseeded draws (global RNG) do change when global RNG use
    interleaves."""
    torch.manual_seed(2024)
    plain = _draws(None)
    torch.manual_seed(2024)
    assert _draws(None) == plain  # the global RNG alone is reproducible
    torch.manual_seed(2024)
    assert _draws(None, between=lambda i: torch.rand(7)) != plain


# --------------------------------------------------------------------------- 6. SamplingParams
# validation
@pytest.mark.parametrize(
    ("kwargs", "field", "allowed"),
    [
        ({"temperature": -0.1}, "temperature", "finite number ≥ 1e-6"),
        ({"temperature": float("nan")}, "temperature", "finite number ≥ 1e-6"),
        ({"temperature": "1.0"}, "temperature", "finite number ≥ 1e-6"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": -0.5}, "top_p", "(0, 1]"),
        ({"top_p": 1.0000001}, "top_p", "(0, 1]"),
        ({"top_p": float("nan")}, "top_p", "(0, 1]"),
        ({"top_k": -1}, "top_k", "integer ≥ 0"),
        ({"top_k": 2.0}, "top_k", "integer ≥ 0"),
        ({"top_k": True}, "top_k", "integer ≥ 0"),
        ({"max_tokens": 0}, "max_tokens", "integer ≥ 1"),
        ({"max_tokens": -3}, "max_tokens", "integer ≥ 1"),
        ({"max_tokens": True}, "max_tokens", "integer ≥ 1"),
        ({"max_tokens": 8.0}, "max_tokens", "integer ≥ 1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"repetition_penalty": -1.2}, "repetition_penalty", "> 0"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids", "non-negative integers"),
        ({"stop": ["ok", ""]}, "stop", "non-empty strings"),
        ({"seed": 1.5}, "seed", "None or an integer in"),
        # values that pass a naive range check but break the float32 math or the int64 seed
        ({"top_p": 1e-300}, "top_p", "normal float32"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty", "normal float32"),
        ({"repetition_penalty": 1e39}, "repetition_penalty", "normal float32"),
        ({"seed": 2**64}, "seed", "[-9223372036854775808, 9223372036854775807 - (n - 1)]"),
        ({"seed": -(2**63) - 1}, "seed", "signed 64-bit"),
        ({"seed": 2**64 - 1, "n": 2}, "seed", "n=2"),
        ({"seed": 2**63 - 1, "n": 2}, "seed", "n=2"),
    ],
)
def test_sampling_params_rejects(kwargs, field, allowed):
    with pytest.raises(NanoserveError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    value = kwargs[field]
    assert message.startswith(f"{field}={value!r} "), message
    assert allowed in message, message


def test_sampling_params_accepts_edges():
    p = SamplingParams(temperature=0, top_k=0, top_p=1, repetition_penalty=1e-3, max_tokens=1)
    assert p.greedy
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=1e-6).greedy
    SamplingParams(top_p=1.0, top_k=10**6, temperature=100, seed=0, stop_token_ids=[0])
    SamplingParams(top_p=1e-9, repetition_penalty=5.0)
    (
        SamplingParams(seed=-(2**63)), SamplingParams(seed=2**63 - 1),
        SamplingParams(seed=2**63 - 3, n=3),
    )
    SamplingParams(top_p=torch.finfo(torch.float32).tiny,
                   repetition_penalty=torch.finfo(torch.float32).tiny)
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop="</s>").stop == ["</s>"]  # one string, not its characters
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams().stop is not SamplingParams().stop  # no shared mutable default


# --------------------------------------------------------------------------- 7. no NaN from finite
# logits
F32 = torch.finfo(torch.float32)


def _sampled_law(logits, params: SamplingParams, seen, probs_fn=probs_from_logits):
    """What sample_next draws from, for any settings SamplingParams accepts."""
    x = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    return probs_fn(x, params.temperature, params.top_k, params.top_p)


def _old_probs_from_logits(logits, temperature, top_k=0, top_p=1.0):
    """The sampler before issue 16: no clamp after /T, and top-p may drop every token."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


_EXTREME = st.one_of(st.floats(-F32.max, F32.max, allow_nan=False, allow_infinity=False, width=32),
                     st.sampled_from([F32.max, -F32.max, 0.0, 1e30, -1e30]))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    logits=st.lists(_EXTREME, min_size=2, max_size=24),
    temperature=st.one_of(st.just(1e-6), st.floats(1e-6, 1e3)),
    top_k=st.integers(0, 30),
    top_p=st.one_of(st.just(F32.tiny), st.just(1.0), st.floats(F32.tiny, 1.0)),
    penalty=st.one_of(st.just(F32.tiny), st.just(F32.max), st.floats(F32.tiny, F32.max)),
    n_seen=st.integers(0, 24),
)
def test_finite_logits_never_give_nan_whatever_the_valid_settings(
    logits, temperature, top_k, top_p, penalty, n_seen
):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=penalty)
    t = torch.tensor(logits)
    probs = _sampled_law(t, params, torch.arange(min(n_seen, len(logits))))
    assert torch.isfinite(probs).all() and (probs >= 0).all(), probs
    assert abs(probs.sum().item() - 1) < 1e-4
    # draws without error
    sample_next(t, params, torch.arange(min(n_seen, len(logits))), make_generator(0))


@pytest.mark.parametrize("logits, temperature, top_p, penalty", [
    ([1.0, 2.0, 3.0], 1.0, 1e-300, 1.0),  # 1e-300 is 0 in float32: top-p dropped every token
    ([3e38, -3e38, 1.0], 1e-6, 1.0, 1.0),  # /T overflows to ±inf: softmax(+inf) is NaN
    ([1.0, 2.0, 0.5], 1.0, 1.0, 1e-300),  # the penalty is 0 in float32: x / 0 = +inf twice
])
def test_no_nan_negative_control_the_old_sampler_gives_nan(logits, temperature, top_p, penalty):
    """Values the old checks let through (issue 16): the old law has NaN, the new one none."""
    t, seen = torch.tensor(logits), torch.arange(len(logits))
    x = apply_repetition_penalty(t, seen, penalty)
    assert torch.isnan(_old_probs_from_logits(x, temperature, 0, top_p)).any()  # the bug, shown
    probs = probs_from_logits(x, temperature, 0, top_p)
    # the sampler alone copes
    assert torch.isfinite(probs).all() and abs(probs.sum().item() - 1) < 1e-6


# --------------------------------------------------------------------------- 8. the batched sampler
def _mixed_rows(vocab: int, n: int, seed: int):
    """n rows of logits with every kind of setting, seeded rows and a global-RNG row among them."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 4
    kinds = [dict(temperature=0), dict(temperature=0.8, seed=1), dict(top_k=5, seed=2),
             dict(top_p=0.7, seed=3),
             dict(top_k=7, top_p=0.9, temperature=1.3, seed=4),
             dict(repetition_penalty=1.4, seed=5),
             dict(temperature=0, repetition_penalty=2.0), dict(temperature=0.5)]
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(n)]
    seen = []
    for p in params:
        ids = None
        if p.repetition_penalty != 1.0:
            ids = torch.randint(0, vocab, (6,), generator=g)
        seen.append(ids)
    return logits, params, seen


def _per_row(logits, params, seen, seed, sample=reference_sample):
    """Row by row with the written-out law (tests/sampling_reference.py)."""
    torch.manual_seed(seed)  # the unseeded rows share torch's global stream, in row order
    return [sample(x, p, s, make_generator(p.seed)) for x, p, s in zip(logits, params, seen)]


def test_sample_next_is_the_written_out_law_on_one_row():
    for seed in range(3):
        logits, params, seen = _mixed_rows(257, 16, seed)
        assert _per_row(logits, params, seen, seed, sample_next) == _per_row(logits, params, seen,
                                                                             seed)


@pytest.mark.parametrize("vocab, n", [(3, 8), (40, 13), (257, 64)])
def test_batched_sampler_draws_what_the_written_out_law_draws_row_by_row(vocab, n):
    for seed in range(5):
        logits, params, seen = _mixed_rows(vocab, n, seed)
        expected = _per_row(logits, params, seen, seed)
        torch.manual_seed(seed)
        tokens, nan = sample_batch(logits, params, seen, [make_generator(p.seed) for p in params])
        assert tokens == expected and nan == [False] * n


def test_batched_sampler_flags_nan_rows_and_still_draws_the_others():
    logits, params, seen = _mixed_rows(50, 8, 0)
    logits[3] = float("nan")
    expected = _per_row(logits, params, seen, 0)
    torch.manual_seed(0)
    tokens, nan = sample_batch(logits, params, seen, [make_generator(p.seed) for p in params])
    assert nan == [i == 3 for i in range(8)]
    del tokens[3], expected[3]
    assert tokens == expected


def test_batched_sampler_negative_control_one_generator_for_all_rows_differs():
    """Sharing one seeded stream across rows (a tempting batching shortcut) changes the draws."""
    logits, params, seen = _mixed_rows(257, 16, 1)
    expected = _per_row(logits, params, seen, 1)
    shared = make_generator(1)
    torch.manual_seed(1)
    tokens, _ = sample_batch(logits, params, seen,
                             [shared if p.seed is not None else None for p in params])
    assert tokens != expected
