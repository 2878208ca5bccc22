"""Exercise 9: GPTQ's column loop with error feedback, first naive (OBS with an explicit inverse),
then fast.

Your versions of nanoserve/quant/gptq.py's `gptq_naive` and `gptq_quantize`, with the same names and
signatures. Taught in notebooks/05_rtn_gptq.ipynb, sections 4 ("Error feedback: from Optimal Brain
Surgeon to GPTQ's column loop") and 5 ("GPTQ's three tricks, and act-order"). Check your work with

    make exercises EX=ex09        # or: .venv/bin/pytest tests/exercises -m ex09 --impl exercises

Given (imported below, from nanoserve): the grid of exercise 8 (`quant_params`, `round_to_codes`),
input checks, `_prepare` (dead inputs zeroed; the processing order `perm`, by decreasing H_jj under
act-order) and `inverse_hessian_cholesky` (U upper triangular with UᵀU = (H + damp·I)⁻¹). Both
functions start the same way:

    W = check_weight(W).to(H.dtype); maxq = check_bits(bits); n, k = W.shape
    gs = check_group_size(group_size, k); _check_hessian(H, k, percdamp)
    W, H, perm = _prepare(W, H, act_order)
    W, H = W[:, perm], H[perm][:, perm]          # from here on, column j is the j-th one processed

and end the same way: the codes go back to the original column order (codes[:, argsort(perm)], as
uint8), and g_idx[c] of original column c is (its position in the processing order) // gs.
Shapes: N output rows, K input columns, G = K / gs groups per row.
"""

from __future__ import annotations

import torch  # noqa: F401  (you will want it)

from nanoserve.quant.gptq import _check_hessian, _prepare, inverse_hessian_cholesky  # noqa: F401
from nanoserve.quant.rtn import (  # noqa: F401
    QuantizedWeight,
    check_bits,
    check_group_size,
    check_weight,
    quant_params,
    round_to_codes,
)


# ----------------------------------------------------------------------------- exercise 9
def gptq_naive(W: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int = 128,
               sym: bool = True,
               percdamp: float = 0.01, act_order: bool = False) -> QuantizedWeight:
    """GPTQ of W [N, K] given the Hessian H [K, K] of its inputs, one column at a time (O(K³)).

    Hinv = inv(H + damp·I), damp = percdamp · mean(diag H), is H_F⁻¹ for F = all columns. For each
    column j (in processing order): on entering a group (j % gs == 0) its scale and zero come from
    quant_params of the group's columns *as updated so far*; round column j to codes; then
        err = (w_j − ŵ_j) / Hinv[j, j]                  (N,)
        W[:, j:] −= err · Hinv[j, j:]                    push the error onto the free columns
        Hinv −= Hinv[:, j] Hinv[j, :] / Hinv[j, j]       column j leaves the free set
    Returns a QuantizedWeight (codes in the original column order, scales and zeros [N, G] in
    group order, g_idx as described at the top of this file)."""
    raise NotImplementedError(
        "Exercise 9.1: quantize one column at a time and push its rounding error onto the columns "
        "not yet quantized, weighted by the inverse Hessian (roughly 25 lines; see "
        "notebooks/05_rtn_gptq, section 4, 'Error feedback: from Optimal Brain Surgeon to GPTQ's "
        "column loop'; more: make hint EX=ex09 N=2)")


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int = 128,
                  sym: bool = True,
                  blocksize: int = 128, percdamp: float = 0.01, act_order: bool = False,
                  static_groups: bool = False) -> QuantizedWeight:
    """GPTQ of a weight W [N, K] given its input Hessian H [K, K]; computed in H's dtype.

    The same result as gptq_naive (to float rounding), computed with GPTQ's tricks:
    1. U = inverse_hessian_cholesky(H, percdamp): row j of U is row j of the eliminated inverse
       divided by √[H_F⁻¹]_jj, so err = (w_j − ŵ_j) / U[j, j] and the update is err · U[j, j:].
    2. Lazy blocks of `blocksize` columns [i1, i2): inside a block, updates touch only the block's
       columns; keep each column's err, and at the block's end apply them all to the columns after
       it in one product, W[:, i2:] −= Err @ U[i1:i2, i2:].
    3. A group that starts inside a block and runs past its end needs its later columns up to date
       before its grid is chosen: add this block's pending errors to them first, so that the result
       does not depend on blocksize.
    static_groups: every group's grid fixed up front from the original (prepared) weights, in the
    original column order (group = original column // gs), and g_idx = k // gs even under
    act-order."""
    raise NotImplementedError(
        "Exercise 9.2: 9.1's result, with the inverses read off one Cholesky factor and the errors "
        "of a block of columns applied to the rest at once (roughly 40 lines; see "
        "notebooks/05_rtn_gptq, section 5, 'GPTQ's three tricks, and act-order'; more: make hint "
        "EX=ex09 N=2)")
