"""The χ² helpers every sampler test relies on, against closed forms."""

import math

import pytest
import torch
from chi2 import chi2_pvalue, goodness_of_fit


def test_chi2_pvalue_matches_closed_forms():
    assert chi2_pvalue(10.0, 2) == pytest.approx(math.exp(-5.0), rel=1e-12)  # χ²(2) is Exp(1/2)
    assert chi2_pvalue(3.841459, 1) == pytest.approx(0.05, rel=1e-6)  # the 95 % quantile of χ²(1)
    # χ²(4): e^(-x/2)(1 + x/2)
    assert chi2_pvalue(7.0, 4) == pytest.approx(math.exp(-3.5) * 4.5, rel=1e-12)


def test_goodness_of_fit_exact_counts_impossible_draws_and_pooling():
    law = torch.tensor([0.5, 0.3, 0.2, 0.0])
    assert goodness_of_fit(torch.tensor([50, 30, 20, 0]), law)[2] == pytest.approx(1)
    assert goodness_of_fit(torch.tensor([50, 30, 19, 1]), law)[2] == 0.0  # a draw the law forbids
    # a cell expecting 4 draws (of 64) is merged into the smallest other one: 3 cells, 2 dof
    law = torch.tensor([0.5, 0.25, 0.1875, 0.0625])
    assert goodness_of_fit(torch.tensor([32, 16, 12, 4]), law)[:2] == (0.0, 2)
    # only the pooled sum counts
    assert goodness_of_fit(torch.tensor([32, 16, 16, 0]), law)[:2] == (0.0, 2)
