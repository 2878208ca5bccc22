"""Exercise 22: one Lloyd iteration of per-row k-means, plain and sensitivity-weighted
(nanoserve/quant/clustering.py: assign, update).

Oracles: answers worked out by hand on small rows (ties, an empty cluster, zero sensitivity), and
numpy written here from the definitions (nearest centroid by a loop over centroids; the weighted
mean by boolean masks per cluster) on random rows, compared exactly (codes) or to 1e-12 (float64
centroids). Known-wrong variants that must fail: the weighted update taking the plain mean, an
empty cluster's centroid set to 0, and the nearest centroid taken across rows (row 0's codebook
for every row).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from explain import expect, expect_close, expect_equal, explained_failure

REFERENCE = "nanoserve.quant.clustering"
EXERCISE = "clustering"
pytestmark = pytest.mark.ex22


def _random(seed: int, n: int = 6, k: int = 40, m: int = 8):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)                          # N, K
    centroids = torch.sort(torch.randn(n, m, generator=g, dtype=torch.float64), 1).values
    centroids[:, -1] = 10.0  # far from every weight: an empty cluster in every row
    sensitivity = torch.rand(k, generator=g, dtype=torch.float64) ** 3 * 100        # K
    return w, centroids, sensitivity


def _numpy_assign(w, c) -> np.ndarray:
    best = np.zeros(w.shape, dtype=np.int64)
    best_d = np.full(w.shape, np.inf)
    for m in range(c.shape[1]):
        d = (w - c[:, m:m + 1]) ** 2
        closer = d < best_d  # strict: the lowest index keeps a tie
        best[closer] = m
        best_d[closer] = d[closer]
    return best


def _numpy_update(w, codes, c, s) -> np.ndarray:
    out = c.copy()
    for i in range(w.shape[0]):
        for m in range(c.shape[1]):
            members = codes[i] == m
            if s[members].sum() > 0:
                out[i, m] = (s[members] * w[i, members]).sum() / s[members].sum()
    return out


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_assign_by_hand(impl):
    w = torch.tensor([[0.0, 0.9, 1.0, 2.6, -5.0], [0.0, 0.9, 1.0, 2.6, -5.0]])
    centroids = torch.tensor([[0.0, 2.0, 3.0], [1.0, -5.0, 0.5]])
    # row 0: 1.0 is halfway between 0 and 2 (the lowest index wins); row 1 has its own centroids
    want = torch.tensor([[0, 0, 0, 2, 0], [2, 0, 0, 0, 1]], dtype=torch.uint8)
    got = impl.assign(w, centroids)
    expect_equal(got, want, "assign(rows [0, 0.9, 1, 2.6, −5], centroids [0, 2, 3] and "
                 "[1, −5, 0.5])", rows=("row", "rows"))


def check_assign_against_numpy(impl):
    w, c, _ = _random(0)
    want = torch.from_numpy(_numpy_assign(w.numpy(), c.numpy())).to(torch.uint8)
    expect_equal(impl.assign(w, c), want, "assign(6 random rows of 40, 8 centroids each)")


def check_update_by_hand(impl):
    w = torch.tensor([[0.0, 0.2, 5.0, 5.2]], dtype=torch.float64)
    codes = torch.tensor([[0, 0, 2, 2]], dtype=torch.uint8)
    centroids = torch.tensor([[0.0, 2.5, 5.0, 9.0]], dtype=torch.float64)
    want = torch.tensor([[0.1, 2.5, 5.1, 9.0]], dtype=torch.float64)
    got = impl.update(w, codes, centroids)
    expect_close(got, want, "update(row [0, 0.2, 5, 5.2], codes [0, 0, 2, 2], centroids "
                 "[0, 2.5, 5, 9]): clusters 1 and 3 are empty and keep 2.5 and 9", atol=1e-12)


def check_update_against_numpy(impl):
    w, c, _ = _random(1)
    codes = torch.from_numpy(_numpy_assign(w.numpy(), c.numpy())).to(torch.uint8)
    want = _numpy_update(w.numpy(), codes.long().numpy(), c.numpy(), np.ones(w.shape[1]))
    expect_close(impl.update(w, codes, c), torch.from_numpy(want),
                 "update(6 random rows, 8 centroids, the last far away: empty)", atol=1e-12,
                 dims="row, centroid")


def check_weighted_update_by_hand(impl):
    w = torch.tensor([[1.0, 3.0, 10.0, 20.0]], dtype=torch.float64)
    codes = torch.tensor([[0, 0, 1, 1]], dtype=torch.uint8)
    centroids = torch.tensor([[0.0, 0.0, 7.0, 8.0]], dtype=torch.float64)
    s = torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    # cluster 0: (3·1 + 1·3) / 4 = 1.5; cluster 1: total sensitivity 0, keeps 0; 2, 3 empty
    want = torch.tensor([[1.5, 0.0, 7.0, 8.0]], dtype=torch.float64)
    got = impl.update(w, codes, centroids, s)
    expect_close(got, want, "update(row [1, 3, 10, 20], codes [0, 0, 1, 1], sensitivity "
                 "[3, 1, 0, 0])", atol=1e-12)


def check_weighted_update_against_numpy(impl):
    w, c, s = _random(2)
    codes = torch.from_numpy(_numpy_assign(w.numpy(), c.numpy())).to(torch.uint8)
    want = _numpy_update(w.numpy(), codes.long().numpy(), c.numpy(), s.numpy())
    got = impl.update(w, codes, c, s)
    expect(isinstance(got, torch.Tensor) and got.dtype == torch.float64,
           "update(float64 rows): the centroids' dtype", "float64", getattr(got, "dtype", got))
    expect_close(got, torch.from_numpy(want), "update(6 random rows, sensitivity s³·100 per "
                 "column)", atol=1e-12, dims="row, centroid")


# ----------------------------------------------------------------------------- the tests
def test_ex22_1_assign_by_hand(impl):
    check_assign_by_hand(impl)


def test_ex22_1_assign_equals_numpy(impl):
    check_assign_against_numpy(impl)


def test_ex22_1_update_by_hand(impl):
    check_update_by_hand(impl)


def test_ex22_1_update_equals_numpy(impl):
    check_update_against_numpy(impl)


def test_ex22_2_weighted_update_by_hand(impl):
    check_weighted_update_by_hand(impl)


def test_ex22_2_weighted_update_equals_numpy(impl):
    check_weighted_update_against_numpy(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _lloyd(plain_mean=False, empty_to_zero=False, first_row_codebook=False):
    def assign(w, centroids):
        if first_row_codebook:  # wrong: every row compared with row 0's centroids
            centroids = centroids[:1].expand_as(centroids)
        return ((w[:, :, None] - centroids[:, None, :]) ** 2).argmin(2).to(torch.uint8)

    def update(w, codes, centroids, sensitivity=None):
        if sensitivity is None or plain_mean:  # plain_mean, wrong: the sensitivity dropped
            sensitivity = torch.ones(w.shape[1], dtype=w.dtype)
        s = sensitivity.to(w.dtype).expand_as(w)
        idx = codes.long()
        sums = torch.zeros_like(centroids).scatter_add_(1, idx, s * w)
        mass = torch.zeros_like(centroids).scatter_add_(1, idx, s)
        keep = torch.zeros_like(centroids) if empty_to_zero else centroids  # wrong: 0
        return torch.where(mass > 0, sums / mass.clamp_min(1e-300), keep)

    return SimpleNamespace(assign=assign, update=update)


WEIGHTED_CHECKS = [check_weighted_update_by_hand, check_weighted_update_against_numpy]
WRONG = {
    "the weighted update taking the plain mean": (_lloyd(plain_mean=True), WEIGHTED_CHECKS),
    "an empty cluster's centroid set to 0": (
        _lloyd(empty_to_zero=True),
        [check_update_by_hand, check_update_against_numpy] + WEIGHTED_CHECKS),
    "every row assigned with row 0's centroids": (
        _lloyd(first_row_codebook=True), [check_assign_by_hand, check_assign_against_numpy]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex22_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex22_the_checks_pass_on_a_right_variant_built_the_same_way():
    right = _lloyd()
    for check in (check_assign_by_hand, check_assign_against_numpy, check_update_by_hand,
                  check_update_against_numpy, check_weighted_update_by_hand,
                  check_weighted_update_against_numpy):
        check(right)
