"""Tests for nanoserve.spec.rejection_sampler: the output law of speculative decoding is the
target's (docs/TESTING.md §B 1–5).

Every expected value is computed here from definitions the module did not write:
* Exact law, float64: `speculative_law` (built from the sampler's acceptance rule and residual)
  equals p to 1e-12 on edge cases; with a wrong residual patched in, it must not.
* One step, Monte Carlo: 2·10⁵ draws of `rejection_sample_batch` vs p, Pearson χ² with V − 1 dof,
  fail at p < 1e-4. The two classic bugs ("on reject resample from p", "residual = |p − q|") are
  patched into the module and must fail the same test.
* Whole loop: `speculative_generate` on tiny Markov chains (tables); the law of the first L tokens
  is enumerated exactly from the target's table; χ² over the V^L cells. Wrong loops (bonus token
  from the wrong row, target rows off by one position, resampling from p after a rejection) must
  fail it.
* Tokens per target call vs (1 − α^(γ+1)) / (1 − α) within 4 standard errors, variance from the
  exact law.
* Identical draft: γ + 1 tokens every step; temperature 0: plain greedy decoding of the target,
  token for token.
* The n-gram proposer against a brute-force reference; bad inputs raise NanoserveError.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from chi2 import goodness_of_fit

from nanoserve.engine.sampler import probs_from_logits
from nanoserve.errors import NanoserveError
from nanoserve.spec import reference, rejection_sampler
from nanoserve.spec.proposers import NgramProposer
from nanoserve.spec.reference import speculative_generate
from nanoserve.spec.rejection_sampler import (
    MAX_SPECULATIVE_TOKENS,
    PAD_TOKEN_ID,
    acceptance_rate,
    expected_tokens_per_step,
    greedy_verify,
    greedy_verify_batch,
    rejection_sample,
    rejection_sample_batch,
    residual_distribution,
    speculative_law,
)

P_FAIL = 1e-4  # docs/TESTING.md: fail a goodness-of-fit test at p < 1e-4
F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- helpers


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_dist(vocab: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    """softmax of scaled Gaussian logits, float64 [V]."""
    return torch.softmax(scale * torch.randn(vocab, generator=gen(seed), dtype=F64), -1)


def normalized(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x / x.sum(-1, keepdim=True)




def mutant_resample_from_p(p, q):  # bug: after a rejection, sample the target again
    return p


def mutant_abs_residual(p, q):  # bug: residual ∝ |p − q| instead of max(p − q, 0)
    r = (p - q).abs()
    return r / r.sum(-1, keepdim=True)


MUTANTS = {"on reject resample from p": mutant_resample_from_p,
           "residual = |p - q|": mutant_abs_residual}


# --------------------------------------------------------------------------- 1. exact law (float64)
V_LAW = 16


def _truncated(seed: int, temperature: float, top_k: int, top_p: float,
               noise_seed: int | None = None) -> torch.Tensor:
    logits = 2 * torch.randn(V_LAW, generator=gen(seed))
    # a draft-like perturbation of the same logits: the kept sets overlap in part
    if noise_seed is not None:
        logits = logits + torch.randn(V_LAW, generator=gen(noise_seed))
    return normalized(probs_from_logits(logits, temperature, top_k, top_p))


def _one_hot(i: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), V_LAW).to(F64)


def _law_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    p, q = random_dist(V_LAW, 1), random_dist(V_LAW, 2)
    top = int(p.argmax())
    disjoint_p = normalized(torch.where(torch.arange(V_LAW) < 8, p, 0))
    disjoint_q = normalized(torch.where(torch.arange(V_LAW) >= 8, q, 0))
    p_truncated = _truncated(3, 0.8, top_k=5, top_p=1.0)
    return {
        "random": (p, q),
        "p = q": (p, p.clone()),
        "disjoint support": (disjoint_p, disjoint_q),
        "one-hot q on p's mode": (p, _one_hot(top)),
        "one-hot q where p = 0": (p_truncated, _one_hot(int(p_truncated.argmin()))),
        "one-hot p (temperature 0)": (_one_hot(top), q),
        "top-k / top-p p and q": (_truncated(4, 0.7, 6, 0.9),
                                  _truncated(4, 1.3, 0, 0.8, noise_seed=5)),
        "q > 0 where p = 0": (p_truncated, q),
        "p > 0 where q = 0": (q, p_truncated),
    }


@pytest.mark.parametrize("case", list(_law_cases()))
def test_speculative_law_is_exactly_p(case):
    p, q = _law_cases()[case]
    assert abs(p.sum() - 1) < 1e-15 and abs(q.sum() - 1) < 1e-15
    law = speculative_law(p, q)
    assert law.dtype == F64
    assert (law - p).abs().max() <= 1e-12, case
    # β from the definition; 1 − β is the chance of a rejection (zero only when p = q)
    assert float(acceptance_rate(p, q)) == pytest.approx(
        1 - 0.5 * float((p - q).abs().sum()), abs=1e-15
    )


@pytest.mark.parametrize("case", [c for c in _law_cases() if c != "p = q"])
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_speculative_law_catches_wrong_residuals(case, mutant, monkeypatch):
    p, q = _law_cases()[case]
    monkeypatch.setattr(rejection_sampler, "residual_distribution", MUTANTS[mutant])
    wrong = speculative_law(p, q)
    # Resampling from p is harmless exactly when min(p, q) = β·p: disjoint supports (β = 0) and
    # one-hot p.
    harmless = {"disjoint support", "one-hot q where p = 0", "one-hot p (temperature 0)"}
    if mutant == "on reject resample from p" and case in harmless:
        assert (wrong - p).abs().max() <= 1e-12
    else:
        assert (wrong - p).abs().max() > 1e-3, f"{mutant} not caught on {case}"


def test_residual_distribution():
    p, q = random_dist(V_LAW, 7), random_dist(V_LAW, 8)
    r = residual_distribution(p, q)
    assert float(r.sum()) == pytest.approx(1, abs=1e-12)
    assert torch.equal(r == 0, p <= q)  # mass exactly where the target has more than the draft
    expected = [max(a - b, 0) for a, b in zip(p.tolist(), q.tolist())]
    assert r.tolist() == pytest.approx([e / sum(expected) for e in expected], abs=1e-15)
    # the floating-point corner: p ≤ q everywhere (p = q up to rounding) falls back to p
    assert torch.equal(residual_distribution(p * (1 - 1e-7), p), p * (1 - 1e-7))
    assert torch.equal(residual_distribution(p, p), p)


# --------------------------------------------------------------------------- 2. one step, Monte
# Carlo
N_DRAWS = 200_000


def _mc_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor | None, int | None]]:
    """name -> (p [V], q [V] or None, the token a one-hot proposal always drafts)."""
    # the draft sees perturbed logits, as a small model would
    base = torch.randn(16, generator=gen(11))
    p16 = normalized(probs_from_logits(base, 1.0, 10, 0.95))  # 8 tokens kept
    # 7 kept
    q16 = normalized(probs_from_logits(base + torch.randn(16, generator=gen(12)), 1.2, 0, 0.9))
    p32 = random_dist(32, 13)
    return {
        "V=8 random": (random_dist(8, 9), random_dist(8, 10), None),
        "V=16 top-k/top-p p, top-p q": (p16, q16, None),
        "V=24 q > 0 where p = 0": (normalized(torch.where(torch.arange(24) % 3 == 0,
                                                          random_dist(24, 14), 0)),
                                   random_dist(24, 15), None),
        "V=32 one-hot q (n-gram)": (p32, None, int(p32.argmax())),
    }


def one_step_counts(p: torch.Tensor, q: torch.Tensor | None, fixed: int | None,
                    seed: int) -> tuple[torch.Tensor, bool]:
    """Counts of the first emitted token over N_DRAWS independent one-token drafts, all in one
    batch, and whether the token was the draft's exactly when it was accepted."""
    vocab = p.numel()
    g = gen(seed)
    if q is None:
        draft = torch.full((N_DRAWS, 1), fixed)  # N, 1
        q_batch = None
    else:
        # N, 1
        draft = torch.multinomial(q.float(), N_DRAWS, replacement=True, generator=g)[:, None]
        q_batch = q.float().expand(N_DRAWS, 1, vocab)  # N, 1, V
    p_batch = torch.stack([p, random_dist(vocab, 99)]).float().expand(N_DRAWS, 2, vocab)  # N, 2, V
    out, num_accepted = rejection_sample_batch(draft, q_batch, p_batch, generator=g)  # N, 2 and N
    return torch.bincount(out[:, 0], minlength=vocab), torch.equal(
        out[:, 0] == draft[:, 0], num_accepted == 1
    )


