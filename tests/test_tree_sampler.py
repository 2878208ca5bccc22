"""Tree verification keeps the target's law (nanoserve/spec/tree_sampler.py), checked from outside.

The target and the draft are Markov chains over V = 4 tokens (tables P and Q: the law of the next
token given the last), so every 3-token continuation has an exact probability P[s, a]·P[a, b]·P[b,
c]. A generation step builds a two-level tree from the last token (2 candidates, each with 2 of its
own: drawn from Q, or chosen as Q's top 2), verifies it with the target's laws at every node, and
keeps going until 3 tokens are out. χ² over the 64 cells; mutants (no residual between candidates; a
residual ∝ |r − q|) must fail. Greedy verification must give the target's argmax chain.
"""

from __future__ import annotations

import pytest
import torch
from chi2 import goodness_of_fit

from nanoserve.spec import tree_sampler
from nanoserve.spec.tree_sampler import children_of, tree_greedy_verify, tree_rejection_sample

V, START, LENGTH = 4, 0, 3


def _chains(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(2 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)  # V, V   target
    # V, V   a different draft
    Q = torch.softmax(2 * torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    return P, Q


def _tree(last: int, Q: torch.Tensor, sampled: bool, g: torch.Generator):
    """Root (the last token), 2 children, 2 grandchildren under each: (parents, tokens, q per
    node)."""
    def pick(law):
        return torch.multinomial(law, 2, replacement=True, generator=g).tolist() if sampled else \
            law.topk(2).indices.tolist()

    parents, tokens = [-1], [last]
    for a in pick(Q[last]):
        parents.append(0)
        tokens.append(a)
        child = len(tokens) - 1
        for b in pick(Q[a]):
            parents.append(child)
            tokens.append(b)
    q = [Q[t] if sampled else None for t in tokens]
    return parents, tokens, q


def _generate(P, Q, sampled: bool, n: int, seed: int) -> torch.Tensor:
    """Counts [V^LENGTH] of the first LENGTH tokens after START over n generations."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V ** LENGTH)
    for _ in range(n):
        out = []
        while len(out) < LENGTH:
            parents, tokens, q = _tree(out[-1] if out else START, Q, sampled, g)
            # n, V   the target's law after each node (a Markov chain: given its token)
            p = P[tokens]
            emitted, _ = tree_rejection_sample(parents, tokens, p, q, g)
            out += emitted
        a, b, c = out[:LENGTH]
        counts[(a * V + b) * V + c] += 1
    return counts


def _law(P) -> torch.Tensor:
    return (P[START][:, None, None] * P[:, :, None] * P[None, :, :]).reshape(-1)  # V^3


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled candidates", "top-2 candidates"])
def test_the_law_of_three_tokens_is_the_targets(sampled):
    P, Q = _chains()
    counts = _generate(P, Q, sampled, n=6000, seed=1)
    chi2, df, pv = goodness_of_fit(counts, _law(P))
    print(f"\n[tree] {'sampled' if sampled else 'top-2'}: χ² = {chi2:.1f}, dof {df}, p = {pv:.3f}")
    assert pv > 0.01


MUTANTS = {
    "no residual": lambda r, q: r,  # a rejected candidate's mass stays in the law of the next
    "residual ∝ |r − q|": lambda r, q: (r - q).abs() / (r - q).abs().sum(),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_mutants_fail(monkeypatch, mutant):
    P, Q = _chains()
    monkeypatch.setattr(tree_sampler, "residual_distribution", MUTANTS[mutant])
    counts = _generate(P, Q, True, n=6000, seed=1)
    chi2, _, pv = goodness_of_fit(counts, _law(P))
    print(f"\n[tree] mutant {mutant}: χ² = {chi2:.1f}, p = {pv:.1e}")
    assert pv < 1e-4


def test_greedy_walks_the_targets_argmax_chain():
    P, Q = _chains(3)
    g = torch.Generator().manual_seed(0)
    out, last = [], START
    while len(out) < 12:
        parents, tokens, _ = _tree(last, Q, False, g)
        emitted, path = tree_greedy_verify(parents, tokens, P[tokens].log())
        assert len(emitted) == len(path) + 1
        out += emitted
        last = out[-1]
    want, t = [], START
    for _ in range(len(out)):
        t = int(P[t].argmax())
        want.append(t)
    assert out == want


def test_children_and_bad_parents():
    assert children_of([-1, 0, 0, 1, 1, 2]) == [[1, 2], [3, 4], [5], [], [], []]
    with pytest.raises(ValueError, match="node 2's parent must be an earlier node"):
        children_of([-1, 0, 2])


def test_tree_attention_over_one_forward_equals_each_path_alone():
    """Scoring a tree in one attention call with `tree_attention_mask` gives every node the output
    it would get as the last token of its own path (prefix, ancestors, itself), computed alone by
    SDPA. Control: the causal mask a chain would use lets siblings see each other and changes the
    outputs."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from nanoserve.spec.tree_sampler import tree_attention_mask, tree_positions

    parents, prefix = [-1, 0, 0, 1, 1, 2, 5], 5
    assert tree_positions(parents, 9) == [9, 10, 10, 11, 11, 11, 12]
    g = torch.Generator().manual_seed(0)
    n, d = len(parents), 16
    q = torch.randn(n, d, generator=g, dtype=torch.float64)  # the tree's queries
    # prefix + tree keys
    k, v = (torch.randn(prefix + n, d, generator=g, dtype=torch.float64) for _ in range(2))
    mask = tree_attention_mask(parents, prefix)
    together = sdpa(q[None], k[None], v[None], attn_mask=mask[None])[0]  # n, d
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.insert(0, prefix + j)
            j = parents[j]
        keys = list(range(prefix)) + path
        alone = sdpa(q[i][None, None], k[keys][None], v[keys][None])[0, 0]  # d
        assert torch.allclose(together[i], alone, atol=1e-12)
    chain = torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix)
    wrong = sdpa(q[None], k[None], v[None], attn_mask=chain[None])[0]
    assert not torch.allclose(wrong, together, atol=1e-6)
