"""Exercise 19: tensor parallelism — a column-parallel and a row-parallel linear layer, with the
all-reduce.

Your versions of `ColumnParallelLinear` and `RowParallelLinear` from
nanoserve/parallel/tensor_parallel.py, with the same names and signatures. Each is built from the
whole nn.Linear and `index`, the output rows (column parallel) or input columns (row parallel) of
its weight [O, I] that this rank keeps. The tests run your classes in 2 gloo processes
(torch.distributed is initialized for you: `dist.all_reduce(t)` sums t over the ranks, in place).
Taught in notebooks/16_tensor_parallel.ipynb, section 1. Check your work with

    make exercises EX=ex19        # or: .venv/bin/pytest tests/exercises -m ex19 --impl exercises
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (what your row-parallel forward needs)
from torch import nn


class ColumnParallelLinear(nn.Module):
    """Rows `index` of a linear's weight [O, I] (and bias): this rank's share of its outputs."""

    def __init__(self, layer: nn.Linear, index: torch.Tensor):
        super().__init__()
        raise NotImplementedError(
            "Exercise 19.1: this rank keeps the weight rows and bias entries of its own outputs "
            "(roughly 5 lines; see notebooks/16_tensor_parallel, section 1, 'Splitting by "
            "columns'; more: make hint EX=ex19 N=2)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "Exercise 19.1: its own outputs from the whole input, with no communication (roughly 1 "
            "line; see notebooks/16_tensor_parallel, section 1, 'Splitting by columns'; more: make "
            "hint EX=ex19 N=2)")


class RowParallelLinear(nn.Module):
    """Columns `index` of a linear's weight: a partial product of this rank's inputs, summed over
    ranks."""

    def __init__(self, layer: nn.Linear, index: torch.Tensor):
        super().__init__()
        raise NotImplementedError(
            "Exercise 19.2: this rank keeps the weight columns of its own inputs, and the bias "
            "whole (roughly 5 lines; see notebooks/16_tensor_parallel, section 1, 'Splitting by "
            "rows'; more: make hint EX=ex19 N=2)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "Exercise 19.2: a partial sum of every output, summed over the ranks, then the bias "
            "once (roughly 4 lines; see notebooks/16_tensor_parallel, section 1, 'Splitting by "
            "rows'; more: make hint EX=ex19 N=2)")
