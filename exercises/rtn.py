"""Exercise 8: round-to-nearest (RTN) quantization: the grid, the codes, and back to floats.

Your versions of nanoserve/quant/rtn.py's `quant_params`, `round_to_codes`, `quantize_rtn` and
`QuantizedWeight.dequantize`, with the same names and signatures. Taught in
notebooks/05_rtn_gptq.ipynb, section 2 ("The grid and round-to-nearest (RTN)"). Check your work with

    make exercises EX=ex08        # or: .venv/bin/pytest tests/exercises -m ex08 --impl exercises

The convention (the one GPTQ / AutoGPTQ checkpoints store): maxq = 2^bits − 1, each group's range
widened to contain 0, then
    asymmetric: scale = (xmax − xmin) / maxq,              zero = round(−xmin / scale)
    symmetric:  amax = max(−xmin, xmax), scale = 2·amax / maxq,  zero = (maxq + 1) / 2
    an all-zero group uses xmin = −1, xmax = +1 (a scale of 0 would divide by zero);
    code = clamp(round(w / scale) + zero, 0, maxq),   ŵ = (code − zero) · scale.
Shapes: N output rows, K input columns, G groups per row, gs = group size.
"""

from __future__ import annotations

import torch  # noqa: F401  (you will want it)

from nanoserve.quant.rtn import QuantizedWeight as _QuantizedWeight
from nanoserve.quant.rtn import check_bits, check_group_size, check_weight  # noqa: F401  (validation, given)


# ----------------------------------------------------------------------------- exercise 8
def quant_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero point of each row of a [rows, cols] slice (one group per row).

    Returns (scales [rows] in w's dtype, zeros [rows] int32)."""
    raise NotImplementedError(
        "Exercise 8.1: an evenly spaced grid of 2^bits points per row that covers its values and "
        "holds 0 exactly; symmetric grids centred on 0 (roughly 12 lines; see "
        "notebooks/05_rtn_gptq, section 2, 'The grid and round-to-nearest (RTN)'; more: make "
        "hint EX=ex08 N=2)")


def round_to_codes(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   maxq: int) -> torch.Tensor:
    """Codes of w [rows, cols] on the grid of (scales, zeros) [rows], as floats holding integers."""
    raise NotImplementedError(
        "Exercise 8.2: each weight's nearest grid point, counted from the zero point, never off "
        "the grid (roughly 1 line; see notebooks/05_rtn_gptq, section 2, 'The grid and "
        "round-to-nearest (RTN)'; more: make hint EX=ex08 N=2)")


def quantize_rtn(w: torch.Tensor, bits: int = 4, group_size: int = 128,
                 sym: bool = True) -> QuantizedWeight:
    """Round each weight to the nearest point of its group's grid. w: [N, K] (nn.Linear layout).

    Returns a QuantizedWeight (this file's class) with codes [N, K] uint8, zeros [N, G] int32,
    scales [N, G], g_idx [K] int32 (= k // group_size), and bits, group_size, sym as given."""
    raise NotImplementedError(
        "Exercise 8.3: 8.1 and 8.2 on every group as if it were a row of its own (roughly 10 "
        "lines; see notebooks/05_rtn_gptq, section 2, 'The grid and round-to-nearest (RTN)'; "
        "more: make hint EX=ex08 N=2)")


class QuantizedWeight(_QuantizedWeight):
    """nanoserve's QuantizedWeight (fields codes, zeros, scales, g_idx, bits, group_size, sym) with
    your `dequantize`: W ≈ (codes − zeros[:, g_idx]) · scales[:, g_idx]."""

    __slots__ = ()

    def dequantize(self) -> torch.Tensor:
        """The weight the quantized layer computes with, [N, K], in the scales' dtype."""
        raise NotImplementedError(
            "Exercise 8.4: (code − zero point) × scale of each weight's own group, which is what "
            "g_idx says (roughly 3 lines; see notebooks/05_rtn_gptq, section 2, 'The grid and "
            "round-to-nearest (RTN)'; more: make hint EX=ex08 N=2)")
