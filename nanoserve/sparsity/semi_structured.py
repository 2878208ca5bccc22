"""2:4 weights on sparse tensor cores: torch's semi-structured sparse tensors (CUDA, sm_80+).

A 2:4 weight [N, K] holds, per row, 2 values out of every 4 inputs plus 2-bit positions; NVIDIA's
Ampere and later tensor cores multiply such a matrix at up to twice the dense rate.
`torch.sparse.to_sparse_semi_structured` compresses a dense tensor that already has the pattern
(values [N, K/2] + metadata), and `F.linear` with such a weight runs the sparse kernel (CUTLASS or
cuSPARSELt). This module is only the guarded door to it: it refuses, naming why, anything the
kernel cannot take (no CUDA, compute capability under 8.0, a dtype other than fp16 / bf16, a shape
that is not a multiple of torch's minimum tile, a weight breaking the pattern).

No GPU on the development machines: this path is tested by tests/test_pruning.py's
`@pytest.mark.gpu` test only where CUDA is present.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import NanoserveError
from .pruning import GROUP, is_two_four

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MIN_ROWS = 32   # torch's smallest sparse tile for fp16 / bf16: rows and columns must be multiples
MIN_COLS = 64


def semi_structured_problem(weight: torch.Tensor) -> str | None:
    """Why `weight` cannot become a semi-structured sparse tensor, or None if it can."""
    if not weight.is_cuda:
        return f"the weight is on {weight.device}; semi-structured sparsity needs a CUDA GPU"
    capability = torch.cuda.get_device_capability(weight.device)
    if capability < (8, 0):
        return (f"compute capability {capability[0]}.{capability[1]} has no sparse tensor cores "
                "(sm_80 or newer needed)")
    if weight.dtype not in SUPPORTED_DTYPES:
        return f"dtype {weight.dtype} is not supported; allowed: float16, bfloat16"
    n, k = weight.shape
    if n % MIN_ROWS or k % MIN_COLS:
        return (f"shape [{n}, {k}] is not a multiple of [{MIN_ROWS}, {MIN_COLS}] (torch's "
                "smallest semi-structured tile)")
    if k % GROUP or not bool(is_two_four(weight).all()):
        return "the weight breaks the 2:4 pattern (a group of 4 inputs has more than 2 nonzeros)"
    return None


def to_semi_structured(weight: torch.Tensor) -> torch.Tensor:
    """The 2:4 weight compressed for sparse tensor cores (a SparseSemiStructuredTensor)."""
    from torch.sparse import to_sparse_semi_structured

    problem = semi_structured_problem(weight)
    if problem is not None:
        raise NanoserveError(f"cannot use semi-structured sparsity: {problem}")
    return to_sparse_semi_structured(weight.detach().contiguous())


def use_semi_structured(model: nn.Module, names: list[str]) -> list[str]:
    """Swap the weights of the named 2:4 linears for semi-structured sparse ones (inference only:
    no gradients). Returns the names swapped; a layer that cannot be swapped is an error naming
    it."""
    swapped = []
    for name in names:
        lin = model.get_submodule(name)
        problem = semi_structured_problem(lin.weight)
        if problem is not None:
            raise NanoserveError(f"{name}: {problem}")
        lin.weight = nn.Parameter(to_semi_structured(lin.weight), requires_grad=False)
        swapped.append(name)
    return swapped
