"""GPTQ (Frantar et al. 2022): quantize one linear layer column by column, pushing each column's
rounding error onto the columns not yet quantized, weighted by how the layer's inputs correlate.

**The objective.** For a layer y = W x and calibration inputs X [K, n], find a quantized Ŵ that
minimizes ‖WX − ŴX‖². Rows of W are independent and share the Hessian of this loss,

    H = 2 X Xᵀ / n                                                   [K, K]

(the code keeps tokens as rows, x [T, K], so H = 2·xᵀx / T; `GPTQ.add_batch` keeps it as a
running average over calibration tokens). RTN rounds every
weight on its own; GPTQ rounds input column j and then corrects the columns F not yet rounded
so that the layer's output moves as little as possible (Optimal Brain Surgeon, per row):

    err = (w_j − ŵ_j) / [H_F⁻¹]_jj,      W[:, F] −= err · H_F⁻¹[j, F]

and continues with H_F⁻¹ with row and column j eliminated. `gptq_naive` does exactly this,
O(K³), as the reference the fast version is tested against.

**The three tricks that make it fast** (`gptq_quantize`):
1. *Cholesky.* Row j of the upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU) is H_F⁻¹[j, F] /
   sqrt([H_F⁻¹]_jj) for F = {j, j+1, ...}: all the eliminated inverses at once, from one
   factorisation, and numerically stable. With err = (w_j − ŵ_j) / U_jj the update is
   err · U[j, F].
2. *Damping.* H gets percdamp (1 %) of its mean diagonal added to the diagonal, so the
   factorisation exists even with few or correlated samples. Inputs that are always zero
   ("dead", H_jj = 0) get H_jj = 1 and their weights set to 0: they never affect the output.
3. *Lazy batches.* Columns are processed in blocks of `blocksize`; inside a block each column's
   update touches only the block's columns, and the columns after the block receive the whole
   block's errors in one matrix product at its end. The same result up to float rounding, with
   far fewer passes over W.

**Groups.** With group-wise quantization, a group's scale and zero are chosen when the loop
enters the group, from the weights *as updated so far* (the columns of the group past the current
block are brought up to date first, so the result does not depend on `blocksize` — up to float
rounding, which can only decide exact ties: a symmetric grid puts −amax exactly halfway between
codes 0 and 1, so there either code may come out, at equal error; the reference code uses the
stale values there, which matters when a block edge falls inside a group).
`static_groups=True` instead fixes every group's grid up front from the original weights (RTN's
grid), which is what llmcompressor does (its weight observer runs before GPTQ); with that flag the
two give the same Ŵ for the same W and H (benchmarks/RESULTS.md, "GPTQ against llmcompressor").
Neither grid is better in general: GPTQ's updates can carry a weight past its group's original
range (a static grid then clips it and feeds the clipping error on), or widen the range (a grid
chosen late then has coarser steps).

**act-order** (`desc_act` in checkpoint configs): process columns by decreasing H_jj, the
inputs with the most energy first, while many columns are left to absorb their error. Groups are
then formed along the processing order, so `g_idx[k]` (stored in the original column order, like
the codes) is no longer k // group_size. With `static_groups` the groups stay k // group_size, so
a kernel reads the scales in order (llmcompressor's `actorder="static"`, its default).

Per-layer API: `GPTQ(weight)`, `add_batch(x)` for each calibration batch (use `capture_inputs`
to collect a module's inputs with forward hooks), `quantize(...)` → `QuantizedWeight`. The model-
level loop (layer by layer, each calibrated on the outputs of the already-quantized ones) is
the caller's. Taught in notebooks/05_rtn_gptq.ipynb (exercise 9).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import NanoserveError
from .rtn import (
    QuantizedWeight,
    check_bits,
    check_group_size,
    check_weight,
    quant_params,
    round_to_codes,
)


class GPTQ:
    """One linear layer's calibration state: its weight and the Hessian H = 2XXᵀ/n of its inputs.

    H is accumulated in `dtype` (fp32 by default, as in the reference code; fp64 for exactness
    tests) and the weight is quantized in that dtype. `weight` is held by reference and read
    when `quantize` runs.
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32):
        check_weight(weight)
        self.weight = weight.detach()                                         # N, K
        k = self.weight.shape[1]
        self.H = torch.zeros(k, k, dtype=dtype, device=self.weight.device)    # K, K
        self.nsamples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """x: [..., K], inputs of the layer; every leading index is one calibration token."""
        k = self.H.shape[0]
        if x.shape[-1] != k:
            raise NanoserveError(f"inputs must have the layer's {k} input features in the last "
                                 f"dim, got shape {tuple(x.shape)}")
        x = x.detach().reshape(-1, k).to(self.H.dtype)                        # T, K
        t = x.shape[0]
        # running average: H_n = (n_old / n) H_old + 2/n · Σ x xᵀ over the new tokens
        self.H *= self.nsamples / (self.nsamples + t)
        self.nsamples += t
        x = math.sqrt(2 / self.nsamples) * x
        self.H += x.T @ x                                                     # K, K

    def quantize(self, bits: int = 4, group_size: int = 128, sym: bool = True, blocksize: int = 128,
                 percdamp: float = 0.01, act_order: bool = False,
                 static_groups: bool = False) -> QuantizedWeight:
        if self.nsamples == 0:
            raise NanoserveError("GPTQ has no calibration inputs: call add_batch(x) with the "
                                 "layer's inputs first")
        return gptq_quantize(
            self.weight, self.H, bits, group_size, sym, blocksize, percdamp, act_order,
            static_groups,
        )


