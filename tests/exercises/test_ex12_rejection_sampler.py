"""Exercise 12: the speculative rejection sampler (nanoserve/spec/rejection_sampler.py:
residual_distribution, rejection_sample).

Oracles, all computed here from the definitions (docs/TESTING.md §B):
* Exact law in float64: min(p, q) + (1 − β)·residual == p, β = Σ min(p, q), on the edge cases of
  §B.1.
* Monte Carlo, Pearson χ² with (support − 1) dof, fail at p-value < 1e-4: N = 2·10⁵ draws with V =
  16 as §B.2 prescribes; for q = None (a deterministic proposal) V = 24 and N = 5·10⁴, which keeps
  every cell ≥ 5 expected draws and still rejects resampling from p by a χ² in the thousands.
  The calls are chained to save time: every row of p is the same law, and so is every row of q, so
  each emitted token (accepted draft, residual draw or bonus), given all the tokens before it, is
  one fresh one-step draw; the first N emitted tokens are N independent draws from the one-step law,
  which must be p.
* Cases whose answer is certain: p one-hot (temperature 0) gives greedy verification; q = p accepts
  every draft and adds the bonus token from p[γ]; a rejected token is never emitted in its place.
The known-wrong variants at the end include the two classic bugs of §B.2 (on a rejection, resample
from p; residual ∝ |p − q|): both fail both χ² tests. Measured on the seeded runs: the correct
sampler p = 0.02 (V = 16) and 0.05 (V = 24, q = None); resampling from p χ² ≈ 800 and 2,900 with 12
and 23 dof; the |p − q| residual draws a token that p forbids within 60 draws, and χ² ≈ 830 where p
forbids none.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from chi2 import goodness_of_fit
from explain import expect, explained_failure

REFERENCE = "nanoserve.spec.rejection_sampler"
EXERCISE = "rejection_sampler"
pytestmark = [pytest.mark.ex12, pytest.mark.usefixtures("one_thread")]

P_FAIL = 1e-4  # docs/TESTING.md: fail a goodness-of-fit test at p < 1e-4
N_DRAWS = 200_000
N_DRAWS_DETERMINISTIC = 50_000  # one-hot q: the mutants' errors sit on a token of p ≈ 0.93
GAMMA_MC = 16  # drafts per call in the Monte Carlo tests (nanoserve allows at most 16)
F64 = torch.float64




def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dist(vocab: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    """softmax of scaled Gaussian logits, float64 [V]."""
    return torch.softmax(scale * torch.randn(vocab, generator=gen(seed), dtype=F64), -1)


def normalized(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x / x.sum(-1, keepdim=True)


def one_hot(i: int, vocab: int) -> torch.Tensor:
    return F.one_hot(torch.tensor(i), vocab).to(F64)




# ----------------------------------------------------------------------------- 12.1: the residual,
# exactly
V_LAW = 16


def _truncated(seed: int, keep: int) -> torch.Tensor:
    """A top-k truncated law: the `keep` most likely of V_LAW tokens, the rest exactly 0."""
    p = dist(V_LAW, seed, 2.0)
    return normalized(torch.where(p >= p.topk(keep).values[-1], p, 0))


def law_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """docs/TESTING.md §B.1's edge cases, float64 (p, q) pairs."""
    p, q = dist(V_LAW, 1), dist(V_LAW, 2)
    p5 = _truncated(3, keep=5)
    return {
        "random": (p, q),
        "p = q": (p, p.clone()),
        "disjoint support": (normalized(torch.where(torch.arange(V_LAW) < 8, p, 0)),
                             normalized(torch.where(torch.arange(V_LAW) >= 8, q, 0))),
        "one-hot q on p's mode (n-gram / greedy draft)": (p, one_hot(int(p.argmax()), V_LAW)),
        "one-hot q where p = 0": (p5, one_hot(int(p5.argmin()), V_LAW)),
        "one-hot p (temperature 0)": (one_hot(int(p.argmax()), V_LAW), q),
        "top-k truncated p and q": (p5, _truncated(4, keep=7)),
        "q > 0 where p = 0": (p5, q),
        "p > 0 where q = 0": (q, p5),
    }


