"""nanoserve.kernels: Triton kernels, each beside a plain-torch reference.

Two kernels are C, not Triton: cpu_paged_attention.c, the CPU's decode attention over the paged
pool, and cpu_packed_gemv.c, the CPU's matrix product over packed quantized weights (llama.cpp's
blocks, GPTQ's grids); each is compiled on first use (cpu_build.py) and called from its .py file.
Triton only interprets kernels on a CPU.

This folder installs as `nanoserve.kernels` (never as a top-level `kernels`: PyPI has a
package by that name). Without CUDA, Triton kernels run in its interpreter, which must be
switched on (TRITON_INTERPRET=1) before Triton itself is first imported; `import nanoserve`
does that on a machine without CUDA, before anything of ours can import Triton.
"""

from __future__ import annotations

import torch

from . import configs


def triton_attention_supported(head_dim: int, dtype: torch.dtype,
                               device: torch.device | str) -> str | None:
    """None where the Triton attention kernels run for this model on `device`, else a one-line
    reason.

    The engine's KV layer calls it to fall back to the torch backend (gather + SDPA). On a GPU they
    need sm_80 or newer (on sm_75 Triton has no tensor-core tl.dot and no bf16: see
    kernels/configs.py), head_dim 1 .. 256, fp16, bf16 or fp32, and launch configs within the GPU's
    shared memory per block. On CPU, Triton's interpreter runs every supported dtype and head dim
    (slowly). Reads no tensor and imports no Triton.
    """
    return configs.attention_problem(configs.gpu_arch(device), dtype, head_dim)


def check_interpreter(device: torch.device | str) -> None:
    """Raise a clear error when kernels would run on `device` = CPU without Triton's interpreter.

    The interpreter replaces Triton's language functions (tl.zeros, tl.sum, ...) when Triton is
    imported with TRITON_INTERPRET=1; imported earlier without it, a kernel on CPU tensors fails
    deep inside Triton with "Cannot call @triton.jit'd outside of the scope of a kernel".
    """
    if torch.device(device).type == "cuda":
        return
    import numpy
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        raise RuntimeError(
            "nanoserve's Triton kernels need Triton's interpreter to run on CPU, but Triton was "
            "imported before it was switched on: set TRITON_INTERPRET=1 in the environment, or "
            "import nanoserve before anything that imports triton (torch.compile, torch._dynamo)")
    problem = interpreter_version_problem(triton.__version__, numpy.__version__)
    if problem:
        raise RuntimeError(problem)


def interpreter_version_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why this Triton cannot interpret our kernels beside this NumPy, or None.

    Triton before 3.8 turns a runtime loop bound into a Python int in a way NumPy 2.4 refuses, so
    every kernel with a `range(runtime_value)` loop fails inside the interpreter (compiled GPU
    kernels are not affected). Both pins of the project allow the pair, so say it plainly
    instead."""
    version = lambda v: tuple(int(x) for x in v.split("+")[0].split(".")[:2])  # noqa: E731
    if version(triton_version) < (3, 8) and version(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s CPU interpreter cannot run nanoserve's kernels with "
                f"NumPy {numpy_version} (it converts loop bounds in a way NumPy >= 2.4 refuses; "
                "Triton 3.8 fixed it): install triton>=3.8, or numpy<2.4, or use "
                "attention_backend='torch' on CPU")
    return None
