"""Exercise 22: k-means codebooks for a weight matrix, one Lloyd iteration by hand.

Your versions of nanoserve/quant/clustering.py's `assign` and `update`, with the same names and
signatures. Taught in notebooks/19_weight_clustering.ipynb, sections 1 ("Lloyd's algorithm on one
layer") and 2 ("Sensitivity-weighted k-means"). Check your work with

    make exercises EX=ex22        # or: .venv/bin/pytest tests/exercises -m ex22 --impl exercises

Every output row i of a weight W [N, K] has its own M = 2^b centroids c[i, :] [N, M]. One
iteration of Lloyd's algorithm is

    assign:  codes[i, j] = argmin_m (W[i, j] − c[i, m])²        (the lowest m on a tie)
    update:  c[i, m] = Σ_{j: codes[i, j] = m} s_j W[i, j] / Σ_{j: codes[i, j] = m} s_j

with s_j = 1 for plain k-means (sensitivity None) and s_j ≥ 0, one per input column, for the
sensitivity-weighted variant. A centroid whose cluster is empty (no weight, or zero total
sensitivity) keeps the value it had.
"""

from __future__ import annotations

import torch  # noqa: F401  (you will want it)


# ----------------------------------------------------------------------------- exercise 22
def assign(w: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """The index of each weight's nearest centroid in its own row, the lowest on a tie:
    w [N, K], centroids [N, M] → uint8 [N, K]."""
    raise NotImplementedError(
        "Exercise 22.1: compare every weight with every centroid of its row — a [N, K, M] tensor "
        "of squared distances — and keep the position of the smallest (roughly 2 lines; see "
        "notebooks/19_weight_clustering, section 1, 'Lloyd's algorithm on one layer'; more: "
        "make hint EX=ex22 N=2)")


def update(w: torch.Tensor, codes: torch.Tensor, centroids: torch.Tensor,
           sensitivity: torch.Tensor | None = None) -> torch.Tensor:
    """Each centroid moved to the (sensitivity-weighted) mean of the weights assigned to it; an
    empty cluster keeps its centroid. w, codes [N, K]; centroids [N, M]; sensitivity [K] or None
    (all ones) → [N, M] in w's dtype."""
    raise NotImplementedError(
        "Exercise 22.2: per row, add up (sensitivity × weight) and sensitivity into one slot per "
        "centroid (scatter_add along the row, indexed by the codes); divide where the total is "
        "positive and keep the old centroid elsewhere. Do 22.1's plain mean first: sensitivity "
        "None means a 1 per column (roughly 5 lines; see notebooks/19_weight_clustering, "
        "sections 1 and 2, 'Lloyd's algorithm on one layer' and 'Sensitivity-weighted k-means'; "
        "more: make hint EX=ex22 N=2)")
