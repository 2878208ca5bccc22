"""Paged decode attention on the CPU, in C (cpu_paged_attention.c), beside its torch reference.

On a GPU the Triton kernels read the paged pool in place; on a CPU, Triton only interprets them
(correct, far too slow to serve), so the torch backend gathers each sequence's blocks into a padded
copy and runs SDPA on it: a copy of every sequence's whole context, per layer, per step. This file
compiles a small C kernel that walks the block tables instead (cpu_paged_attention.c explains it)
and calls it through ctypes on torch tensors' memory. Its reference is the Triton kernel's,
`paged_attention_ref`, one sequence at a time in plain torch; `paged_attention_cpu` takes the same
arguments as `paged_attention` (kernels/paged_attention.py).

**Building** (cpu_build.py): once per head dim and machine, ~0.2 s, with the reassociation flags
that let the compiler vectorize the sums (`-fassociative-math` and the flags it needs; not
`-ffast-math`, which would also assume no infinities, and the softmax's running max starts at
−inf). `cpu_kernel_problem()` says why the kernel cannot run here (no compiler, a failed build),
and the engine then uses the torch backend.
"""

from __future__ import annotations

import ctypes
import math
from functools import cache
from pathlib import Path

import torch

from .checks import check_paged_attention, check_sinks, check_softcap, check_window
from .cpu_build import build_library
from .paged_attention import paged_attention_ref

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math"]
__all__ = ["paged_attention_cpu", "paged_attention_cpu_unchecked", "paged_attention_ref",
           "cpu_kernel_problem",
           "load_library"]


@cache
def load_library(head_dim: int) -> ctypes.CDLL:
    """The kernel compiled for `head_dim`, built on first use and kept on disk (module docstring).
    Raises RuntimeError with the compiler's message when it cannot be built."""
    lib = build_library(SOURCE, [*FLAGS, f"-DHEAD_DIM={head_dim}"], f"paged_decode_d{head_dim}")
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.paged_decode_attention.argtypes = [ptr] * 7 + [i64] * 5 + [f32, i64, f32, ctypes.c_int]
    lib.paged_decode_attention.restype = ctypes.c_int
    return lib


@cache
def cpu_kernel_problem(head_dim: int) -> str | None:
    """None where the C kernel builds and loads for this head dim on this machine, else why not (one
    line)."""
    try:
        load_library(head_dim)
    except (RuntimeError, OSError) as e:
        return str(e).splitlines()[0]
    return None


def paged_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, sm_scale=None, *,
                        window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over paged K/V on the CPU, float32; the arguments of `paged_attention`.

    q [B, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] and
    context_lens [B] (int64 is used as is, int32 converted); returns out [B, H, D]. Sequence b sees
    keys 0 .. context_lens[b] − 1 (its `window` newest only, with a sliding window); scores ×
    sm_scale (default 1/√D), soft-capped to softcap·tanh(x / softcap) when given; `sinks` [H]:
    each head's learned sink logit joins its softmax with no value (gpt-oss). The C kernel
    trusts every index, so the shapes, the lengths and the block ids it will read are checked here,
    on the host, before it runs."""
    # shapes; the block ids read
    check_paged_attention(q, k_cache, v_cache, block_tables, context_lens, 1)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if (
            t.dtype != torch.float32
            or t.device.type != "cpu"
            or (t is not q and not t.is_contiguous())
        ):
            raise ValueError(f"paged_attention_cpu reads float32 pools in place on the CPU; {name} "
                             f"is {t.dtype} on "
                             f"{t.device}{'' if t.is_contiguous() else ', not contiguous'}")
    return paged_attention_cpu_unchecked(q, k_cache, v_cache, block_tables.long(),
                                         context_lens.long(), sm_scale,
                                         check_window(window), check_softcap(softcap),
                                         check_sinks(sinks, q.shape[1]))


def paged_attention_cpu_unchecked(q, k_cache, v_cache, block_tables, context_lens, sm_scale,
                                  window: int, softcap: float,
                                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_attention_cpu` on inputs already checked (the CPU backend checks a step's tables once,
    not per layer): int64 tables, window and softcap in the kernel's form (0: off); sinks [H] or
    None (converted to contiguous float32 here)."""
    B, H, D = q.shape
    block_size, Hkv = k_cache.shape[1:3]
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    q = q.contiguous()
    out = torch.empty_like(q)  # B, H, D
    if B == 0:  # (no sequence: nothing to read, and the kernel would size its buffers at 0)
        return out
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    sinks_ptr = None  # NULL: no sinks
    if sinks is not None:
        sinks = sinks.detach().float().contiguous()  # H (kept alive until the call returns)
        sinks_ptr = sinks.data_ptr()
    failed = load_library(D).paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), sinks_ptr,
        B, tables.shape[1], H, Hkv, block_size, scale, window, softcap, torch.get_num_threads())
    if failed:
        raise MemoryError("paged_attention_cpu: a thread could not allocate its "
                          f"{tables.shape[1] * block_size} scores per head")
    return out
