"""Exercise 18: one forward over a token tree (nanoserve/spec/tree_sampler.py: tree_positions,
tree_attention_mask).

The oracle is outside the functions under test: SDPA over the whole tree with the mask must give,
for every node, exactly what SDPA gives that node alone over the prefix and its own path as a chain
(the path found by walking `parents`, independently of the mask), and a position must be what the
node would have in that chain. Trees: a chain, a star, Medusa's full top-2 tree, and random trees.
Known-wrong variants at the end: a causal mask over node order (siblings see each other), a mask
without the prefix, one without the node itself, positions in node order instead of by depth, and
depth counted from 1.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from explain import expect, explained_failure
from testdata import tree_path

import nanoserve.spec.tree_sampler as reference

REFERENCE = "nanoserve.spec.tree_sampler"
EXERCISE = "tree_sampler"
pytestmark = pytest.mark.ex18


def _random_tree(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [-1] + [rng.randrange(i) for i in range(1, n)]


TREES = {"chain": [-1, 0, 1, 2, 3], "star": [-1, 0, 0, 0, 0],
         "medusa top-2": [-1, 0, 0, 1, 1, 2, 2],
         "random 12": _random_tree(12, 0), "random 20": _random_tree(20, 1)}


def check_positions(impl):
    for name, parents in TREES.items():
        got = list(impl.tree_positions(parents, 7))
        want = [7 + len(tree_path(parents, i)) - 1 for i in range(len(parents))]
        expect(got == want, f"tree_positions(the {name} tree {parents}, root_position=7)", want,
               got)


def check_mask(impl):
    torch.manual_seed(0)
    for name, parents in TREES.items():
        n, P, D = len(parents), 5, 8
        mask = impl.tree_attention_mask(parents, P)
        case = f"tree_attention_mask(the {name} tree {parents}, prefix_len=5)"
        expect(mask.dtype == torch.bool and tuple(mask.shape) == (n, P + n), case,
               f"a bool mask of shape {(n, P + n)}", (mask.dtype, tuple(mask.shape)))
        q, k, v = torch.randn(1, 2, n, D), torch.randn(1, 2, P + n, D), torch.randn(1, 2, P + n, D)
        tree = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        for i in range(n):
            keys = list(range(P)) + [P + j for j in tree_path(parents, i)]
            alone = F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, keys], v[:, :, keys])
            if not torch.allclose(tree[:, :, i:i + 1], alone, rtol=1e-5, atol=1e-6):
                raise AssertionError(
                    f"{case}: node {i} attends to other keys than its path's (the prefix is "
                    f"columns 0..4, node j column 5 + j): expected columns {keys}, got "
                    f"{mask[i].nonzero().flatten().tolist()}")
    root = impl.tree_attention_mask([-1], 0).tolist()
    expect(root == [[True]], "tree_attention_mask([-1], prefix_len=0)", [[True]], root)


def test_ex18_1_positions(impl):
    check_positions(impl)


def test_ex18_2_mask(impl):
    check_mask(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _causal(parents, prefix_len):
    n = len(parents)
    return torch.cat([torch.ones(n, prefix_len, dtype=torch.bool),
                      torch.ones(n, n, dtype=torch.bool).tril()], 1)


def _no_prefix(parents, prefix_len):
    mask = reference.tree_attention_mask(parents, prefix_len)
    mask[:, :prefix_len] = False
    return mask


def _no_self(parents, prefix_len):
    mask = reference.tree_attention_mask(parents, prefix_len)
    # the root still sees itself: the others would see only ancestors
    mask[1:, prefix_len:].fill_diagonal_(False)
    return mask


WRONG = {
    "a causal mask over node order": (SimpleNamespace(tree_attention_mask=_causal), check_mask),
    "the prefix left out": (SimpleNamespace(tree_attention_mask=_no_prefix), check_mask),
    "a node not seeing itself": (SimpleNamespace(tree_attention_mask=_no_self), check_mask),
    "positions in node order": (SimpleNamespace(tree_positions=lambda p,
                                                r: [r + i for i in range(len(p))]),
                                check_positions),
    "depth counted from 1": (SimpleNamespace(tree_positions=lambda p, r: [x + 1 for x in
                                                                          reference.tree_positions(p, r)]),
                             check_positions),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex18_known_wrong_variants_fail_and_say_why(name):
    wrong, check = WRONG[name]
    explained_failure(check, wrong)
