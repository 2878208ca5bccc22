"""nanoserve.kernels: Triton kernels, each beside a plain-torch reference.

This folder installs as `nanoserve.kernels` (never as a top-level `kernels`: PyPI has a
package by that name). Without CUDA, Triton kernels run in its interpreter, which must be
switched on (TRITON_INTERPRET=1) before Triton itself is first imported; `import nanoserve`
does that on a machine without CUDA, before anything of ours can import Triton.
"""

from __future__ import annotations

import torch


def check_interpreter(device: torch.device | str) -> None:
    """Raise a clear error when kernels would run on `device` = CPU without Triton's interpreter.

    The interpreter replaces Triton's language functions (tl.zeros, tl.sum, ...) when Triton is
    imported with TRITON_INTERPRET=1; imported earlier without it, a kernel on CPU tensors fails
    deep inside Triton with "Cannot call @triton.jit'd outside of the scope of a kernel".
    """
    if torch.device(device).type == "cuda":
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        raise RuntimeError(
            "nanoserve's Triton kernels need Triton's interpreter to run on CPU, but Triton was imported before "
            "it was switched on: set TRITON_INTERPRET=1 in the environment, or import nanoserve before anything "
            "that imports triton (torch.compile, torch._dynamo)")