def check_exact_law(impl, case):
    p, q = law_cases()[case]
    r = impl.residual_distribution(p, q)
    assert r.shape == p.shape and r.dtype == F64
    beta = torch.minimum(p, q).sum()
    # accept x with min(1, p/q): mass min(p, q); else the residual
    law = torch.minimum(p, q) + (1 - beta) * r
    gap = float((law - p).abs().max())
    expect(gap <= 1e-12, "the law min(p, q) + (1 − Σ min(p, q)) · residual_distribution(p, q), "
           f"case {case!r}", "p (within 1e-12)", f"max |law − p| = {gap:.2e}")
    if beta < 1 - 1e-12:  # a rejection can happen: the residual is a law on the tokens where p > q
        assert (r >= 0).all() and abs(float(r.sum()) - 1) <= 1e-12
        assert torch.equal(r > 0, p > q)


def check_residual_by_hand(impl):
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.1, 0.2])
    torch.testing.assert_close(impl.residual_distribution(p, q),
                               torch.tensor([0.75, 0.0, 0.25, 0.0]))
    # rows of a batch [2, 3, V] are independent
    ps = torch.stack([dist(6, s) for s in range(6)]).view(2, 3, 6).float()
    qs = torch.stack([dist(6, s + 10) for s in range(6)]).view(2, 3, 6).float()
    r = impl.residual_distribution(ps, qs)
    assert r.shape == (2, 3, 6) and r.dtype == torch.float32
    for b in range(2):
        for t in range(3):
            want = (ps[b, t] - qs[b, t]).clamp_min(0)
            torch.testing.assert_close(r[b, t], want / want.sum())


def check_residual_fallback(impl):
    """p ≤ q everywhere happens only by rounding: then the residual is p itself, never NaN."""
    p = dist(V_LAW, 7)
    torch.testing.assert_close(impl.residual_distribution(p, p), p, rtol=0, atol=0)
    torch.testing.assert_close(impl.residual_distribution(p * (1 - 1e-7), p), p * (1 - 1e-7),
                               rtol=0, atol=0)
    q = dist(V_LAW, 8)
    # one row of each kind
    rows = impl.residual_distribution(torch.stack([p, p]), torch.stack([q, p]))
    want = (p - q).clamp_min(0)
    torch.testing.assert_close(rows, torch.stack([want / want.sum(), p]), rtol=0, atol=1e-15)


# ----------------------------------------------------------------------------- 12.2: Monte Carlo
def _mc_case_draft() -> tuple[torch.Tensor, torch.Tensor]:
    """V = 16: p with three tokens at 0 (truncated); q a flatter draft (temperature 1.15) with 4 %
    of its mass spread uniformly, so q > 0 where p = 0. Acceptance β = 0.94: ~10.8 tokens per call
    of 16 drafts."""
    logits = 1.5 * torch.randn(16, generator=gen(3), dtype=F64)
    logits[torch.arange(16) % 5 == 4] = -math.inf
    q = 0.96 * (logits / 1.15).softmax(-1) + 0.04 / 16
    return normalized(logits.softmax(-1).float()), normalized(q.float())


def _mc_case_deterministic() -> tuple[torch.Tensor, int]:
    """V = 24, q = None: the proposer always guesses token 5, which the target gives p(5) = 0.93."""
    logits = torch.randn(24, generator=gen(4), dtype=F64)
    logits[5] += 5.0
    return normalized(logits.softmax(-1).float()), 5