@pytest.mark.parametrize("case", list(_mc_cases()))
def test_one_step_monte_carlo_matches_p(case, monkeypatch):
    p, q, fixed = _mc_cases()[case]
    counts, rejected_never_redraws = one_step_counts(p, q, fixed, seed=21)
    assert rejected_never_redraws  # the residual has no mass on a rejected token
    chi2, df, pv = goodness_of_fit(counts, p)
    print(f"\n[one step] {case}: χ² = {chi2:.1f}, dof {df}, p = {pv:.3f}")
    assert pv >= P_FAIL, f"{case}: χ² = {chi2:.1f} with {df} dof, p = {pv:.2e}"
    for name, mutant in MUTANTS.items():
        monkeypatch.setattr(rejection_sampler, "residual_distribution", mutant)
        chi2_w, df_w, pv_w = goodness_of_fit(one_step_counts(p, q, fixed, seed=21)[0], p)
        print(f"[one step] {case}, mutant {name!r}: χ² = {chi2_w:.1f}, p = {pv_w:.1e}")
        assert pv_w < P_FAIL, f"{case}: mutant {name!r} passed: χ² = {chi2_w:.1f}, p = {pv_w:.2e}"


def test_batch_agrees_with_single_row_form_token_for_token():
    """Per-row generators: row b of the batch draws exactly what rejection_sample draws with that
    generator."""
    B, gamma, vocab = 12, 4, 10
    lengths = [0, 1, 2, 3, 4, 4, 4, 2, 1, 3, 4, 0]
    g = gen(31)
    p = torch.softmax(2 * torch.randn(B, gamma + 1, vocab, generator=g), -1)  # B, γ+1, V
    q = torch.softmax(2 * torch.randn(B, gamma, vocab, generator=g), -1)  # B, γ, V
    draft = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(B, gamma)  # B, γ
    for deterministic in (False, True):
        q_in = None if deterministic else q
        for seed in range(20):
            seeds = [1000 * seed + b for b in range(B)]
            padded = draft.masked_fill(torch.arange(gamma) >= torch.tensor(lengths)[:, None], 7)
            out, acc = rejection_sample_batch(padded, q_in, p, lengths, [gen(s) for s in seeds])
            for b in range(B):
                n = lengths[b]
                tokens, a = rejection_sample(draft[b, :n], None if deterministic else q[b, :n],
                                             p[b, :n + 1],
                                             gen(seeds[b]))
                assert (out[b, :a + 1].tolist(), int(acc[b])) == (tokens, a)
                assert out[b, a + 1:].eq(PAD_TOKEN_ID).all() and 1 <= len(tokens) <= n + 1


