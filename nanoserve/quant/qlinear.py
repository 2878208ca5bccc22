"""Quantized linear layers: weights stored as GPTQ v1 tensors, activations in 16 or 32 bits.

`QuantLinear` replaces an `nn.Linear` (y = x·Wᵀ + b, W [N, K]) by the four tensors of the GPTQ
format (nanoserve/quant/packing.py): `qweight` int32 [K·bits/32, N], `qzeros` int32
[G, N·bits/32], `scales` [G, N], `g_idx` int32 [K]. The names are the buffers' names in GPTQ
checkpoints, so a layer loads from and saves to one without renaming.

- **W4A16** (bits = 4): on CUDA the forward is one fused kernel,
  `nanoserve.kernels.dequant_matmul` (codes become values in registers, W never exists in
  memory — what makes int4 decode faster than fp16). On CPU, W is dequantized in torch and
  multiplied with `F.linear` (the interpreter would be far too slow for a model).
- **W8A16** (bits = 8, usually per-channel: one group, group_size = K) and 2-bit: dequantize in
  torch on every device (the kernel is 4-bit only).

Dequantizing per call costs time, not memory: W lives only for the duration of the matmul.
`to_linear()` gives the equivalent float `nn.Linear` (for comparisons). Taught in
notebooks/07_int4_kernel.ipynb.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .packing import GPTQ_BITS, dequantize_gptq, pack_gptq


class QuantLinear(nn.Module):
    """y = x · Ŵᵀ + b with Ŵ [N, K] = (codes − zeros[g_idx]) · scales[g_idx], held packed."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool,
                 dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu"):
        super().__init__()
        if bits not in GPTQ_BITS:
            raise ValueError(f"bits={bits} is not supported by the GPTQ format; allowed: "
                             f"{GPTQ_BITS}")
        gs = in_features if group_size in (-1, None) else group_size
        if gs < 1 or in_features % (32 // bits):
            raise ValueError(f"in_features={in_features} must be a multiple of {32 // bits} for "
                             f"{bits}-bit packing")
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = gs
        G = -(-in_features // gs)  # groups along K
        kw = dict(device=device)
        self.register_buffer(
            "qweight", torch.zeros(in_features * bits // 32, out_features, dtype=torch.int32, **kw)
        )
        self.register_buffer("qzeros",
                             torch.zeros(G, -(-out_features * bits // 32), dtype=torch.int32, **kw))
        self.register_buffer("scales", torch.zeros(G, out_features, dtype=dtype, **kw))
        self.register_buffer("g_idx", (torch.arange(in_features, **kw) // gs).to(torch.int32))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, **kw) if bias else None)
        # g_idx == k // group_size (no act-order); None: not looked yet
        self._sorted_groups: bool | None = None

    def _load_from_state_dict(self, *args, **kwargs):
        self._sorted_groups = None  # a new g_idx: look again
        super()._load_from_state_dict(*args, **kwargs)

    def kernel_group_size(self) -> int | None:
        """group_size for the W4A16 kernel when g_idx is k // group_size (one scale row per tile),
        else None.

        Reading g_idx is a host sync, done once (at the first forward, before any CUDA graph is
        captured); during a capture, a layer not looked at yet takes the general act-order path."""
        if self._sorted_groups is None:
            if self.g_idx.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            groups = torch.arange(self.in_features, device=self.g_idx.device) // self.group_size
            self._sorted_groups = bool(torch.equal(self.g_idx.long(), groups))
        return self.group_size if self._sorted_groups else None

    @classmethod
    def from_quantized(cls, qw, bias: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.float16) -> QuantLinear:
        """From a quantizer's result (codes [N, K], zeros / scales [N, G], g_idx [K]; see
        rtn.QuantizedWeight)."""
        N, K = qw.codes.shape
        layer = cls(K, N, qw.bits, qw.group_size, bias is not None, dtype, qw.codes.device)
        packed = pack_gptq(qw.codes, qw.zeros, qw.scales, qw.g_idx, qw.bits)
        for name in ("qweight", "qzeros", "g_idx"):
            getattr(layer, name).copy_(packed[name])
        layer.scales.copy_(packed["scales"].to(dtype))
        if bias is not None:
            layer.bias.copy_(bias.to(dtype))
        return layer

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Ŵ [N, K] in `dtype` (default: the scales' dtype)."""
        # N, K fp32
        w = dequantize_gptq(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits)
        return w.to(dtype or self.scales.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.bits == 4:
            from ..kernels.dequant_matmul import dequant_matmul

            x2 = x.reshape(-1, self.in_features)  # M, K
            y = dequant_matmul(
                x2, self.qweight, self.qzeros, self.scales.to(x.dtype), self.g_idx, self.bits,
                group_size=self.kernel_group_size(),
            )  # M, N
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def to_linear(self) -> nn.Linear:
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.qweight.device, dtype=self.scales.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.dequantize())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, "
                f"act_order={bool((self.g_idx.diff() < 0).any())}")
