"""Exercise 18: one forward over a token tree — each node's position and what it may attend to.

Your versions of `tree_positions` and `tree_attention_mask` from nanoserve/spec/tree_sampler.py,
with the same names and signatures. A tree of n nodes is given by `parents`: parents[0] = −1 (node 0
is the root, the last token the target already has), and every other node i has a parent parents[i]
< i. Taught in notebooks/15_draft_heads.ipynb, section 6. Check your work with

    make exercises EX=ex18        # or: .venv/bin/pytest tests/exercises -m ex18 --impl exercises
"""

from __future__ import annotations

import torch


def tree_positions(parents: list[int], root_position: int) -> list[int]:
    """Each node's position in the sequence: the root's, plus its depth (siblings share a
    position)."""
    raise NotImplementedError(
        "Exercise 18.1: a node sits as deep in the text as it is deep in the tree (roughly 4 "
        "lines; see notebooks/15_draft_heads, section 6, 'A tree in one forward'; more: make hint "
        "EX=ex18 N=2)")


def tree_attention_mask(parents: list[int], prefix_len: int) -> torch.Tensor:
    """bool [n, prefix_len + n]: node i sees the whole prefix, its ancestors and itself — the keys
    its own path would hold if it were decoded as a chain (what one forward over the tree must
    reproduce per node)."""
    raise NotImplementedError(
        "Exercise 18.2: a node sees what its own path would have seen as a chain: the prefix, its "
        "ancestors and itself (roughly 8 lines; see notebooks/15_draft_heads, section 6, 'A tree "
        "in one forward'; more: make hint EX=ex18 N=2)")