def test_one_hot_q_is_the_same_as_q_none():
    g = gen(41)
    p = torch.softmax(torch.randn(4, 7, generator=g), -1)
    draft = torch.tensor([3, 3, 0])
    q = torch.nn.functional.one_hot(draft, 7).float()
    for seed in range(50):
        assert rejection_sample(draft, q, p, gen(seed)) == rejection_sample(
            draft, None, p, gen(seed)
        )


def test_one_hot_p_reproduces_greedy_verify():
    """Temperature 0 inside the sampler: p one-hot at the target's argmax makes every coin
    certain."""
    g = gen(42)
    for trial in range(200):
        gamma = 1 + trial % 5
        logits = torch.randn(gamma + 1, 5, generator=g)  # γ+1, V
        best = logits.argmax(-1)
        draft = torch.where(torch.rand(gamma, generator=g) < 0.7, best[:gamma],
                            torch.randint(5, (gamma,), generator=g))
        q = torch.softmax(torch.randn(gamma, 5, generator=g), -1)
        one_hot_p = torch.nn.functional.one_hot(best, 5).float()
        assert rejection_sample(draft, q, one_hot_p, g) == greedy_verify(draft, logits)
        assert rejection_sample(draft, None, one_hot_p, g) == greedy_verify(draft, logits)


