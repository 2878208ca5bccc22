"""The model's layers on the Triton path: modules whose forward is one kernel of nanoserve.kernels
where the torch code launches several (issue 43: fewer launches a decode step,
benchmarks/bench_launches.py). The engine swaps them in when it runs the triton attention backend
(ModelRunner, extension point "triton_layers"); their parameters, and so their checkpoints, are
the modules' own.

    TritonRMSNorm        layers.RMSNorm as one kernel (kernels/rms_norm.py): six launches → one
    use_triton_layers    swap them into a model, in place; returns how many were swapped
"""

from __future__ import annotations

import torch

from .layers import RMSNorm


class TritonRMSNorm(RMSNorm):
    """RMSNorm through `nanoserve.kernels.rms_norm` (the same conventions; statistics in float32,
    summed in another order: equal to RMSNorm within float32's rounding,
    tests/test_kernels_norm.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.rms_norm import rms_norm

        return rms_norm(x, self.weight, self.eps, self.unit_offset, self.scale_fp32)


def use_triton_layers(model: torch.nn.Module) -> int:
    """Swap every plain RMSNorm of `model` for its one-kernel form, in place (its class only: the
    weights stay where they are). Returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        if type(module) is RMSNorm:
            module.__class__ = TritonRMSNorm
            swapped += 1
    return swapped