def emitted_tokens(impl, p: torch.Tensor, q: torch.Tensor | None, token: int | None, seed: int,
                   n: int = N_DRAWS) -> torch.Tensor:
    """The first n tokens emitted by successive calls verifying GAMMA_MC drafts (drawn from q, or
    all `token`). Stops early at a token p cannot produce: that alone fails the test."""
    vocab = p.numel()
    impossible = (p == 0).tolist()
    g = gen(seed)
    # γ+1, V: the same law at every position
    p_rows = p.float().expand(GAMMA_MC + 1, vocab).contiguous()
    q_rows = None if q is None else q.float().expand(GAMMA_MC, vocab).contiguous()  # γ, V
    out: list[int] = []
    while len(out) < n and not any(impossible[t] for t in out[-GAMMA_MC - 1:]):
        if q is None:
            drafts = torch.full((1024, GAMMA_MC), token)
        else:
            drafts = torch.multinomial(q.float(), 1024 * GAMMA_MC, replacement=True,
                                       generator=g).view(1024, GAMMA_MC)
        for draft in drafts:
            tokens = impl.rejection_sample(draft, q_rows, p_rows, g)[0]
            out += tokens
            if len(out) >= n or any(impossible[t] for t in tokens):
                break
    return torch.tensor(out[:n])


def check_chi2_with_draft_distribution(impl):
    p, q = _mc_case_draft()
    counts = torch.bincount(emitted_tokens(impl, p, q, None, seed=21), minlength=16)
    chi2, dof, pvalue = goodness_of_fit(counts, p)
    assert pvalue >= P_FAIL, (
        "the first emitted token of many seeded rejection_sample calls with a random draft q: "
        f"expected draws from p (χ² p-value ≥ {P_FAIL}), got χ² = {chi2:.1f} with {dof} dof, "
        f"p = {pvalue:.2e}")


def check_chi2_with_deterministic_draft(impl):
    p, token = _mc_case_deterministic()
    counts = torch.bincount(emitted_tokens(impl, p, None, token, seed=22, n=N_DRAWS_DETERMINISTIC),
                            minlength=24)
    chi2, dof, pvalue = goodness_of_fit(counts, p)
    assert pvalue >= P_FAIL, (
        "the first emitted token of many seeded rejection_sample calls with a one-hot draft: "
        f"expected draws from p (χ² p-value ≥ {P_FAIL}), got χ² = {chi2:.1f} with {dof} dof, "
        f"p = {pvalue:.2e}")


