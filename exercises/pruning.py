"""Exercise 21: the Wanda mask and the 2:4 mask, by hand.

Your versions of nanoserve/sparsity/pruning.py's `wanda_mask` and `semi_structured_mask`, with the
same names and signatures. Taught in notebooks/18_pruning.ipynb, sections 2 ("Wanda: weights
times activations") and 4 ("2:4: the pattern sparse tensor cores run"). Check your work with

    make exercises EX=ex21        # or: .venv/bin/pytest tests/exercises -m ex21 --impl exercises

A weight W is [N, K]: N output rows, K inputs. A mask is a bool tensor of W's shape, True where
the weight is kept. Wanda scores weight (i, j) by |W_ij| · ‖X_j‖₂, the magnitude of the weight
times the norm of input j over the calibration tokens (x_norm [K]), and compares scores *within
each output row*: every row loses floor(sparsity · K) inputs, its smallest scores. 2:4 keeps, in
every group of 4 consecutive inputs of a row (columns 0-3, 4-7, ...), the 2 largest scores.
"""

from __future__ import annotations

import torch  # noqa: F401  (you will want it)

from nanoserve.errors import NanoserveError  # noqa: F401  (for the checks, if you add them)


# ----------------------------------------------------------------------------- exercise 21
def wanda_mask(W: torch.Tensor, x_norm: torch.Tensor, sparsity) -> torch.Tensor:
    """Wanda: the scores |W_ij|·‖X_j‖₂ compared within each output row (or each 2:4 group).
    W [N, K], x_norm [K], sparsity a fraction in [0, 1) or "2:4" → bool [N, K], True = kept."""
    raise NotImplementedError(
        "Exercise 21.1: score every weight by |W| times its input's norm, then in each row drop "
        "the floor(sparsity·K) smallest scores; for '2:4' hand the scores to semi_structured_mask "
        "(roughly 7 lines; see notebooks/18_pruning, section 2, and `make hint EX=ex21 N=1`)")


def semi_structured_mask(scores: torch.Tensor) -> torch.Tensor:
    """2:4: in every group of 4 consecutive inputs (columns) of a row, keep the 2 largest scores.
    scores [N, K], K a multiple of 4 → bool [N, K]."""
    raise NotImplementedError(
        "Exercise 21.2: view each row as K/4 groups of 4 consecutive columns and keep the top 2 "
        "of every group (roughly 5 lines; see notebooks/18_pruning, section 4, and "
        "`make hint EX=ex21 N=2`)")
