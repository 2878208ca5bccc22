"""Pearson's χ² goodness-of-fit, for every statistical test of a sampler (tests and exercise tests).

One copy, imported by name (`from chi2 import goodness_of_fit`): pytest puts tests/ on sys.path when
it loads tests/conftest.py, for tests/exercises too. Its own check is test_chi2_helpers.py.
"""

from __future__ import annotations

import math

import torch


def chi2_pvalue(chi2: float, df: int) -> float:
    """Survival function of χ²(df): the regularised upper incomplete gamma Q(df/2, chi2/2)."""
    if math.isinf(chi2):
        return 0.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


def goodness_of_fit(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, int, float]:
    """Pearson χ² of counts [C] against law [C] -> (χ², dof, p-value).

    A draw in a cell of probability 0 is an outright failure (p = 0). Cells expecting fewer than 5
    draws are pooled into one (added to the smallest other cell if the pool itself expects fewer
    than 5), so the χ² approximation holds."""
    counts, law = counts.double(), law.double()
    if counts[law == 0].sum() > 0:
        return math.inf, 0, 0.0
    expected = counts.sum() * law
    small = (expected < 5) & (law > 0)
    obs, exp = counts[expected >= 5].tolist(), expected[expected >= 5].tolist()
    if small.any():
        pool_o, pool_e = float(counts[small].sum()), float(expected[small].sum())
        if pool_e >= 5 or not exp:
            obs, exp = obs + [pool_o], exp + [pool_e]
        else:
            i = min(range(len(exp)), key=exp.__getitem__)
            obs[i], exp[i] = obs[i] + pool_o, exp[i] + pool_e
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(exp) - 1
    assert df >= 1, "a goodness-of-fit test needs at least two cells"
    return chi2, df, chi2_pvalue(chi2, df)
