"""AWQ, activation-aware weight quantization (Lin et al. 2023): protect the weights that meet large
activations by scaling them up before rounding, and fold the inverse scale into the layer before.

**Why it works.** Some input channels of a linear layer carry much larger activations than the
rest (outlier channels), so the rounding errors of the weights in those columns matter most.
For any s > 0 per input channel, W x = (W·diag(s)) (x / s). Quantize W·diag(s) instead of W and
column k's share of the output error becomes (rounding error of s_k·w_k) · x_k / s_k. Scaling
one column up barely moves its group's step (the step is set by the group's largest weight,
usually in another column), so that column's error, divided by s_k on the way back, shrinks
by about s_k. Scale too many columns up and the group maxima, and steps, grow with them; the
search over α finds the balance (α = 0 is s = 1, plain RTN; larger α favours salient channels).
Nothing is stored per channel at inference: 1/s is folded into whatever produced x (the
RMSNorm / LayerNorm weight, or the rows of a preceding linear), s into the columns of W.

**The search** (`search_scales`), for a group of linears that read the same input x (q, k, v
after the attention norm; gate, up after the MLP norm; o after v when shapes allow):

    s(α) = mean|x|^α, normalised by sqrt(max(s)·min(s));   α ∈ {0, 0.05, ..., 0.95}
    loss(α) = Σ_linears ‖W X − Q(W·diag(s)) (X / s)‖²       over the calibration tokens

and the α with the least loss wins. α = 0 is s = 1, plain RTN, so AWQ never does worse than
RTN on the calibration set. `losses` is the α curve.

**Clipping** (`search_clip`). Then, per linear and per (row, group), the range of the scaled
weights is shrunk to r·max|w| for r ∈ {1.0, 0.95, ..., 0.55}, keeping the r that best preserves
that group's share of the output on (a sample of) the scaled inputs: losing a few extreme
weights can buy a finer grid for all the others. The reference code skips clipping for q and k
(attention scores are sensitive to it): pass `clip=False` for those groups.

Flow for one group: `result = awq_search(linears, x, ...)` (reads only), then
`apply_awq(prev, linears, result)` (folds the scales, clamps the weights: the fp model changes
only by the clipping), then `quantize_rtn(linear.weight, ...)` for each linear. The loss uses
the quantizer of rtn.py, so the grid searched is the grid stored. Taught in notebooks/06_awq.ipynb
(exercise 10).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import NanoserveError
from .rtn import check_bits, check_group_size, fake_quantize


@dataclass(slots=True)
class AWQResult:
    """What the search chose for one group of linears sharing an input."""

    # K      s: fold 1/s into the previous op, s into the linears
    scales: torch.Tensor
    alpha: float                          # the exponent that gave `scales`
    alphas: list[float]                   # the grid searched ...
    losses: list[float]                   # ... and the calibration loss at each α (the α curve)
    # per linear: N, G clip thresholds for W·s (None: no clipping)
    max_vals: list[torch.Tensor | None]
    group_size: int                       # the grouping max_vals refer to


def _inputs(x: torch.Tensor, linears: Sequence[nn.Linear]) -> torch.Tensor:
    if not linears:
        raise NanoserveError("AWQ needs at least one nn.Linear in the group")
    k = linears[0].in_features
    for lin in linears:
        if not isinstance(lin, nn.Linear) or lin.in_features != k:
            raise NanoserveError("a group's layers must be nn.Linear with the same in_features "
                                 f"({k}); got {type(lin).__name__} with "
                                 f"{getattr(lin, 'in_features', '?')}")
    if x.shape[-1] != k:
        raise NanoserveError(f"inputs must have the layers' {k} input features in the last dim, "
                             f"got {tuple(x.shape)}")
    return x.detach().reshape(-1, k).float()                                   # T, K


def activation_scale(x: torch.Tensor) -> torch.Tensor:
    """mean |x| per input channel: which channels are salient. x: [..., K] -> [K]."""
    return x.detach().abs().reshape(-1, x.shape[-1]).float().mean(0)


def scaled_loss(linears: Sequence[nn.Linear], x: torch.Tensor, s: torch.Tensor, bits: int,
                group_size: int,
                sym: bool) -> float:
    """Σ ‖W X − Q(W·diag(s)) (X / s)‖² over the linears; x [T, K] (the product is taken as (W −
    Q(W·s)/s) X)."""
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    for lin in linears:
        w = lin.weight.detach().float()                                          # N, K
        # N, K   effective weight
        w_hat = fake_quantize(w * s, bits, group_size, sym) / s
        # bounded memory: T·N outputs at once would not fit for a real model
        for chunk in x.split(8192):
            loss += (chunk @ (w - w_hat).T).pow(2).sum()                         # T', N -> scalar
    return loss.item()


def search_scales(linears: Sequence[nn.Linear], x: torch.Tensor, bits: int = 4,
                  group_size: int = 128,
                  sym: bool = False,
                  n_grid: int = 20) -> tuple[torch.Tensor, float, list[float], list[float]]:
    """Grid search of α over {0, 1/n_grid, ..., (n_grid−1)/n_grid}. Returns (s, α, alphas,
    losses)."""
    if isinstance(n_grid, bool) or not isinstance(n_grid, int) or n_grid < 1:
        raise NanoserveError("n_grid must be a positive integer (α grid size; 1 = only α = 0), "
                             f"got {n_grid!r}")
    x = _inputs(x, linears)                                                      # T, K
    x_mean = activation_scale(x)                                                 # K
    alphas, losses = [i / n_grid for i in range(n_grid)], []
    best = (float("inf"), None, None)
    for alpha in alphas:
        s = x_mean.pow(alpha).clamp(min=1e-4)                                    # K
        s = s / (s.max() * s.min()).sqrt()
        loss = scaled_loss(linears, x, s, bits, group_size, sym)
        losses.append(loss)
        if loss < best[0]:
            best = (loss, s, alpha)
    return best[1], best[2], alphas, losses


def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int = 4, group_size: int = 128,
                sym: bool = False,
                n_grid: int = 20, max_shrink: float = 0.5,
                n_sample_token: int = 512) -> torch.Tensor:
    """Per (row, group) of w [N, K], the clip threshold r·max|w| minimizing that group's output
    error.

    r runs over 1, 1 − 1/n_grid, ... down to 1 − (max_shrink·n_grid − 1)/n_grid (1.0 ... 0.55).
    x: [..., K], subsampled to about n_sample_token tokens. Returns max_val [N, G].
    """
    n, k = w.shape
    gs = check_group_size(group_size, k)
    x = x.detach().reshape(-1, k).float()
    x = x[:: max(1, x.shape[0] // n_sample_token)]                               # T, K
    xg = x.reshape(x.shape[0], k // gs, gs)                                      # T, G, gs
    ratios = [1 - i / n_grid for i in range(int(max_shrink * n_grid))]
    # rows are independent: 256 at a time keeps the [rows, G, T] outputs small
    return torch.cat([_clip_rows(rows, xg, ratios, bits, gs,
                                 sym) for rows in w.detach().float().split(256)])


def _clip_rows(w: torch.Tensor, xg: torch.Tensor, ratios: list[float], bits: int, gs: int,
               sym: bool) -> torch.Tensor:
    n, k = w.shape
    wg = w.reshape(n, k // gs, gs)                                               # N, G, gs
    # N, G, T   each group's share
    org_out = torch.einsum("tgc,ngc->ngt", xg, wg)
    org_max = wg.abs().amax(-1)                                                  # N, G
    best_max, min_err = org_max.clone(), torch.full_like(org_max, float("inf"))
    for r in ratios:
        max_val = org_max * r                                                    # N, G
        clipped = torch.clamp(wg, -max_val[..., None], max_val[..., None])       # N, G, gs
        q = fake_quantize(clipped.reshape(n, k), bits, gs, sym).reshape(n, k // gs, gs)
        err = (torch.einsum("tgc,ngc->ngt", xg, q) - org_out).pow(2).mean(-1)   # N, G
        better = err < min_err
        min_err[better], best_max[better] = err[better], max_val[better]
    return best_max


def awq_search(linears: Sequence[nn.Linear], x: torch.Tensor, bits: int = 4, group_size: int = 128,
               sym: bool = False, n_grid: int = 20, clip: bool = True) -> AWQResult:
    """Scale search, then (if clip) clip search on the scaled weights W·s with the scaled inputs
    X/s.

    linears: the layers that all read x [..., K]. Reads the weights, changes nothing.
    """
    check_bits(bits)
    x = _inputs(x, linears)                                                      # T, K
    check_group_size(group_size, x.shape[1])
    s, alpha, alphas, losses = search_scales(linears, x, bits, group_size, sym, n_grid)
    max_vals = [search_clip(lin.weight.detach().float() * s, x / s, bits, group_size,
                            sym) if clip else None
                for lin in linears]
    return AWQResult(scales=s, alpha=alpha, alphas=alphas, losses=losses, max_vals=max_vals,
                     group_size=group_size)


@torch.no_grad()
def fold_scales(prev: nn.Module, linears: Sequence[nn.Linear], s: torch.Tensor) -> None:
    """Divide prev's outputs by s and multiply the linears' input columns by s, in place.

    prev: the op producing the linears' common input — a norm with a per-channel weight (RMSNorm,
    LayerNorm: weight and bias ÷ s; Gemma's (1 + w) RMSNorm: 1 + w ÷ s) or an nn.Linear (rows of
    weight and bias ÷ s). Every consumer
    of prev's output must be in `linears`, or it would see x / s. Exact up to float rounding.
    """
    k = s.numel()
    for lin in linears:
        if not isinstance(lin, nn.Linear) or lin.in_features != k:
            raise NanoserveError(f"scales have {k} channels; every layer to scale must be an "
                                 f"nn.Linear with in_features {k}, got {type(lin).__name__} "
                                 f"{getattr(lin, 'in_features', '?')}")
    if isinstance(prev, nn.Linear):
        if prev.out_features != k:
            raise NanoserveError(f"the previous linear has {prev.out_features} outputs, the scales "
                                 f"{k} channels")
        # K, K_prev   rows ÷ s
        prev.weight.div_(s.to(prev.weight.dtype)[:, None])
    elif isinstance(getattr(prev, "weight", None), torch.Tensor) and prev.weight.shape == (k,):
        # scales by (1 + w): the new w' has 1 + w' = (1 + w) / s
        if getattr(prev, "unit_offset", False):
            prev.weight.copy_((1 + prev.weight) / s.to(prev.weight.dtype) - 1)  # K
        else:
            prev.weight.div_(s.to(prev.weight.dtype))                            # K
    else:
        raise NanoserveError(f"cannot fold scales into {type(prev).__name__}: need an nn.Linear "
                             f"with {k} outputs or a norm with a per-channel weight of shape "
                             f"({k},)")
    if getattr(prev, "bias", None) is not None:
        prev.bias.div_(s.to(prev.bias.dtype))
    for lin in linears:
        # N, K   columns × s
        lin.weight.mul_(s.to(lin.weight.dtype)[None, :])


@torch.no_grad()
def apply_clip(linear: nn.Linear, max_val: torch.Tensor, group_size: int) -> None:
    """Clamp each (row, group) of linear.weight to ±max_val [N, G], in place."""
    n, k = linear.weight.shape
    gs = check_group_size(group_size, k)
    w = linear.weight.view(n, k // gs, gs)                                       # N, G, gs
    m = max_val.to(w.dtype)[..., None]                                           # N, G, 1
    w.copy_(torch.clamp(w, -m, m))


def apply_awq(prev: nn.Module, linears: Sequence[nn.Linear], result: AWQResult) -> None:
    """Fold result.scales into prev and the linears, then clip the scaled weights (in place)."""
    fold_scales(prev, linears, result.scales)
    for lin, max_val in zip(linears, result.max_vals):
        if max_val is not None:
            apply_clip(lin, max_val, result.group_size)