@contextmanager
def capture_inputs(modules: Mapping[str, nn.Module],
                   fn: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Inside the with-block, every forward of modules[name] first calls fn(name, its input).

    e.g. `with capture_inputs(linears, lambda name, x: gptq[name].add_batch(x)): block(hidden)`.
    The hooks are removed on exit, even on error.
    """
    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: fn(name, args[0].detach()))
               for name, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _check_hessian(H: torch.Tensor, k: int, percdamp: float) -> None:
    if H.shape != (k, k):
        raise NanoserveError(f"H must be [K, K] = [{k}, {k}] for a weight with {k} input columns, "
                             f"got {tuple(H.shape)}")
    if not torch.isfinite(H).all():
        raise NanoserveError("H has non-finite entries: check the calibration inputs for inf/nan")
    if not 0 <= percdamp < 1:
        raise NanoserveError("percdamp must be in [0, 1) (a fraction of H's mean diagonal), got "
                             f"{percdamp!r}")


def _prepare(W: torch.Tensor, H: torch.Tensor, act_order: bool):
    """Dead inputs zeroed, and the processing order: perm (decreasing H_jj under act-order)."""
    W, H = W.clone(), H.clone()
    dead = torch.diag(H) == 0                                                 # K
    H[dead, dead] = 1
    W[:, dead] = 0
    k = W.shape[1]
    perm = torch.argsort(torch.diag(H), descending=True,
                         stable=True) if act_order else torch.arange(k)
    return W, H, perm.to(W.device)


def inverse_hessian_cholesky(H: torch.Tensor, percdamp: float = 0.01) -> torch.Tensor:
    """U, upper triangular, with UᵀU = (H + damp·I)⁻¹, damp = percdamp · mean(diag H)."""
    k = H.shape[0]
    damp = percdamp * torch.mean(torch.diag(H))
    H = H + damp * torch.eye(k, dtype=H.dtype, device=H.device)              # K, K
    L, info = torch.linalg.cholesky_ex(H)
    if info.item() != 0:
        raise NanoserveError(f"the damped Hessian is not positive definite (percdamp={percdamp}); "
                             "raise percdamp or calibrate on more tokens")
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)      # K, K


def _finish(Q, scales, zeros, perm, group_size, gs, bits, sym, static_groups) -> QuantizedWeight:
    """Codes back to the original column order; g_idx of each original column."""
    k = Q.shape[1]
    invperm = torch.argsort(perm)
    if static_groups:
        g_idx = torch.arange(k, device=Q.device) // gs
    else:
        # group = position in order // gs
        g_idx = (torch.arange(k, device=Q.device) // gs)[invperm]
    return QuantizedWeight(codes=Q[:, invperm].to(torch.uint8), zeros=zeros, scales=scales,
                           g_idx=g_idx.to(torch.int32), bits=bits, group_size=group_size, sym=sym)


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int = 128,
                  sym: bool = True,
                  blocksize: int = 128, percdamp: float = 0.01, act_order: bool = False,
                  static_groups: bool = False) -> QuantizedWeight:
    """GPTQ of a weight W [N, K] given its input Hessian H [K, K]; computed in H's dtype."""
    W = check_weight(W).to(H.dtype)
    maxq = check_bits(bits)
    n, k = W.shape
    gs = check_group_size(group_size, k)
    _check_hessian(H, k, percdamp)
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize < 1:
        raise NanoserveError("blocksize must be a positive integer (columns per lazy batch), got "
                             f"{blocksize!r}")

    W, H, perm = _prepare(W, H, act_order)
    if static_groups:  # every group's grid from the original weights, in the original column order
        s, z = quant_params(W.reshape(n * (k // gs), gs), bits, sym)
        static_scales, static_zeros = s.reshape(n, -1), z.reshape(n, -1)      # N, G
    W, H = W[:, perm], H[perm][:, perm]
    U = inverse_hessian_cholesky(H, percdamp)                                 # K, K
    # original column of position j
    order = perm.tolist()
    # N, K codes, in processing order
    Q = torch.zeros_like(W)
    scales, zeros = [], []

    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        W1 = W[:, i1:i2].clone()                                              # N, B
        Err1 = torch.zeros_like(W1)                                           # N, B
        U1 = U[i1:i2, i1:i2]                                                  # B, B
        for i in range(i2 - i1):
            j = i1 + i
            if static_groups:
                g = order[j] // gs
                scale, zero = static_scales[:, g], static_zeros[:, g]
            elif j % gs == 0:
                cols = W1[:, i:i + gs]                                        # N, ≤gs   up to date
                # the group runs past this block: apply the block's pending errors to it
                if j + gs > i2:
                    rest = W[:, i2:j + gs] - Err1[:, :i] @ U[i1:j, i2:j + gs]
                    cols = torch.cat([cols, rest], dim=1)                     # N, gs
                scale, zero = quant_params(cols, bits, sym)                   # N
                scales.append(scale)
                zeros.append(zero)
            w = W1[:, i]                                                      # N
            q = round_to_codes(w[:, None], scale, zero, maxq)[:, 0]           # N
            Q[:, j] = q
            err = (w - (q - zero.to(w.dtype)) * scale) / U1[i, i]             # N
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]                    # N, B−i
            Err1[:, i] = err
        # N, K−i2   the lazy batch update
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]

    if static_groups:
        scales, zeros = static_scales, static_zeros
    else:
        scales, zeros = torch.stack(scales, 1), torch.stack(zeros, 1)         # N, G
    return _finish(Q, scales, zeros, perm, group_size, gs, bits, sym, static_groups)


def gptq_naive(W: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int = 128,
               sym: bool = True,
               percdamp: float = 0.01, act_order: bool = False) -> QuantizedWeight:
    """The reference: one column at a time, with the explicit inverse H_F⁻¹ updated by elimination.

    O(K³) time and no Cholesky, no blocks: the OBS update as written in the paper (eqs. 2-3),
    for testing `gptq_quantize` on small layers.
    """
    W = check_weight(W).to(H.dtype)
    maxq = check_bits(bits)
    n, k = W.shape
    gs = check_group_size(group_size, k)
    _check_hessian(H, k, percdamp)
    W, H, perm = _prepare(W, H, act_order)
    W, H = W[:, perm], H[perm][:, perm]
    damp = percdamp * torch.mean(torch.diag(H))
    # K, K = H_F⁻¹, F = all
    Hinv = torch.linalg.inv(H + damp * torch.eye(k, dtype=H.dtype, device=H.device))
    Q = torch.zeros_like(W)
    scales, zeros = [], []
    for j in range(k):
        if j % gs == 0:
            scale, zero = quant_params(W[:, j:j + gs], bits, sym)             # N
            scales.append(scale)
            zeros.append(zero)
        Q[:, j] = round_to_codes(W[:, j:j + 1], scale, zero, maxq)[:, 0]
        d = Hinv[j, j]
        err = (W[:, j] - (Q[:, j] - zero.to(W.dtype)) * scale) / d            # N
        W[:, j:] -= err[:, None] * Hinv[j, j:][None, :]                       # N, K−j   OBS update
        # K, K   eliminate column j
        Hinv -= Hinv[:, j:j + 1] @ Hinv[j:j + 1, :] / d
    return _finish(
        Q, torch.stack(scales, 1), torch.stack(zeros, 1), perm, group_size, gs, bits, sym, False
    )
