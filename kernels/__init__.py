"""nanoserve.kernels: Triton kernels, each beside a plain-torch reference.

This folder installs as `nanoserve.kernels` (never as a top-level `kernels`: PyPI has a
package by that name). Without CUDA, Triton kernels run in its interpreter, which must be
switched on before any @triton.jit function is defined, hence this first statement.
"""

import os

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
