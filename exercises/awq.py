"""Exercise 10: AWQ's scale search: the loss of a scaled layer, the α grid search, and folding the
scales away.

Your versions of nanoserve/quant/awq.py's `scaled_loss`, `search_scales` and `fold_scales`, with the
same names and signatures. Taught in notebooks/06_awq.ipynb, sections 2 ("Why scaling a column
protects it"), 3 ("The α search") and 4 ("Folding the scales away"). Check your work with

    make exercises EX=ex10        # or: .venv/bin/pytest tests/exercises -m ex10 --impl exercises

Given (imported below, from nanoserve): `fake_quantize(w, bits, group_size, sym)`, RTN's Ŵ (exercise
8) in w's dtype; `activation_scale(x)`, mean |x| per input channel; `_inputs(x, linears)`, which
checks the group and returns x as fp32 [T, K]. Shapes: T tokens, K input channels, N output
features.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from nanoserve.errors import NanoserveError  # noqa: F401  (for bad arguments)
from nanoserve.quant.awq import _inputs, activation_scale  # noqa: F401
from nanoserve.quant.rtn import fake_quantize  # noqa: F401


# ----------------------------------------------------------------------------- exercise 10
def scaled_loss(linears: Sequence[nn.Linear], x: torch.Tensor, s: torch.Tensor, bits: int,
                group_size: int,
                sym: bool) -> float:
    """Σ ‖W X − Q(W·diag(s)) (X / s)‖² over the linears; x [T, K] (the product is taken as (W −
    Q(W·s)/s) X).

    The output error of every linear when its columns are scaled by s [K] before rounding and its
    inputs divided by s: W x = (W·diag(s)) (x / s) exactly, so only the rounding error remains. Use
    the weights in fp32 and return a Python float (accumulate in fp64; split long x into chunks of
    tokens if memory matters)."""
    raise NotImplementedError(
        "Exercise 10.1: what the layers' outputs lose on the real inputs once the weight, scaled "
        "up by s per input channel, is rounded and divided back (roughly 6 lines; see "
        "notebooks/06_awq, sections 2 and 3, 'The α search'; more: make hint EX=ex10 N=2)")


def search_scales(linears: Sequence[nn.Linear], x: torch.Tensor, bits: int = 4,
                  group_size: int = 128,
                  sym: bool = False,
                  n_grid: int = 20) -> tuple[torch.Tensor, float, list[float], list[float]]:
    """Grid search of α over {0, 1/n_grid, ..., (n_grid−1)/n_grid}. Returns (s, α, alphas, losses).

    For each α: s = mean|x|^α per input channel (clamped to ≥ 1e-4: a dead channel has mean 0), then
    normalised so that max(s)·min(s) = 1; loss = scaled_loss(...). The winner is the first α with
    the least loss; `losses` is the whole α curve. α = 0 gives s = 1 (plain RTN), so AWQ never does
    worse than RTN on x. n_grid must be a positive integer."""
    raise NotImplementedError(
        "Exercise 10.2: scales that grow with each channel's mean input magnitude to a power α, "
        "the α found by trying a grid and keeping the smallest loss (roughly 12 lines; see "
        "notebooks/06_awq, section 3, 'The α search'; more: make hint EX=ex10 N=2)")


@torch.no_grad()
def fold_scales(prev: nn.Module, linears: Sequence[nn.Linear], s: torch.Tensor) -> None:
    """Divide prev's outputs by s and multiply the linears' input columns by s, in place.

    prev: the op producing the linears' common input — a norm with a per-channel weight (RMSNorm,
    LayerNorm: weight and bias ÷ s) or an nn.Linear (rows of weight and bias ÷ s). Every consumer
    of prev's output must be in `linears`, or it would see x / s. Exact up to float rounding.
    Raise NanoserveError for a prev that is neither (e.g. a GELU) or for shapes that do not fit."""
    raise NotImplementedError(
        "Exercise 10.3: the op that produces the inputs divides them by s, the linears that read "
        "them multiply their columns by s, in place (roughly 15 lines; see notebooks/06_awq, "
        "section 4, 'Folding the scales away, and where it is possible'; more: make hint EX=ex10 "
        "N=2)")
