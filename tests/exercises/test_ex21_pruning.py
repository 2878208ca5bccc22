"""Exercise 21: the Wanda mask and the 2:4 mask (nanoserve/sparsity/pruning.py: wanda_mask,
semi_structured_mask).

Oracles: the definitions written out here with plain torch, one row (or one group) at a time —
Wanda keeps the top K − floor(s·K) of |W_ij|·‖X_j‖₂ in each output row; 2:4 keeps the top 2 of
each 4 consecutive inputs — and small cases worked by hand. Known-wrong variants (scores compared
per column instead of per row; |W| without the activation norm; 2:4 groups along the outputs)
must fail with a message that explains itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from explain import expect, expect_equal, explained_failure

REFERENCE = "nanoserve.sparsity.pruning"
EXERCISE = "pruning"
pytestmark = pytest.mark.ex21


def _layer(seed: int, n: int = 16, k: int = 32):
    """W [n, k] and input norms [k] that vary a lot (a few inputs 20× louder)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, k, generator=g)
    x_norm = torch.rand(k, generator=g) + 0.1
    x_norm[torch.randperm(k, generator=g)[:3]] *= 20
    return W, x_norm


def _ref_wanda(W, x_norm, sparsity):
    scores = W.abs() * x_norm[None, :]
    n, k = W.shape
    mask = torch.zeros(n, k, dtype=torch.bool)
    for row in range(n):
        mask[row, torch.topk(scores[row], k - int(k * sparsity)).indices] = True
    return mask


def _ref_two_four(scores):
    n, k = scores.shape
    mask = torch.zeros(n, k, dtype=torch.bool)
    for row in range(n):
        for start in range(0, k, 4):
            top = torch.topk(scores[row, start:start + 4], 2).indices
            mask[row, start + top] = True
    return mask


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_wanda_by_hand(impl):
    """Row 0: |W| says drop input 1, the activations say drop input 0 (its norm is 1/10)."""
    W = torch.tensor([[2.0, -1.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]])
    x_norm = torch.tensor([0.1, 1.0, 1.0, 1.0])
    got = impl.wanda_mask(W, x_norm, 0.25)
    want = torch.tensor([[False, True, True, True], [False, True, True, True]])
    expect_equal(got, want, "wanda_mask(W [[2, -1, 3, 4], [1, 1, 1, 1]], ‖X‖ [0.1, 1, 1, 1], "
                 "sparsity 0.25)", rows=("output row", "output rows"))


def check_wanda_against_definition(impl):
    for seed, sparsity in ((0, 0.25), (1, 0.5), (2, 0.7)):
        W, x_norm = _layer(seed)
        got = impl.wanda_mask(W, x_norm, sparsity)
        expect_equal(got, _ref_wanda(W, x_norm, sparsity),
                     f"wanda_mask(random W [16, 32], uneven ‖X‖, sparsity {sparsity}) vs the "
                     "top of |W|·‖X‖ row by row", rows=("output row", "output rows"))
        kept = got.sum(1)
        want = 32 - int(32 * sparsity)
        expect(bool((kept == want).all()), f"inputs kept per row at sparsity {sparsity}",
               f"{want} in every row", f"{sorted(set(kept.tolist()))}")


def check_two_four_by_hand(impl):
    scores = torch.tensor([[1.0, 5.0, 3.0, 2.0, 9.0, 0.0, 8.0, 7.0]])
    want = torch.tensor([[False, True, True, False, True, False, True, False]])
    expect_equal(impl.semi_structured_mask(scores), want,
                 "semi_structured_mask([[1, 5, 3, 2, 9, 0, 8, 7]])")


def check_two_four_against_definition(impl):
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(8, 64, generator=g)
    got = impl.semi_structured_mask(scores)
    expect_equal(got, _ref_two_four(scores), "semi_structured_mask(random scores [8, 64]) vs the "
                 "top 2 of each 4 consecutive inputs")
    per_group = got.reshape(8, 16, 4).sum(-1)
    expect(bool((per_group == 2).all()), "kept per group of 4 consecutive inputs", "2 everywhere",
           f"{sorted(set(per_group.flatten().tolist()))}")


def check_wanda_two_four(impl):
    W, x_norm = _layer(4)
    want = _ref_two_four(W.abs() * x_norm[None, :])
    expect_equal(impl.wanda_mask(W, x_norm, "2:4"), want,
                 "wanda_mask(random W [16, 32], uneven ‖X‖, '2:4') vs the top 2 of |W|·‖X‖ per "
                 "group of 4")


# ----------------------------------------------------------------------------- the tests
def test_ex21_1_wanda_by_hand(impl):
    check_wanda_by_hand(impl)


def test_ex21_1_wanda_equals_its_definition(impl):
    check_wanda_against_definition(impl)


def test_ex21_2_two_four_by_hand(impl):
    check_two_four_by_hand(impl)


def test_ex21_2_two_four_equals_its_definition(impl):
    check_two_four_against_definition(impl)


def test_ex21_2_wanda_two_four(impl):
    check_wanda_two_four(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _variant(per_column=False, use_norm=True, groups_along_rows=False):
    def semi_structured_mask(scores):
        if groups_along_rows:  # wrong: groups of 4 consecutive outputs
            return semi_structured_mask_right(scores.T.contiguous()).T
        return semi_structured_mask_right(scores)

    def semi_structured_mask_right(scores):
        n, k = scores.shape
        top = torch.topk(scores.reshape(n, k // 4, 4), 2, dim=-1).indices
        mask = torch.zeros(n, k // 4, 4, dtype=torch.bool).scatter_(-1, top, True)
        return mask.reshape(n, k)

    def wanda_mask(W, x_norm, sparsity):
        scores = W.abs() * x_norm[None, :] if use_norm else W.abs()  # wrong without the norm
        if sparsity == "2:4":
            return semi_structured_mask(scores)
        if per_column:  # wrong: each input column loses the same number of outputs
            scores = scores.T
        n, k = scores.shape
        order = torch.argsort(scores, dim=1)
        mask = torch.ones(n, k, dtype=torch.bool).scatter_(1, order[:, :int(k * sparsity)], False)
        return mask.T if per_column else mask

    return SimpleNamespace(wanda_mask=wanda_mask, semi_structured_mask=semi_structured_mask)


WRONG = {
    "scores compared per input column instead of per output row": (
        _variant(per_column=True), [check_wanda_by_hand, check_wanda_against_definition]),
    "magnitude alone, without the activation norm": (
        _variant(use_norm=False),
        [check_wanda_by_hand, check_wanda_against_definition, check_wanda_two_four]),
    "2:4 groups along the outputs (the wrong axis)": (
        _variant(groups_along_rows=True),
        [check_two_four_against_definition, check_wanda_two_four]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex21_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex21_the_checks_pass_on_a_right_variant_built_the_same_way():
    right = _variant()
    for check in (check_wanda_by_hand, check_wanda_against_definition, check_two_four_by_hand,
                  check_two_four_against_definition, check_wanda_two_four):
        check(right)