def test_greedy_batch_agrees_with_single_row_form():
    """greedy_verify_batch (the engine's, on the device) against greedy_verify row by row, with
    ragged draft lengths and drafts that mostly follow the target's argmax."""
    g = gen(43)
    B, gamma, vocab = 9, 5, 6
    for _ in range(60):
        logits = torch.randn(B, gamma + 1, vocab, generator=g)  # B, γ+1, V
        best = logits.argmax(-1)
        draft = torch.where(torch.rand(B, gamma, generator=g) < 0.8, best[:, :gamma],
                            torch.randint(vocab, (B, gamma), generator=g))  # B, γ
        lengths = torch.randint(0, gamma + 1, (B,), generator=g).tolist()
        out, acc = greedy_verify_batch(draft, logits, lengths)
        for b, n in enumerate(lengths):
            tokens, a = greedy_verify(draft[b, :n], logits[b, :n + 1])
            assert (out[b, :a + 1].tolist(), int(acc[b])) == (tokens, a)
            assert out[b, a + 1:].eq(PAD_TOKEN_ID).all()


def test_greedy_verify_accepts_the_matching_prefix():
    logits = torch.tensor([[0.0, 5, 1], [3, 0, 1], [0, 1, 4], [2, 2.5, 0]])  # argmax 1, 0, 2, 1
    # all accepted + bonus
    assert greedy_verify(torch.tensor([1, 0, 2]), logits) == ([1, 0, 2, 1], 3)
    # mismatch at 1: the target's choice
    assert greedy_verify(torch.tensor([1, 2, 2]), logits) == ([1, 0], 1)
    assert greedy_verify(torch.tensor([0, 0, 2]), logits) == ([1], 0)
    # no draft: a plain step
    assert greedy_verify(torch.tensor([], dtype=torch.long), logits[:1]) == ([1], 0)
    # p or logits
    assert greedy_verify(torch.tensor([1, 0, 2]), logits.softmax(-1)) == ([1, 0, 2, 1], 3)


# --------------------------------------------------------------------------- 3. the whole loop on
# Markov chains
# states; the target forbids one transition per state (p = 0 there) while the draft allows all
VC = 3
TARGET = torch.tensor([[0.0, 0.55, 0.45], [0.3, 0.0, 0.7], [0.6, 0.4, 0.0]], dtype=F64)
# unrelated to TARGET
DRAFT = torch.tensor([[0.2, 0.5, 0.3], [0.5, 0.25, 0.25], [0.3, 0.3, 0.4]], dtype=F64)
START = 0


def chain_steps(target: torch.Tensor, draft: torch.Tensor):
    """(target_step, draft_step) over transition tables: a token's logits are log P[previous
    token]."""
    log_t, log_d = target.log().float(), draft.log().float()

    def target_step(tokens: list[int], draft_ids: list[int]) -> torch.Tensor:
        return log_t[[tokens[-1]] + draft_ids]  # γ+1, V: row i follows tokens + draft[:i]

    def draft_step(tokens: list[int]) -> torch.Tensor:
        return log_d[tokens[-1]]  # V

    return target_step, draft_step


def tempered(table: torch.Tensor, temperature: float) -> torch.Tensor:
    w = table ** (1 / temperature)
    return w / w.sum(-1, keepdim=True)


