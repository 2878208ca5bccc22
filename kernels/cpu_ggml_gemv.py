"""x · Wᵀ with W packed in a llama.cpp block type (Q8_0, Q4_0, Q4_K, Q6_K), on the CPU, in C
(cpu_ggml_gemv.c), beside its torch reference.

`ggml_gemv_ref` is the obvious way: dequantize the whole matrix to float32
(nanoserve/quant/ggml_blocks.py), then `F.linear`. For a decode step it reads the packed bytes, then
writes and reads a float32 copy four times their size (Q8_0) or seven (Q4_0): slower than float32
weights would have been. `ggml_gemv` reads each block once, in place (the C file explains how); its
result differs from the reference only by the order of float additions (tests/test_ggml_gemv.py).
It is for a decode step's few activation rows (from 4 rows on, each weight row is decoded once per
call and reused by all of them): a prefill's many rows are better served by one dequantization and a
BLAS GEMM, which blocks for registers (`GGMLLinear` chooses).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from .cpu_build import build_library

SOURCE = Path(__file__).with_suffix(".c")
# the reassociation that lets the compiler vectorize the many-row path's sums (as the attention
# kernel's; not -ffast-math)
FLAGS = ["-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math"]
# the C kernel's code for a type, weights and bytes per block
KINDS = {"Q8_0": (8, 32, 34), "Q4_0": (4, 32, 18), "Q4_K": (14, 256, 144), "Q6_K": (16, 256, 210)}


@cache
def load_library() -> ctypes.CDLL:
    lib = build_library(SOURCE, FLAGS, "ggml_gemv")
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ggml_gemv.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.ggml_gemv.restype = ctypes.c_int
    return lib


@cache
def cpu_gemv_problem() -> str | None:
    """None where the C kernel builds and loads here, else why not (one line)."""
    try:
        load_library()
    except (RuntimeError, OSError) as e:
        return str(e).splitlines()[0]
    return None


def ggml_gemv_ref(x: torch.Tensor, packed: torch.Tensor, type_name: str,
                  out_features: int) -> torch.Tensor:
    """The reference: the whole matrix dequantized to float32, then multiplied."""
    from nanoserve.quant.ggml_blocks import dequantize

    weight = dequantize(packed, type_name, (out_features, x.shape[-1]))
    return F.linear(x.float(), weight)


def ggml_gemv(x: torch.Tensor, packed: torch.Tensor, type_name: str,
              out_features: int) -> torch.Tensor:
    """x [M, K] float32 (CPU, contiguous) · Wᵀ → [M, out_features]; `packed` is W's blocks, uint8
    [out_features, K / 32 · bytes per block]. Everything the C code will read is checked here."""
    if type_name not in KINDS:
        raise ValueError(f"ggml_gemv reads {', '.join(KINDS)}, not {type_name}")
    kind, block_weights, block_bytes = KINDS[type_name]
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"ggml_gemv takes x as a 2-D float32 CPU tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    M, K = x.shape
    if K % block_weights:
        raise ValueError(f"K={K} is not a whole number of {block_weights}-weight blocks")
    expected = (out_features, K // block_weights * block_bytes)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != expected:
        raise ValueError(f"packed must be uint8 {expected} for {type_name} [{out_features}, {K}], "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    x, packed = x.contiguous(), packed.contiguous()
    y = torch.empty(M, out_features)
    failed = load_library().ggml_gemv(kind, packed.data_ptr(), x.data_ptr(), y.data_ptr(), M,
                                      out_features, K, expected[1], torch.get_num_threads())
    if failed:
        raise MemoryError(f"ggml_gemv: a thread could not allocate its {K} floats of row buffer")
    return y
