"""The attention backends that read the KV pool in place: Triton's kernels on CUDA, a C decode
kernel on the CPU. kv/cache.py resolves a backend's name and binds its view through this module
(the extension point "attention_backends"); the torch backend is the core's own.

    VIEWS                  backend name -> its CacheView class
    in_place_problem       why the device's in-place backend cannot serve a model, or None
"""

from __future__ import annotations

import torch

from .cpu_backend import CpuCacheView
from .triton_backend import TritonCacheView

VIEWS = {"triton": TritonCacheView, "cpu": CpuCacheView}


def in_place_problem(cuda: bool, head_dim: int, dtype: torch.dtype, device) -> str | None:
    """Why the device's in-place backend cannot serve this head_dim and dtype, or None."""
    if cuda:
        from ..kernels import triton_attention_supported  # reads no tensor, imports no Triton

        return triton_attention_supported(head_dim, dtype, device)
    if dtype != torch.float32:
        return f"the C decode kernel computes in float32, and the model is {dtype}"
    # builds the kernel once, or says why not
    from ..kernels.cpu_paged_attention import cpu_kernel_problem

    return cpu_kernel_problem(head_dim)

