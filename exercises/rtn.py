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
        "Exercise 8.1: maxq = check_bits(bits); xmin = min(row min, 0), xmax = max(row max, 0); "
        "if sym, xmax = max(−xmin, xmax) and xmin = −xmax; rows with xmin == xmax == 0 get −1 and "
        "+1; scale = (xmax − xmin) / maxq; zero = (maxq + 1) // 2 if sym else round(−xmin / "
        "scale), as int32 (roughly 12 lines; see notebooks/05_rtn_gptq, section 2, 'The grid and "
        "round-to-nearest (RTN)')")


def round_to_codes(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   maxq: int) -> torch.Tensor:
    """Codes of w [rows, cols] on the grid of (scales, zeros) [rows], as floats holding integers."""
    raise NotImplementedError(
        "Exercise 8.2: round(w / scale) + zero, clamped to [0, maxq]; scales and zeros are per "
        "row, so broadcast them as [rows, 1], and add the zeros in w's dtype (roughly 1 line; see "
        "notebooks/05_rtn_gptq, section 2, 'The grid and round-to-nearest (RTN)')")


def quantize_rtn(w: torch.Tensor, bits: int = 4, group_size: int = 128,
                 sym: bool = True) -> QuantizedWeight:
    """Round each weight to the nearest point of its group's grid. w: [N, K] (nn.Linear layout).

    Returns a QuantizedWeight (this file's class) with codes [N, K] uint8, zeros [N, G] int32,
    scales [N, G], g_idx [K] int32 (= k // group_size), and bits, group_size, sym as given."""
    raise NotImplementedError(
        "Exercise 8.3: w = check_weight(w); gs = check_group_size(group_size, K); view w as [N·G, "
        "gs] (one group per row), take quant_params and round_to_codes of that view, reshape back "
        "to [N, K] and [N, G], and build QuantizedWeight(codes=..., zeros=..., scales=..., "
        "g_idx=..., bits=..., group_size=group_size, sym=sym) (roughly 10 lines; see "
        "notebooks/05_rtn_gptq, section 2, 'The grid and round-to-nearest (RTN)')")


class QuantizedWeight(_QuantizedWeight):
    """nanoserve's QuantizedWeight (fields codes, zeros, scales, g_idx, bits, group_size, sym) with
    your `dequantize`: W ≈ (codes − zeros[:, g_idx]) · scales[:, g_idx]."""

    __slots__ = ()

    def dequantize(self) -> torch.Tensor:
        """The weight the quantized layer computes with, [N, K], in the scales' dtype."""
        raise NotImplementedError(
            "Exercise 8.4: look up each column's group with g_idx (as a long index) in zeros and "
            "scales ([N, G] -> [N, K]); subtract the zeros from the codes in the scales' dtype "
            "and multiply; do not assume g_idx = k // group_size (act-order permutes it) (roughly "
            "3 lines; see notebooks/05_rtn_gptq, section 2, 'The grid and round-to-nearest "
            "(RTN)')")
