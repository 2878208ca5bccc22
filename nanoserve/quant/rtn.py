"""Round-to-nearest (RTN): the baseline quantizer, and the grid that GPTQ and AWQ reuse.

A b-bit quantizer stores each weight as an integer *code* q in [0, maxq], maxq = 2^b − 1, and
reconstructs it as

    ŵ = (q − zero) · scale,        q = clamp(round(w / scale) + zero, 0, maxq)

with one (scale, zero) pair per *group*: per output row for int8 ("per-channel", one group
spanning all K inputs), per row and per `group_size` consecutive input columns for int4/int3
(group-wise; 128 is the usual size). Smaller groups follow the weights more closely at the
cost of more scales. `zero` is an integer, so that w = 0 is represented exactly.

**The grid** (the convention of GPTQ's reference code and AutoGPTQ, so that the GPTQ v1 /
AutoAWQ checkpoint formats in packing.py can store our scales and zeros as they are). For the
values x of one group, with the range widened to contain 0 (xmin = min(x, 0), xmax = max(x, 0)):

- asymmetric: scale = (xmax − xmin) / maxq,  zero = round(−xmin / scale)  ∈ [0, maxq];
- symmetric:  amax = max(|xmin|, xmax), scale = 2·amax / maxq, zero = (maxq + 1) / 2
  (8 for int4, 128 for int8). The grid is [−zero, maxq − zero]·scale, one step longer on the
  negative side: +amax rounds to code maxq, an error of scale/2.
- a group of zeros gets xmin = −1, xmax = +1 so the scale is never 0.

Either way each weight moves by at most scale / 2. (AutoGPTQ's symmetric case differs from ours
only for a group with no negative value, where it uses xmax / maxq and clamps the top half of
the range; we use amax for every group.)

Codes are stored unpacked here, one uint8 per weight in nn.Linear layout [N, K] (out × in);
packing.py packs them 8 to an int32. `g_idx[k]` names the group of input column k: k // group_size
for RTN, a permuted grouping for GPTQ with act-order. Taught in notebooks/05_rtn_gptq.ipynb
(exercise 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import NanoserveError

MIN_BITS, MAX_BITS = 2, 8


@dataclass(slots=True)
class QuantizedWeight:
    """A quantized [N, K] weight: W ≈ (codes − zeros[:, g_idx]) · scales[:, g_idx]."""

    codes: torch.Tensor   # N, K   uint8 in [0, 2^bits − 1]
    zeros: torch.Tensor   # N, G   int32 zero points
    scales: torch.Tensor  # N, G   float (the computation dtype: fp32, or fp64 for fp64 input)
    g_idx: torch.Tensor   # K      int32, group of each input column
    bits: int
    group_size: int       # −1 (or K) = one group per row
    sym: bool

    def __post_init__(self):
        n, k = self.codes.shape
        g = self.scales.shape[1]
        if self.zeros.shape != (n, g) or self.scales.shape != (n, g) or self.g_idx.shape != (k,):
            raise NanoserveError("inconsistent QuantizedWeight shapes: codes "
                                 f"{tuple(self.codes.shape)}, zeros {tuple(self.zeros.shape)}, "
                                 f"scales {tuple(self.scales.shape)}, g_idx "
                                 f"{tuple(self.g_idx.shape)}; need codes [N, K], zeros and scales "
                                 "[N, G], g_idx [K]")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The weight the quantized layer computes with, [N, K], in the scales' dtype."""
        g = self.g_idx.long()                                         # K
        zeros = self.zeros.to(self.scales.dtype)[:, g]                # N, K
        return (self.codes.to(self.scales.dtype) - zeros) * self.scales[:, g]


def check_bits(bits: int) -> int:
    """bits must be an int in 2..8; returns maxq = 2^bits − 1."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise NanoserveError(f"bits must be an integer from {MIN_BITS} to {MAX_BITS} (8 = int8, 4 "
                             f"= int4, 3 = int3), got {bits!r}")
    return 2**bits - 1


def check_group_size(group_size: int, k: int) -> int:
    """−1 (or K) = per-channel; otherwise a positive divisor of K. Returns the effective size."""
    if group_size == -1:
        return k
    if isinstance(group_size, bool) or not isinstance(group_size,
                                                      int) or group_size <= 0 or k % group_size:
        raise NanoserveError("group_size must be -1 (one group per row) or a positive divisor of "
                             f"the weight's {k} input columns (e.g. 32, 64, 128), got "
                             f"{group_size!r}")
    return group_size


def check_weight(w: torch.Tensor) -> torch.Tensor:
    """A finite, floating, 2-D [N, K] weight, returned in fp32 (fp64 stays fp64)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise NanoserveError("weight must be a 2-D tensor [out_features, in_features] (nn.Linear "
                             f"layout), got {shape}")
    if not w.is_floating_point():
        raise NanoserveError(f"weight must be a floating-point tensor, got dtype {w.dtype}")
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).nonzero()[0].tolist()
        raise NanoserveError(f"weight must be finite, found {w[bad[0], bad[1]].item()} at "
                             f"[{bad[0]}, {bad[1]}]")
    # fp16/bf16 would round w / scale coarsely; compute in fp32 and let the packer cast the scales
    return w.detach() if w.dtype == torch.float64 else w.detach().float()


def quant_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero point of each row of a [rows, cols] slice (one group per row)."""
    maxq = check_bits(bits)
    zero = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
    xmin = torch.minimum(w.min(1).values, zero)                       # rows
    xmax = torch.maximum(w.max(1).values, zero)                       # rows
    if sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    dead = (xmin == 0) & (xmax == 0)
    xmin[dead], xmax[dead] = -1.0, 1.0
    scales = (xmax - xmin) / maxq                                     # rows
    if sym:
        zeros = torch.full_like(scales, (maxq + 1) // 2)
    else:
        zeros = torch.round(-xmin / scales)
    return scales, zeros.to(torch.int32)


def round_to_codes(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   maxq: int) -> torch.Tensor:
    """Codes of w [rows, cols] on the grid of (scales, zeros) [rows], as floats holding integers."""
    return torch.clamp(torch.round(w / scales[:, None]) + zeros[:, None].to(w.dtype), 0, maxq)


def quantize_rtn(w: torch.Tensor, bits: int = 4, group_size: int = 128,
                 sym: bool = True) -> QuantizedWeight:
    """Round each weight to the nearest point of its group's grid. w: [N, K] (nn.Linear layout)."""
    w = check_weight(w)
    maxq = check_bits(bits)
    n, k = w.shape
    gs = check_group_size(group_size, k)
    groups = w.reshape(n * (k // gs), gs)                             # N·G, gs
    scales, zeros = quant_params(groups, bits, sym)                   # N·G
    codes = round_to_codes(groups, scales, zeros, maxq)               # N·G, gs
    g_idx = torch.arange(k, dtype=torch.int32, device=w.device) // gs
    return QuantizedWeight(codes=codes.reshape(n, k).to(torch.uint8), zeros=zeros.reshape(n, -1),
                           scales=scales.reshape(n, -1), g_idx=g_idx, bits=bits,
                           group_size=group_size, sym=sym)


def fake_quantize(w: torch.Tensor, bits: int = 4, group_size: int = 128,
                  sym: bool = True) -> torch.Tensor:
    """Ŵ = dequantize(quantize_rtn(w)), in w's dtype: the error RTN makes, as a float weight."""
    return quantize_rtn(w, bits, group_size, sym).dequantize().to(w.dtype)