# ----------------------------------------------------------------------------- 12.2: certain
# answers
def _random_rows(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """rows laws [rows, V], each with a random ~third of its tokens at exactly 0 (never all)."""
    logits = 2 * torch.randn(rows, vocab, generator=g)
    drop = torch.rand(rows, vocab, generator=g) < 0.35
    drop[:, 0] &= ~drop.all(-1)  # keep at least one token per row
    return logits.masked_fill(drop, -math.inf).softmax(-1)


def check_call_structure(impl):
    """What every call must satisfy, whatever the coins: accepted drafts first, then one token from
    the right law's support. After a rejection at i, the token comes from the residual: p_i > q_i
    there (so never x_i itself)."""
    g = gen(30)
    vocab = 8
    for trial in range(300):
        gamma = trial % 7  # 0..6
        # γ+1, V: different laws and supports at every position
        p = _random_rows(gamma + 1, vocab, g)
        deterministic = trial % 3 == 0
        if deterministic:
            draft = torch.randint(vocab, (gamma,), generator=g)  # an n-gram guess: may have p = 0
            q = None
            q_dense = F.one_hot(draft, vocab).float()
        else:
            q = torch.softmax(2 * torch.randn(gamma, vocab, generator=g), -1)  # γ, V
            draft = (
                torch.multinomial(q, 1, generator=g).view(gamma) if gamma
                else torch.zeros(0, dtype=torch.long)
            )
            q_dense = q
        tokens, n = impl.rejection_sample(draft, q, p, g)
        assert isinstance(tokens, list) and all(type(t) is int for t in tokens) and type(n) is int
        assert 0 <= n <= gamma and len(tokens) == n + 1, (tokens, n, gamma)
        assert tokens[:n] == draft[:n].tolist(), "the accepted tokens must be the draft's prefix"
        assert all(p[i, draft[i]] > 0 for i in range(n)), (
            "a draft token the target gives p = 0 was accepted"
        )
        last = tokens[n]
        if n < gamma:
            expect(bool(p[n, last] > q_dense[n, last]),
                   f"rejection_sample, a rejection at {n} of {gamma} drafts",
                   f"a token where p[{n}] > q[{n}] (the residual's support)",
                   f"token {last} with p = {float(p[n, last]):.3g}, "
                   f"q = {float(q_dense[n, last]):.3g}")
        else:
            expect(bool(p[gamma, last] > 0), f"rejection_sample, all {gamma} drafts accepted",
                   "a bonus token with p[γ] > 0", f"token {last} with p[γ] = 0 (another row's?)")


def check_bonus_token(impl):
    """q = p: every draft is accepted (ratio exactly 1), then the bonus token from p[γ]; γ = 0 is a
    plain step."""
    g = gen(40)
    vocab = 9
    for gamma in range(1, 7):
        # γ+1, V
        p = torch.cat([_random_rows(gamma, vocab, g), one_hot(vocab - 1, vocab)[None].float()])
        q = p[:gamma].clone()
        for _ in range(5):
            draft = torch.multinomial(q, 1, generator=g).view(gamma)
            got = impl.rejection_sample(draft, q, p, g)
            want = (draft.tolist() + [vocab - 1], gamma)
            assert got == want, (
                f"rejection_sample(q = p over {gamma} drafts, p[γ] one-hot at {vocab - 1}): "
                f"expected every draft then the bonus token, {want}, got {got}")
    # γ = 0: no draft (a proposer found nothing), one token from p[0]
    p0 = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    for q in (None, torch.zeros(0, 4)):
        seen = set()
        for _ in range(100):
            tokens, n = impl.rejection_sample(torch.zeros(0, dtype=torch.long), q, p0, g)
            assert n == 0 and len(tokens) == 1
            seen.add(tokens[0])
        assert seen == {1, 2}, f"γ = 0 drew {sorted(seen)} from p[0] = [0, 0.5, 0.5, 0]"


def check_one_hot_p_is_greedy(impl):
    """Temperature 0 inside the sampler: p one-hot at the target's choices makes every coin certain,
    and the output is greedy verification, worked out here: keep drafts while they equal the
    target's choice, then its choice."""
    g = gen(50)
    vocab = 5
    for trial in range(120):
        gamma = trial % 6
        # the target's choice at each position
        best = torch.randint(vocab, (gamma + 1,), generator=g)
        guess = torch.randint(vocab, (gamma,), generator=g)
        draft = torch.where(torch.rand(gamma, generator=g) < 0.7, best[:gamma], guess)  # γ
        want = []
        for i in range(gamma + 1):
            want.append(int(best[i]))
            if i == gamma or int(draft[i]) != int(best[i]):
                break
        q = None if trial % 2 else torch.softmax(torch.randn(gamma, vocab, generator=g), -1)
        tokens, n = impl.rejection_sample(draft, q, F.one_hot(best, vocab).float(), g)
        assert (tokens, n) == (want, len(want) - 1), (
            f"rejection_sample(drafts {draft.tolist()}, p one-hot at {best.tolist()}): expected "
            f"greedy verification, {(want, len(want) - 1)}, got {(tokens, n)}")


def check_seeded(impl):
    """All randomness comes from the generator: same seed, same tokens; torch's global generator
    untouched."""
    g = gen(60)
    p = torch.softmax(torch.randn(5, 10, generator=g), -1)  # γ = 4
    q = torch.softmax(torch.randn(4, 10, generator=g), -1)
    drafts = [torch.multinomial(q, 1, generator=g).view(4) for _ in range(30)]
    global_state = torch.get_rng_state()
    first = [impl.rejection_sample(d, q, p, gen(7)) for d in drafts]
    assert torch.equal(torch.get_rng_state(),
                       global_state), "a seeded call drew from torch's global generator"
    assert [impl.rejection_sample(d, q, p, gen(7)) for d in drafts] == first
    runs = {tuple(tuple(impl.rejection_sample(d, q, p,
                                              gen(s))[0]) for d in drafts) for s in range(5)}
    assert len(runs) == 5, "different seeds gave the same tokens"


# ----------------------------------------------------------------------------- the tests
def test_ex12_1_residual_by_hand_and_in_batches(impl):
    check_residual_by_hand(impl)


@pytest.mark.parametrize("case", list(law_cases()))
def test_ex12_1_exact_law_is_p_in_float64(impl, case):
    check_exact_law(impl, case)


def test_ex12_1_no_residual_mass_falls_back_to_p(impl):
    check_residual_fallback(impl)


def test_ex12_2_one_step_law_chi2_with_a_draft_distribution(impl):
    check_chi2_with_draft_distribution(impl)


def test_ex12_2_one_step_law_chi2_with_a_deterministic_draft(impl):
    check_chi2_with_deterministic_draft(impl)


def test_ex12_2_accepted_prefix_then_a_token_from_the_residual_or_the_bonus_row(impl):
    check_call_structure(impl)


def test_ex12_2_bonus_token_when_every_draft_passes_and_a_step_without_drafts(impl):
    check_bonus_token(impl)


def test_ex12_2_one_hot_target_is_greedy_verification(impl):
    check_one_hot_p_is_greedy(impl)


def test_ex12_2_seeded_generator(impl):
    check_seeded(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _draw(weights: torch.Tensor, u: float) -> int:
    """The token where the running sum of the weights first passes u·Σw: a draw from
    normalize(weights) for u ~ U[0, 1). (Plain Python: on 16 numbers it is faster than any torch
    op.)"""
    w = weights.tolist()
    target, running = u * math.fsum(w), 0.0
    for i, x in enumerate(w):
        running += x
        if running > target:
            return i
    return max(i for i, x in enumerate(w) if x > 0)  # u·Σw rounded up to the last running sum


def _sampler(residual_rule="positive part", on_reject="residual", bonus_row=0):
    """A rejection sampler; the arguments put one bug each in a known place."""
    def residual_distribution(p, q):
        # wrong: |p − q|
        r = (p - q).clamp_min(0) if residual_rule == "positive part" else (p - q).abs()
        mass = r.sum(-1, keepdim=True)
        return torch.where(mass > 0, r / torch.where(mass > 0, mass, 1), p)

    def rejection_sample(draft_ids, q, p, generator=None):
        gamma = draft_ids.shape[0]
        if q is None:
            q = F.one_hot(draft_ids, p.shape[-1]).to(p.dtype)
        rows = torch.arange(gamma)
        # γ: accept x_i with min(1, ratio)
        ratio = (p[rows, draft_ids] / q[rows, draft_ids]).tolist()
        # γ coins, then one for the last draw
        u = torch.rand(gamma + 1, generator=generator, dtype=F64).tolist()
        drafts = draft_ids.tolist()
        for i in range(gamma):
            if not u[i] < ratio[i]:
                law = p[i] if on_reject == "p" else residual_distribution(p[i], q[i])  # wrong: p
                return drafts[:i] + [_draw(law, u[gamma])], i
        # wrong: bonus_row = 1 reads p[γ−1]
        return drafts + [_draw(p[gamma - bonus_row], u[gamma])], gamma

    return SimpleNamespace(residual_distribution=residual_distribution,
                           rejection_sample=rejection_sample)


WRONG = {
    "on reject resample from p": (_sampler(on_reject="p"), [check_chi2_with_draft_distribution,
                                                            check_chi2_with_deterministic_draft, check_call_structure]),
    "residual = |p - q|": (_sampler(residual_rule="abs"),
                           [lambda impl: check_exact_law(impl, "random"),
                            check_chi2_with_draft_distribution,
                            check_chi2_with_deterministic_draft]),
    "bonus token from p[γ-1]": (_sampler(bonus_row=1),
                                [check_bonus_token, check_one_hot_p_is_greedy]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex12_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex12_the_checks_pass_on_a_right_variant_built_the_same_way():
    """The mutants differ from this one in exactly one place, so their failures are that place's.
    (The χ² tests treat every position alike, so the bonus-row mutant passes them: that is what the
    certain-answer checks are for.)"""
    right = _sampler()
    check_residual_by_hand(right)
    for case in law_cases():
        check_exact_law(right, case)
    for check in (check_residual_fallback, check_chi2_with_draft_distribution,
                  check_chi2_with_deterministic_draft,
                  check_call_structure, check_bonus_token, check_one_hot_p_is_greedy, check_seeded):
        check(right)
