"""The CPU GEMM: linear layers through oneDNN instead of torch's default BLAS call.

On a CPU nearly all of a step's arithmetic is the linear layers and the LM head. `nn.Linear`
on CPU calls the BLAS library torch was built with (Intel's MKL in the PyPI wheels); on the
AMD EPYC this project is measured on, MKL's fp32 GEMM reaches ~180–210 GFLOP/s with 2 threads,
while oneDNN (also inside torch, the library behind its CPU convolutions) reaches ~430–470 on
the same shapes, and ~2.5× on the LM head (benchmarks/RESULTS.md, "Where the time goes"). vLLM's
CPU backend calls oneDNN for the same reason.

    OneDNNLinear        an nn.Linear (same parameters, same state dict) whose forward calls
                        oneDNN's fp32/bf16 matmul, through the op torch's own compiler uses
    use_onednn_linears  swaps a CPU model's plain nn.Linear layers for it, after checking once
                        that the op exists and agrees with F.linear; says why not otherwise

The math is the same fp32 (or bf16) GEMM with fp32 accumulation: results differ from MKL's
only in summation order, ~1e-6 (tests/test_onednn.py checks it against a float64 reference,
beside F.linear's own error). Autograd is not supported by the op, so a forward that needs
gradients takes the plain path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_DTYPES = (torch.float32, torch.bfloat16)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]ᵀ + bias [out] -> [..., out], by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(nn.Linear):
    """nn.Linear computed by oneDNN (built by `from_linear`, sharing the layer's parameters)."""

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> OneDNNLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = layer.in_features, layer.out_features
        new.weight, new.bias = layer.weight, layer.bias  # the same Parameters: tied weights stay tied
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)  # the op has no backward
        return onednn_linear(x, self.weight, self.bias)


def onednn_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot serve this model's linears, or None when it can."""
    if device.type != "cpu":
        return f"device {device.type} (oneDNN serves CPU models)"
    if dtype not in _DTYPES:
        return f"dtype {dtype} (oneDNN's CPU matmul here: float32, bfloat16)"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear op"
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((3, 40), (24, 40), (24,)))
    try:
        got = onednn_linear(x, w, b)
    except RuntimeError as e:
        return f"the oneDNN linear op failed: {e}".splitlines()[0]
    if not torch.allclose(got.float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2):
        return "the oneDNN linear op disagrees with F.linear"
    return None


def use_onednn_linears(model: nn.Module) -> str | None:
    """Swap every plain nn.Linear of `model` (not subclasses such as quantized layers) for a
    OneDNNLinear over the same parameters. Returns None when done, else why not (nothing changed)."""
    p = next(model.parameters())
    why = onednn_unavailable(p.device, p.dtype)
    if why is not None:
        return why
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype in _DTYPES:
                setattr(parent, name, OneDNNLinear.from_linear(child))
    return None
