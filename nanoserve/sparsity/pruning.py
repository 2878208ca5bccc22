"""Pruning one linear layer: which weights to set to zero, and (SparseGPT) how to fix the rest.

Three ways to choose, from the cheapest to the most careful. W is [N, K] (N outputs, K inputs),
the calibration inputs x are [T, K], one token per row.

* **Magnitude.** Drop the weights with the smallest |W_ij|, compared over the whole matrix
  (unstructured) or within each group of 4 consecutive inputs of a row (2:4). Needs no data.
* **Wanda** (Sun et al. 2023, "pruning by weights and activations"). The score of a weight is

      S_ij = |W_ij| · ‖X_j‖₂          ‖X_j‖₂ = the norm of input j over the calibration tokens

  and weights are compared *within each output row* (each output loses the same number of
  inputs). An input that is large on every token makes all of its weights matter more; the
  outlier channels of trained LMs are exactly such inputs. No weight is changed, only masked.
* **SparseGPT** (Frantar & Alistarh 2023). GPTQ's machinery with "round to zero" in place of
  "round to the grid": columns are processed left to right, a pruned weight's error is pushed
  onto the columns not yet processed through the Cholesky factor U of H⁻¹ (H = 2XᵀX/T, damped),

      err = (w_j − ŵ_j) / U_jj,      W[:, F] −= err · U[j, F]

  and the mask is chosen block by block (`blocksize` columns at a time) from the weights as
  updated so far, by the OBS saliency w_j² / [H_F⁻¹]_jj = (w_j / U_jj)² (the papers write it
  w² / [H⁻¹]_jj² with H⁻¹ standing for its Cholesky factor). Unstructured: the
  smallest fraction of the block's scores over all its rows; 2:4: in each group of 4 columns, when
  the loop reaches it, the 2 smallest per row. The Hessian, its damping and the Cholesky inverse
  are gptq.py's (`GPTQ.add_batch`, `inverse_hessian_cholesky`), reused as they are.

Masks are boolean, True = kept, the shape of W. `prune_weight` is the one entry point over the
three methods; model.py runs it over every linear of a model. Taught in
notebooks/18_pruning.ipynb (exercise 21).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import NanoserveError
from ..quant.gptq import inverse_hessian_cholesky

METHODS = ("magnitude", "wanda", "sparsegpt")
SEMI_STRUCTURED = "2:4"
KEEP_PER_GROUP = 2   # the "2" of 2:4
GROUP = 4            # the "4" of 2:4: consecutive inputs of one output row


@dataclass
class SparsityConfig:
    """What `prune_model` does.

    sparsity: the fraction of each linear's weights set to zero, in [0, 1), or "2:4" (in every 4
    consecutive inputs of a row, 2 are kept: exactly 50 %, and the pattern sparse tensor cores
    run). Calibration (Wanda, SparseGPT): `nsamples` windows of `seqlen` tokens drawn with `seed`
    from a text (quant/model.py's `calibration_ids`, as GPTQ draws them).
    """

    method: str = "wanda"
    sparsity: float | str = 0.5
    nsamples: int = 32
    seqlen: int = 128
    seed: int = 0
    blocksize: int = 128   # SparseGPT: columns per lazy batch and per mask choice
    damp: float = 0.01     # SparseGPT: fraction of H's mean diagonal added to it (GPTQ percdamp)

    def __post_init__(self):
        if self.method not in METHODS:
            raise NanoserveError(f"method={self.method!r} is not a pruning method; allowed: "
                                 f"{', '.join(METHODS)}")
        check_sparsity(self.sparsity)
        for name in ("nsamples", "seqlen", "blocksize"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise NanoserveError(f"{name} must be a positive integer, got {value!r}")
        if self.seqlen < 2:
            raise NanoserveError(f"seqlen must be at least 2 tokens, got {self.seqlen!r}")
        if self.blocksize % GROUP:
            raise NanoserveError(f"blocksize must be a multiple of {GROUP} (so a 2:4 group never "
                                 f"straddles two blocks), got {self.blocksize!r}")
        if not 0 <= self.damp < 1:
            raise NanoserveError(f"damp must be in [0, 1) (a fraction of H's mean diagonal), got "
                                 f"{self.damp!r}")

    @property
    def pattern(self) -> str:
        """"2:4" or "unstructured"."""
        return SEMI_STRUCTURED if self.sparsity == SEMI_STRUCTURED else "unstructured"

    @property
    def fraction(self) -> float:
        """The fraction of weights pruned (0.5 for 2:4)."""
        if self.sparsity == SEMI_STRUCTURED:
            return KEEP_PER_GROUP / GROUP
        return float(self.sparsity)

    @property
    def needs_calibration(self) -> bool:
        return self.method != "magnitude"


def check_sparsity(sparsity) -> None:
    """A fraction in [0, 1) or the string "2:4"; anything else is refused by value."""
    if isinstance(sparsity, str):
        if sparsity != SEMI_STRUCTURED:
            raise NanoserveError(f"sparsity={sparsity!r} is not a pattern nanoserve prunes to; "
                                 f"allowed: a fraction in [0, 1) or {SEMI_STRUCTURED!r}")
        return
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)):
        raise NanoserveError(f"sparsity must be a fraction in [0, 1) or {SEMI_STRUCTURED!r}, got "
                             f"{sparsity!r}")
    if not 0 <= sparsity < 1:
        raise NanoserveError(f"sparsity={sparsity!r} is outside [0, 1) (the fraction of weights "
                             "set to zero); use 0.5 for half")


def _check_weight(W: torch.Tensor, sparsity) -> None:
    if W.dim() != 2:
        raise NanoserveError(f"a weight must be 2-D [N, K], got shape {tuple(W.shape)}")
    if sparsity == SEMI_STRUCTURED and W.shape[1] % GROUP:
        raise NanoserveError(f"2:4 needs the input width K to be a multiple of {GROUP}, got "
                             f"K={W.shape[1]}")


# ----------------------------------------------------------------------------- masks from scores
def smallest_mask(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """Keep all but the floor(fraction · numel) smallest scores, compared over the whole tensor."""
    n_pruned = int(scores.numel() * fraction)
    mask = torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
    order = torch.argsort(scores.flatten(), stable=True)
    mask[order[:n_pruned]] = False
    return mask.view(scores.shape)


def row_mask(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """Keep all but the floor(fraction · K) smallest scores of each row [N, K]."""
    n_pruned = int(scores.shape[1] * fraction)
    mask = torch.ones_like(scores, dtype=torch.bool)
    order = torch.argsort(scores, dim=1, stable=True)                        # N, K
    mask.scatter_(1, order[:, :n_pruned], False)
    return mask


def semi_structured_mask(scores: torch.Tensor) -> torch.Tensor:
    """2:4: in every group of 4 consecutive inputs (columns) of a row, keep the 2 largest scores."""
    n, k = scores.shape
    groups = scores.reshape(n, k // GROUP, GROUP)                            # N, K/4, 4
    keep = torch.topk(groups, KEEP_PER_GROUP, dim=-1).indices                # N, K/4, 2
    mask = torch.zeros_like(groups, dtype=torch.bool)
    mask.scatter_(-1, keep, True)
    return mask.reshape(n, k)


def mask_from_scores(scores: torch.Tensor, sparsity, per_row: bool) -> torch.Tensor:
    """The mask of one layer: 2:4 per group, else the smallest fraction per row or overall."""
    if sparsity == SEMI_STRUCTURED:
        return semi_structured_mask(scores)
    if per_row:
        return row_mask(scores, float(sparsity))
    return smallest_mask(scores, float(sparsity))


# ----------------------------------------------------------------------------- the three methods
def magnitude_mask(W: torch.Tensor, sparsity) -> torch.Tensor:
    """|W| compared over the whole matrix (unstructured) or per group of 4 inputs (2:4)."""
    _check_weight(W, sparsity)
    return mask_from_scores(W.abs(), sparsity, per_row=False)


def wanda_scores(W: torch.Tensor, x_norm: torch.Tensor) -> torch.Tensor:
    """S_ij = |W_ij| · ‖X_j‖₂; W [N, K], x_norm [K]."""
    if x_norm.shape != (W.shape[1],):
        raise NanoserveError(f"x_norm must hold one norm per input column, shape ({W.shape[1]},), "
                             f"got {tuple(x_norm.shape)}")
    return W.abs() * x_norm[None, :]                                         # N, K


def wanda_mask(W: torch.Tensor, x_norm: torch.Tensor, sparsity) -> torch.Tensor:
    """Wanda: the scores |W_ij|·‖X_j‖₂ compared within each output row (or each 2:4 group)."""
    _check_weight(W, sparsity)
    return mask_from_scores(wanda_scores(W, x_norm.to(W.dtype)), sparsity, per_row=True)


def column_norms(H: torch.Tensor, nsamples: int) -> torch.Tensor:
    """‖X_j‖₂ from GPTQ's running Hessian H = 2XᵀX/T of T = nsamples tokens: sqrt(T·H_jj / 2)."""
    return torch.sqrt(torch.clamp(torch.diag(H) * nsamples / 2, min=0))      # K


def sparsegpt_prune(W: torch.Tensor, H: torch.Tensor, sparsity, blocksize: int = 128,
                    percdamp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT of W [N, K] given its input Hessian H [K, K]: (Ŵ with zeros in place, mask).

    Computed in H's dtype (fp64 for exactness tests). Inputs that are always zero (H_jj = 0) get
    H_jj = 1 and their weights zeroed first, as in GPTQ: they never affect the output.
    """
    _check_weight(W, sparsity)
    check_sparsity(sparsity)
    n, k = W.shape
    if H.shape != (k, k):
        raise NanoserveError(f"H must be [K, K] = [{k}, {k}] for a weight with {k} input columns, "
                             f"got {tuple(H.shape)}")
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize % GROUP:
        raise NanoserveError(f"blocksize must be a positive multiple of {GROUP}, got "
                             f"{blocksize!r}")
    W = W.detach().to(H.dtype).clone()                                       # N, K
    H = H.clone()
    dead = torch.diag(H) == 0                                                # K
    H[dead, dead] = 1
    W[:, dead] = 0
    U = inverse_hessian_cholesky(H, percdamp)                                # K, K
    mask = torch.ones_like(W, dtype=torch.bool)                              # N, K
    for i1 in range(0, k, blocksize):
        i2 = min(i1 + blocksize, k)
        _prune_block(W, U, mask, i1, i2, sparsity)
    return W, mask


def _prune_block(W: torch.Tensor, U: torch.Tensor, mask: torch.Tensor, i1: int, i2: int,
                 sparsity) -> None:
    """Columns i1..i2 of W: choose their mask, zero them one at a time pushing each error right
    (within the block at once, past the block in one product at the end). W, mask: in place."""
    W1 = W[:, i1:i2].clone()                                                 # N, B
    Err1 = torch.zeros_like(W1)                                              # N, B
    U1 = U[i1:i2, i1:i2]                                                     # B, B
    d = torch.diag(U1)                                                       # B
    mask1 = mask[:, i1:i2]                                                   # N, B   a view
    if sparsity != SEMI_STRUCTURED:
        mask1.copy_(smallest_mask((W1 / d[None, :]) ** 2, float(sparsity)))
    for i in range(i2 - i1):
        if sparsity == SEMI_STRUCTURED and i % GROUP == 0:
            saliency = (W1[:, i:i + GROUP] / d[None, i:i + GROUP]) ** 2      # N, 4   updated W
            mask1[:, i:i + GROUP] = semi_structured_mask(saliency)
        w = W1[:, i]                                                         # N
        q = w * mask1[:, i]                                                  # N   pruned → 0
        err = (w - q) / U1[i, i]                                             # N
        W1[:, i:] -= err[:, None] * U1[i, i:][None, :]                       # N, B−i
        W1[:, i] = q
        Err1[:, i] = err
    W[:, i1:i2] = W1
    W[:, i2:] -= Err1 @ U[i1:i2, i2:]                                        # N, K−i2   lazy batch


def prune_weight(W: torch.Tensor, config: SparsityConfig, H: torch.Tensor | None = None,
                 nsamples: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer by `config.method`: (Ŵ in W's dtype, mask). H [K, K] and the token count behind
    it (GPTQ's running Hessian) are needed by Wanda (its diagonal) and SparseGPT (all of it)."""
    if config.method == "magnitude":
        mask = magnitude_mask(W, config.sparsity)
        return W * mask, mask
    if H is None or nsamples < 1:
        raise NanoserveError(f"method={config.method!r} needs calibration inputs: the layer's "
                             "Hessian H and the number of tokens behind it")
    if config.method == "wanda":
        mask = wanda_mask(W, column_norms(H, nsamples), config.sparsity)
        return W * mask, mask
    pruned, mask = sparsegpt_prune(W, H, config.sparsity, config.blocksize, config.damp)
    return pruned.to(W.dtype), mask


def is_two_four(W: torch.Tensor) -> torch.Tensor:
    """Per group of 4 consecutive inputs of each row: True where at most 2 entries are nonzero.
    W [N, K] with K a multiple of 4 → [N, K/4]."""
    n, k = W.shape
    nonzero = (W.reshape(n, k // GROUP, GROUP) != 0).sum(-1)                 # N, K/4
    return nonzero <= KEEP_PER_GROUP
