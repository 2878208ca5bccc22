"""Verifying a token *tree* of drafts: SpecInfer's multi-candidate rejection sampling, and greedy.

Medusa's heads, EAGLE and SpecInfer propose a tree rather than a chain: several candidates for the
next token, several for the one after each, and so on. Node 0 is the last token the target already
has; every other node i has a parent parents[i] < i and a token tokens[i]. The target scores every
node in one forward (tree attention: each node sees its ancestors and the prefix), giving p[i], its
law for the token after node i's path. Verification walks down from the root (the engine's tree
verification, spec_decode.py's `_accept_tree`, calls it):

    at node u, law r = p[u], children c_1..c_k in order:
        for each child c_j:   accept its token x_j with probability min(1, r(x_j) / q_j(x_j))
                              accepted: emit x_j, continue at c_j (r = p[c_j])
                              rejected: r = normalize(max(r − q_j, 0))     (the residual)
        no child accepted, or u is a leaf: emit a token drawn from r, stop

q_j is the law x_j was drawn from: the draft's distribution at u when the children were sampled from
it independently (SpecInfer), or one-hot on x_j when they were *chosen* (Medusa's top-k): then x_j
is accepted with probability r(x_j) and removed from r on rejection.

**Why the law is p[u].** Each candidate is one speculative step from law r with draft q_j, and given
the earlier rejections x_j is still distributed as q_j (drawn independently, or fixed): by the
chain's lemma (rejection_sampler.speculative_law), accepting x_j or falling through to a token from
the residual gives a token distributed as r. The fall-through is the next candidate's step, with the
residual as its r, and so on to the final draw: by induction the emitted token is distributed as
p[u]. Once x_j is accepted the walk continues at c_j, whose candidates were drawn given it, so the
next token follows p[c_j]: the target's law, token after token. tests/test_tree_sampler.py checks it
by χ² with mutants.

The forward over a tree needs each node to see its ancestors only: `tree_attention_mask` and
`tree_positions` (position = the root's + depth) are what an attention backend is given for that
(engine/model_runner.py: `tree_mask`). The engine's trees come from Medusa's heads:
`tree_from_choices` turns paths of top-k indices ("choices", as Medusa's) and each head's top-k
tokens into parents and tokens.
"""

from __future__ import annotations

import torch

from ..config import DEFAULT_TREE, check_tree_choices  # noqa: F401  (their home: the config)
from .rejection_sampler import residual_distribution


def tree_from_choices(choices: list[tuple[int, ...]],
                      top: list[list[int]]) -> tuple[list[int], list[int]]:
    """choices sorted by check_tree_choices; top[d] the (d+1)-th head's candidates, best first ->
    (parents, tokens) with node 0 the root (its token: −1, the caller's) and node i + 1 the path
    choices[i]."""
    index = {(): 0}
    parents, tokens = [-1], [-1]
    for c in choices:
        index[c] = len(parents)
        parents.append(index[c[:-1]])
        tokens.append(top[len(c) - 1][c[-1]])
    return parents, tokens


def children_of(parents: list[int]) -> list[list[int]]:
    """For each node, its children in index order. parents[0] is the root's (−1); parents[i] < i."""
    kids: list[list[int]] = [[] for _ in parents]
    for i, parent in enumerate(parents[1:], start=1):
        if not 0 <= parent < i:
            raise ValueError(f"node {i}'s parent must be an earlier node (0..{i - 1}), got "
                             f"{parent}")
        kids[parent].append(i)
    return kids


def tree_positions(parents: list[int], root_position: int) -> list[int]:
    """Each node's position in the sequence: the root's, plus its depth (siblings share a
    position)."""
    depth = [0] * len(parents)
    for i, parent in enumerate(parents[1:], start=1):
        depth[i] = depth[parent] + 1
    return [root_position + d for d in depth]