def joint_law(table: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """P(x_1..x_L) for every sequence in lexicographic order (cell index = x_1 x_2 .. x_L in base
    V)."""
    law = []
    for seq in itertools.product(range(table.shape[0]), repeat=length):
        prob, prev = 1.0, start
        for x in seq:
            prob, prev = prob * float(table[prev, x]), x
        law.append(prob)
    return torch.tensor(law, dtype=F64)


def joint_counts(
    target_step, draft_step, length: int, gamma: int, temperature: float, n: int, seed: int
):
    g = gen(seed)
    counts = torch.zeros(VC ** length, dtype=F64)
    for _ in range(n):
        out = speculative_generate(target_step, draft_step, [START], length, gamma, temperature, g)
        assert len(out.token_ids) == length
        counts[sum(x * VC ** (length - 1 - i) for i, x in enumerate(out.token_ids))] += 1
    return counts


N_JOINT = {1: 3000, 2: 3000, 3: 3000, 5: 2000}  # 1–2 s per case on one CPU core



@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("gamma", [1, 2, 3, 5])
def test_joint_law_of_first_tokens_through_the_loop(gamma, temperature):
    length = gamma + 2  # at least two verifications per sequence
    target_step, draft_step = chain_steps(TARGET, DRAFT)
    counts = joint_counts(
        target_step, draft_step, length, gamma, temperature, N_JOINT[gamma], seed=gamma
    )
    law = joint_law(tempered(TARGET, temperature), START, length)
    chi2, df, pv = goodness_of_fit(counts, law)
    print(f"\n[joint] γ={gamma} T={temperature} L={length}: χ² = {chi2:.1f}, dof {df}, p = "
          f"{pv:.3f}")
    assert pv >= P_FAIL, f"χ² = {chi2:.1f} with {df} dof, p = {pv:.2e}"


# far from DRAFT
DENSE_TARGET = torch.tensor([[0.6, 0.1, 0.3], [0.15, 0.15, 0.7], [0.1, 0.6, 0.3]], dtype=F64)


def _shifted_rows(target_step):  # bug: the target's row i is taken one position too early
    return lambda tokens, draft_ids: target_step(tokens, [tokens[-1]] + draft_ids[:-1])


def _bonus_from_wrong_row(monkeypatch):  # bug: the bonus token is drawn from the last draft's row
    right = rejection_sampler.rejection_sample
    monkeypatch.setattr(reference, "rejection_sample", lambda draft_ids, q, p,
                        generator=None: right(
        draft_ids, q, torch.cat([p[:-1], p[-2:-1]]), generator))


LOOP_MUTANTS = {
    "target rows off by one": lambda monkeypatch, step: _shifted_rows(step),
    "bonus from the wrong row": lambda monkeypatch,
    step: _bonus_from_wrong_row(monkeypatch) or step,
    "on reject resample from p": lambda monkeypatch, step: monkeypatch.setattr(
        rejection_sampler, "residual_distribution", mutant_resample_from_p) or step,
}


@pytest.mark.parametrize("target", ["sparse", "dense"])
@pytest.mark.parametrize("mutant", list(LOOP_MUTANTS))
def test_joint_law_catches_wrong_loops(mutant, target, monkeypatch):
    """The same χ² test (γ = 3, T = 1, L = 5) on broken loops. On the sparse target a broken loop
    may emit a forbidden sequence (χ² = ∞); the dense target shows the χ² alone catches it too."""
    table = TARGET if target == "sparse" else DENSE_TARGET
    gamma, length = 3, 5
    target_step, draft_step = chain_steps(table, DRAFT)
    target_step = LOOP_MUTANTS[mutant](monkeypatch, target_step)
    counts = joint_counts(target_step, draft_step, length, gamma, 1.0, 1500, seed=51)
    chi2, df, pv = goodness_of_fit(counts, joint_law(table, START, length))
    print(f"\n[joint] {target} target, mutant {mutant!r}: χ² = {chi2:.1f}, dof {df}, p = {pv:.1e}")
    assert pv < P_FAIL


def test_joint_law_dense_target_control():
    """The dense target with the correct loop passes (so the mutants above fail for their bug
    alone)."""
    target_step, draft_step = chain_steps(DENSE_TARGET, DRAFT)
    counts = joint_counts(target_step, draft_step, 5, 3, 1.0, 1500, seed=51)
    chi2, df, pv = goodness_of_fit(counts, joint_law(DENSE_TARGET, START, 5))
    print(f"\n[joint] dense target, correct loop: χ² = {chi2:.1f}, dof {df}, p = {pv:.3f}")
    assert pv >= P_FAIL


# --------------------------------------------------------------------------- 4. tokens per target
# call
@pytest.mark.parametrize("gamma, draft_seed", [(1, 62), (3, 62), (5, 63), (3, 61)])
def test_tokens_per_target_call_matches_formula(gamma, draft_seed):
    """Position-independent p and q (every position has the same p and the same q), so the
    acceptance rate is one number, α = Σ min(p, q), and each step's token count K has the truncated
    geometric law P(K = k) = α^(k−1)(1 − α) for k ≤ γ, P(K = γ + 1) = α^γ."""
    vocab = 8
    t_logits = 1.5 * torch.randn(vocab, generator=gen(60))
    d_logits = 1.5 * torch.randn(vocab, generator=gen(draft_seed))
    if draft_seed == 61:
        # a good draft: α near 0.9
        d_logits = t_logits + 0.3 * torch.randn(vocab, generator=gen(draft_seed))
    p, q = probs_from_logits(t_logits, 1.0).double(), probs_from_logits(d_logits, 1.0).double()
    alpha = float(torch.minimum(p, q).sum())
    out = speculative_generate(lambda tokens, draft: t_logits.expand(len(draft) + 1, vocab),
                               lambda tokens: d_logits,
                               [0], 2500, gamma, 1.0, gen(gamma + draft_seed))
    k_law = [alpha ** (k - 1) * (1 - alpha) for k in range(1, gamma + 1)] + [alpha ** gamma]
    mean = sum(k * pk for k, pk in enumerate(k_law, start=1))
    var = sum((k - mean) ** 2 * pk for k, pk in enumerate(k_law, start=1))
    assert expected_tokens_per_step(alpha, gamma) == pytest.approx(mean, rel=1e-12)
    steps = out.num_target_calls
    se = math.sqrt(var / steps)
    print(f"\n[tokens/call] γ={gamma} α={alpha:.3f}: {out.tokens_per_target_call:.3f} vs "
          f"{mean:.3f} ± {se:.3f} ({steps} calls); α̂ = {out.acceptance_rate:.3f}")
    assert abs(out.tokens_per_target_call - mean) <= 4 * se
    tested = sum(out.num_accepted) + sum(a < d for a, d in zip(out.num_accepted, out.num_drafted))
    assert abs(out.acceptance_rate - alpha) <= 4 * math.sqrt(alpha * (1 - alpha) / tested)


def test_expected_tokens_per_step_formula():
    for gamma in (1, 2, 5, MAX_SPECULATIVE_TOKENS):
        assert expected_tokens_per_step(1.0, gamma) == gamma + 1
        assert expected_tokens_per_step(0.0, gamma) == 1
        for alpha in (0.1, 0.5, 0.9, 0.999):
            assert expected_tokens_per_step(alpha, gamma) == pytest.approx(
                sum(alpha**i for i in range(gamma + 1))
            )


# --------------------------------------------------------------------------- 5. identical draft,
# random draft, greedy
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_identical_draft_emits_gamma_plus_one_tokens_every_step(gamma):
    target_step, draft_step = chain_steps(TARGET, TARGET)
    out = speculative_generate(target_step, draft_step, [START], 60, gamma, 0.7, gen(70 + gamma))
    assert out.num_accepted == [gamma] * out.num_target_calls
    assert out.num_target_calls == math.ceil(60 / (gamma + 1))
    assert out.acceptance_rate == 1.0 and out.tokens_per_target_call == gamma + 1


def test_random_draft_still_samples_the_target():
    """A draft that knows nothing (uniform) only costs speed: the first tokens still follow the
    target."""
    gamma, length = 2, 4
    target_step, draft_step = chain_steps(TARGET, torch.full((VC, VC), 1 / VC, dtype=F64))
    counts = joint_counts(target_step, draft_step, length, gamma, 1.0, 3000, seed=80)
    chi2, df, pv = goodness_of_fit(counts, joint_law(TARGET, START, length))
    print(f"\n[joint] uniform draft γ={gamma}: χ² = {chi2:.1f}, dof {df}, p = {pv:.3f}")
    assert pv >= P_FAIL


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculation_equals_plain_greedy(gamma):
    """Logits depend on the position and the last token (so greedy decoding does not fall into a
    short cycle); the draft has the target's logits in 60 % of the (position, token) states and
    random ones elsewhere."""
    vocab, prompt, n_new = 6, [4, 1], 64
    target = torch.randn(len(prompt) + n_new + MAX_SPECULATIVE_TOKENS, vocab, vocab,
                         generator=gen(90))
    draft = torch.where(torch.rand(target.shape[:2] + (1,), generator=gen(92)) < 0.6, target,
                        torch.randn(target.shape, generator=gen(91)))

    def target_step(tokens, draft_ids):
        ctx = tokens + draft_ids
        # γ+1, V
        return torch.stack([target[n, ctx[n - 1]] for n in range(len(tokens), len(ctx) + 1)])

    plain = list(prompt)
    # plain greedy decoding of the target, one token per call
    while len(plain) < len(prompt) + n_new:
        plain.append(int(target[len(plain), plain[-1]].argmax()))
    out = speculative_generate(target_step, lambda tokens: draft[len(tokens), tokens[-1]], prompt,
                               n_new, gamma, 0.0)
    assert out.token_ids == plain[len(prompt):]
    # both acceptances and rejections happened
    assert 0 < sum(out.num_accepted) < sum(out.num_drafted)


# --------------------------------------------------------------------------- n-gram proposer
def test_ngram_prefers_the_longest_match():
    # [1, 2, 3] at 1; the 1-gram [3] also at 7, more recently
    tokens = [5, 1, 2, 3, 9, 9, 7, 3, 8, 1, 2, 3]
    assert NgramProposer(max_n=3).propose(tokens, 4) == [9, 9, 7, 3]
    assert NgramProposer(max_n=1).propose(tokens, 4) == [8, 1, 2, 3]


def test_ngram_takes_the_most_recent_occurrence():
    tokens = [1, 2, 7, 1, 2, 8, 1, 2]
    assert NgramProposer(max_n=2).propose(tokens, 3) == [8, 1, 2]
    assert NgramProposer(max_n=2).propose(tokens, 1) == [8]


def test_ngram_proposes_at_most_k_and_may_propose_fewer_or_none():
    # the match runs into the end
    assert NgramProposer(max_n=2).propose([1, 2, 3, 1, 2], 5) == [3, 1, 2]
    # default k = γ
    assert NgramProposer(num_speculative_tokens=2).propose([1, 2, 3, 1, 2]) == [3, 1]
    assert NgramProposer().propose([1, 2, 3, 1, 2], 0) == []
    assert NgramProposer().propose([1, 2, 3, 4], 3) == []  # no earlier occurrence of any suffix
    assert NgramProposer().propose([7], 3) == [] and NgramProposer().propose([], 3) == []
    assert NgramProposer(min_n=2).propose([1, 2, 3, 4, 1], 3) == []  # only a 1-gram matches
    assert NgramProposer(min_n=1).propose([1, 2, 3, 4, 1], 3) == [2, 3, 4]
    # overlapping match: its continuation is the last token
    assert NgramProposer().propose([4, 4, 4], 3) == [4]


def brute_force_ngram(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """All (n, start) with tokens[start:start+n] == the last n tokens and start + n < len; the
    longest n wins, then the latest start."""
    matches = [(n, s) for n in range(min_n, max_n + 1) for s in range(len(tokens) - n)
               if n < len(tokens) and tokens[s:s + n] == tokens[len(tokens) - n:]]
    if not matches:
        return []
    n, s = max(matches)
    return tokens[s + n:s + n + k]


def test_ngram_matches_a_brute_force_reference():
    rng = random.Random(100)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        max_n = rng.randint(1, 4)
        min_n, k = rng.randint(1, max_n), rng.randint(0, 6)
        assert NgramProposer(max_n, min_n).propose(tokens, k) == brute_force_ngram(
            tokens, k, max_n, min_n
        )


# --------------------------------------------------------------------------- bad input
def _p(rows: int, vocab: int = 5) -> torch.Tensor:
    return torch.full((rows, vocab), 1 / vocab)


@pytest.mark.parametrize("call, message", [
    (lambda: rejection_sample(torch.tensor([1, 2]), _p(2), _p(2)), "γ\\+1 = 3 rows"),
    (lambda: rejection_sample(torch.tensor([1, 2]), _p(1), _p(3)),
     "q must be \\[γ, V\\] with γ = 2"),
    (lambda: rejection_sample(torch.tensor([1, 2]), _p(2, 6), _p(3)),
     "share the vocabulary.*6 and 5"),
    (lambda: rejection_sample(torch.tensor([1.0, 2.0]), _p(2), _p(3)), "1-D integer tensor"),
    (lambda: rejection_sample(torch.tensor([1, 5]), _p(2), _p(3)), "must be in 0..4"),
    (lambda: rejection_sample(torch.zeros(17, dtype=torch.long), _p(17), _p(18)), "at most 16"),
    (lambda: rejection_sample(torch.tensor([1, 2]), torch.tensor([[0.5, 0.5, 0, 0, 0]] * 2), _p(3)),
     "q\\(x\\) = 0"),
    (lambda: greedy_verify(torch.tensor([1, 2]), _p(2)), "γ\\+1 = 3 rows"),
    (lambda: rejection_sample_batch(torch.zeros(2, 0, dtype=torch.long), None,
                                    _p(1)[None].expand(2, 1, 5)),
     "1 ≤ γ ≤ 16"),
    (lambda: rejection_sample_batch(torch.zeros(2, 2, dtype=torch.long), None,
                                    _p(2)[None].expand(2, 2, 5)),
     "p must be \\[B, γ\\+1, V\\]"),
    (lambda: rejection_sample_batch(torch.zeros(2, 2, dtype=torch.long),
                                    _p(2, 4)[None].expand(2, 2, 4),
                                    _p(3)[None].expand(2, 3, 5)), "same vocabulary"),
    (lambda: rejection_sample_batch(torch.zeros(2, 2, dtype=torch.long), None,
                                    _p(3)[None].expand(2, 3, 5), [1, 3]),
     "num_draft_tokens must be 2 integers in 0..2"),
    (lambda: rejection_sample_batch(torch.zeros(2, 2, dtype=torch.long), None,
                                    _p(3)[None].expand(2, 3, 5),
                                    generator=[gen(0)]), "one generator per row"),
    (lambda: rejection_sample_batch(torch.ones(1, 2, dtype=torch.long),
                                    torch.tensor([[[1.0, 0, 0, 0, 0]] * 2]),
                                    _p(3)[None]), "q\\(x\\) = 0"),
    (lambda: speculative_law(_p(1)[0], _p(1, 6)[0]), "same shape"),
    (lambda: NgramProposer(min_n=0), "1 ≤ min_n ≤ max_n"),
    (lambda: NgramProposer(max_n=2, min_n=3), "1 ≤ min_n ≤ max_n"),
    (lambda: NgramProposer(num_speculative_tokens=0),
     "num_speculative_tokens=0 must be an integer in 1..16"),
    (lambda: NgramProposer(num_speculative_tokens=17), "in 1..16"),
    (lambda: NgramProposer().propose([1, 2], -1), "k=-1 must be an integer ≥ 0"),
    (lambda: speculative_generate(None, None, [0], 5, 0), "gamma=0 must be an integer in 1..16"),
    (lambda: speculative_generate(None, None, [0], 5, 17), "gamma=17"),
    (lambda: speculative_generate(None, None, [0], 0, 2), "max_tokens=0"),
    (lambda: speculative_generate(None, None, [0], 5, 2, -1.0), "temperature=-1.0"),
    (lambda: speculative_generate(None, None, [], 5, 2), "at least one token"),
    (lambda: expected_tokens_per_step(1.5, 3), "alpha=1.5 must be in \\[0, 1\\]"),
    (lambda: expected_tokens_per_step(0.5, 0), "gamma=0"),
])
def test_bad_input_raises_a_clear_error(call, message):
    with pytest.raises(NanoserveError, match=message):
        call()


def test_padding_is_never_validated_or_read():
    """Rows shorter than γ may carry anything in their padding: a q of 0 there, ids out of range."""
    p = torch.softmax(torch.randn(2, 3, 5, generator=gen(110)), -1)  # B, γ+1, V
    q = torch.softmax(torch.randn(2, 2, 5, generator=gen(111)), -1)  # B, γ, V
    q[0, 1] = 0  # padding of row 0
    draft = torch.tensor([[int(q[0, 0].argmax()), 99], [1, 2]])
    out, acc = rejection_sample_batch(draft, q, p, [1, 2], gen(112))
    assert int(acc[0]) <= 1 and out[0, 2] == PAD_TOKEN_ID and 0 <= int(out[0, acc[0]]) < 5