def ancestor_bits(parents: list[int]) -> list[int]:
    """Per node, the nodes it sees as bits: bit j set when node j is an ancestor of it or itself —
    one row of `tree_attention_mask` past the prefix, packed into an int (what the Triton kernel
    reads: `tree_bits`)."""
    bits: list[int] = []
    for i, parent in enumerate(parents):
        bits.append((1 << i) | (bits[parent] if parent >= 0 else 0))
    return bits


def tree_attention_mask(parents: list[int], prefix_len: int) -> torch.Tensor:
    """bool [n, prefix_len + n]: node i sees the whole prefix, its ancestors and itself — the keys
    its own path would hold if it were decoded as a chain (what one forward over the tree must
    reproduce per node)."""
    n = len(parents)
    children_of(parents)  # checks parents[i] < i
    mask = torch.zeros(n, prefix_len + n, dtype=torch.bool)
    mask[:, :prefix_len] = True
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, prefix_len + j] = True
            j = parents[j]
    return mask


def tree_mask(trees: list, num_new: list[int], context_lens: torch.Tensor, T: int,
              S: int) -> torch.Tensor:
    """bool [B, T, S]: which of the S gathered keys each new token sees. A chain row: its own
    context, causally (a padding query sees its row's last real token's); a tree row: the cached
    prefix, then its ancestors (tree_attention_mask) — never a sibling's branch."""
    mask = torch.zeros(len(num_new), T, S, dtype=torch.bool)
    for b, (parents, n, ctx) in enumerate(zip(trees, num_new, context_lens.tolist())):
        prefix = ctx - n
        if parents is None:
            # T, S
            seen = torch.arange(S)[None, :] <= (prefix + torch.arange(T).clamp(max=n - 1))[:, None]
            mask[b] = seen
        else:
            mask[b, :n, :prefix + n] = tree_attention_mask(parents, prefix)
            mask[b, n:] = mask[b, n - 1]
    return mask


def packed_ancestor_bits(trees: list, num_new: list[int]) -> torch.Tensor:
    """int64 [N]: each real token's ancestor bits (`ancestor_bits`), the rows' tokens packed one
    after another; a row that is a chain (None) gets -1 for each of its tokens (the kernel's
    causal mask)."""
    bits: list[int] = []
    for parents, n in zip(trees, num_new):
        if parents:
            bits += ancestor_bits(parents)
        else:
            bits += [-1] * n
    return torch.tensor(bits)


def tree_rejection_sample(parents: list[int], tokens: list[int], p: torch.Tensor,
                          q: list[torch.Tensor | None],
                          generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """parents, tokens [n] (the root's token unused); p [n, V] the target's probabilities at every
    node; q[u] the law node u's children were drawn from ([V]), or None when they were chosen
    (one-hot each). Returns (the emitted tokens: the accepted path's, then one more; the accepted
    nodes, root excluded)."""
    kids = children_of(parents)
    u, emitted, path = 0, [], []
    while True:
        r = p[u].double()  # V
        accepted = None
        for c in kids[u]:
            x = tokens[c]
            q_c = torch.zeros_like(r).index_fill_(0, torch.tensor([x]),
                                                  1.0) if q[u] is None else q[u].double()
            # q(x) = 0: never proposed
            ratio = 0.0 if q_c[x] <= 0 else min(1.0, (r[x] / q_c[x]).item())
            if torch.rand((), generator=generator, dtype=torch.float64).item() < ratio:
                accepted = c
                break
            r = residual_distribution(r, q_c)
        if accepted is None:
            emitted.append(int(torch.multinomial(r, 1, generator=generator)))
            return emitted, path
        emitted.append(tokens[accepted])
        path.append(accepted)
        u = accepted


def tree_greedy_verify(parents: list[int], tokens: list[int],
                       p_or_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Greedy: at each node the child whose token is the target's argmax, else that argmax, emitted,
    and stop. The tokens equal the target's own greedy ones, token for token."""
    kids = children_of(parents)
    u, emitted, path = 0, [], []
    while True:
        best = int(p_or_logits[u].argmax())
        emitted.append(best)
        match = next((c for c in kids[u] if tokens[c] == best), None)
        if match is None:
            return emitted, path
        path.append(match)
        u = match
