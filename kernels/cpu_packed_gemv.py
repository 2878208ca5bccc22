"""x · Wᵀ with W kept packed, on the CPU, in C (cpu_packed_gemv.c), beside torch references: the
decode step's matrix products for quantized weights.

Two packings: a llama.cpp block type (Q8_0, Q4_0, Q4_K, Q6_K: `ggml_gemv`, for GGUF files'
`GGMLLinear`), and GPTQ's 4- and 8-bit grids (`grid_gemv`, for every `QuantLinear`: nanoserve's
RTN, GPTQ and AWQ, and the GPTQ, AutoAWQ and compressed-tensors checkpoints it reads).

The references (`ggml_gemv_ref`, `grid_gemv_ref`) are the obvious way: dequantize the whole matrix
to float32, then `F.linear`. For a decode step that reads the packed bytes, then writes and reads a
float32 copy four to eight times their size: slower than float32 weights would have been. The C
kernel reads each block once, in place (the C file explains how); its result differs from the
reference only by the order of float additions (tests/test_packed_gemv.py). Under 4 activation
rows it multiplies each block where it lands; from 4 rows on it decodes panels of 16 weight rows
once per call and multiplies them as a small GEMM (register tiles of 6 × 16).
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
# activation rows up to which the kernel's products beat decoding the whole matrix in C and a BLAS
# GEMM (even at 32 rows, 2048 x 768 and 768 x 2048, 2 threads; benchmarks/RESULTS.md, "GGUF weights
# on the CPU"); the layers choose by it
KERNEL_MAX_ROWS = 16
# many rows: W decoded a slab of output rows at a time, slabs of about this many bytes of floats
# (in L2 when a BLAS GEMM multiplies them), never the whole float matrix at once
SLAB_BYTES = 512 * 1024
# the C kernel's code for a type, weights and bytes per block
KINDS = {"Q8_0": (8, 32, 34), "Q4_0": (4, 32, 18), "Q4_K": (14, 256, 144), "Q6_K": (16, 256, 210)}


@cache
def load_library() -> ctypes.CDLL:
    lib = build_library(SOURCE, FLAGS, "ggml_gemv")
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ggml_gemv.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.ggml_gemv.restype = ctypes.c_int
    lib.grid_gemv.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, i64, ptr, ptr, i64, i64, i64,
                              ctypes.c_int]
    lib.grid_gemv.restype = ctypes.c_int
    lib.ggml_dequantize.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, i64, ctypes.c_int]
    lib.ggml_dequantize.restype = None
    lib.grid_dequantize.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, i64, ptr, i64, i64,
                                    ctypes.c_int]
    lib.grid_dequantize.restype = None
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


class PreparedBlocks:
    """`ggml_gemv` for one matrix of llama.cpp blocks (`packed` uint8 [out_features, K / block
    weights · bytes per block], contiguous), checked once and its address fixed: a decode step then
    calls it with x alone (contiguous float32 [M, K] on the CPU). It keeps `packed` alive."""

    def __init__(self, packed: torch.Tensor, type_name: str, in_features: int,
                 out_features: int):
        if type_name not in KINDS:
            raise ValueError(f"ggml_gemv reads {', '.join(KINDS)}, not {type_name}")
        kind, block_weights, block_bytes = KINDS[type_name]
        if in_features % block_weights:
            raise ValueError(f"K={in_features} is not a whole number of {block_weights}-weight "
                             "blocks")
        expected = (out_features, in_features // block_weights * block_bytes)
        if packed.dtype != torch.uint8 or tuple(packed.shape) != expected:
            raise ValueError(f"packed must be uint8 {expected} for {type_name} [{out_features}, "
                             f"{in_features}], got {packed.dtype} {tuple(packed.shape)}")
        self.packed = packed.contiguous()
        self.in_features = in_features
        self.out_features = out_features
        self._weights = (kind, self.packed.data_ptr())
        self._row_bytes = expected[1]
        self._gemv = load_library().ggml_gemv

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        M = x.shape[0]
        y = torch.empty(M, self.out_features)
        failed = self._gemv(*self._weights, x.data_ptr(), y.data_ptr(), M, self.out_features,
                            self.in_features, self._row_bytes, torch.get_num_threads())
        if failed:
            raise MemoryError(f"ggml_gemv: could not allocate a panel of {self.in_features} × "
                              "16 floats")
        return y


def ggml_gemv(x: torch.Tensor, packed: torch.Tensor, type_name: str,
              out_features: int) -> torch.Tensor:
    """x [M, K] float32 (CPU) · Wᵀ → [M, out_features]; `packed` is W's blocks, uint8
    [out_features, K / 32 · bytes per block]. Everything the C code will read is checked here."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"ggml_gemv takes x as a 2-D float32 CPU tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    return PreparedBlocks(packed, type_name, x.shape[1], out_features)(x.contiguous())


def ggml_dequantize(packed: torch.Tensor, type_name: str, out_features: int,
                    in_features: int) -> torch.Tensor:
    """W [out_features, in_features] float32 from its blocks, decoded in C (each row as the kernel's
    many-row path decodes it; equal to nanoserve.quant.ggml_blocks.dequantize): what a prefill's
    many rows multiply with a BLAS GEMM."""
    kind, block_weights, block_bytes = KINDS[type_name]
    expected = (out_features, in_features // block_weights * block_bytes)
    whole_blocks = in_features % block_weights == 0
    if packed.dtype != torch.uint8 or tuple(packed.shape) != expected or not whole_blocks:
        raise ValueError(f"packed must be uint8 {expected} for {type_name} [{out_features}, "
                         f"{in_features}], got {packed.dtype} {tuple(packed.shape)}")
    packed = packed.contiguous()
    out = torch.empty(out_features, in_features)
    load_library().ggml_dequantize(kind, packed.data_ptr(), out.data_ptr(), out_features,
                                   in_features, expected[1], torch.get_num_threads())
    return out


def decoded_matmul(x: torch.Tensor, decode, out_features: int) -> torch.Tensor:
    """x [M, K] · Wᵀ for many rows of x (a prefill, a large batch), W decoded slab by slab:
    `decode(n0, n1)` gives rows n0 .. n1 − 1 of W as float32 [n1 − n0, K]; each slab, about
    SLAB_BYTES of floats, is multiplied by a BLAS GEMM while it is in cache. Decoding the whole
    matrix first would write and read a float32 copy of W, four to eight times its packed bytes,
    through memory on every call."""
    rows = max(16, SLAB_BYTES // (4 * x.shape[1]))
    slabs = [torch.mm(decode(n0, min(out_features, n0 + rows)), x.t())  # rows, M each
             for n0 in range(0, out_features, rows)]
    return torch.cat(slabs).t().contiguous()  # M, N


# ----------------------------------------------------------------------------- GPTQ's grids
GRID_BITS = (4, 8)


def grid_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight int32 [K·bits/32, N] → codes [K, N] (int64): code i of word (j, n) is
    k = j·32/bits + i, at bits [bits·i, bits·i + bits)."""
    words = qweight.long() & 0xFFFFFFFF  # unsigned
    shifts = torch.arange(0, 32, bits)  # 32/bits
    codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)  # K/per, per, N
    return codes.flatten(0, 1)  # K, N


def grid_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The reference: W [N, K] = (q − z) · s per group of `group` columns, in float32 (float64 if
    x is), then `F.linear`."""
    K = x.shape[-1]
    g = torch.arange(K) // group  # K
    q = grid_codes(qweight, bits).to(x.dtype)  # K, N
    weight = (q - zeros.to(x.dtype)[g]) * scales.to(x.dtype)[g]  # K, N
    return F.linear(x, weight.t())


def grid_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    bits: int, group: int) -> torch.Tensor:
    """W [N, K] float32, (q − z) · s decoded in C (the same numbers as `grid_gemv_ref`'s): what a
    prefill's many rows multiply with a BLAS GEMM. Arguments as `grid_gemv`'s."""
    N = scales.shape[1]
    K = qweight.shape[0] * 32 // bits
    check_grid(qweight, scales, zeros, bits, group, K)
    out = torch.empty(N, K)
    load_library().grid_dequantize(bits, qweight.data_ptr(), qweight.stride(0),
                                   scales.data_ptr(), zeros.data_ptr(), group, out.data_ptr(), N,
                                   K, torch.get_num_threads())
    return out


def check_grid(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                group: int, K: int) -> None:
    """Everything the C code will read about a grid, checked."""
    if bits not in GRID_BITS:
        raise ValueError(f"the grid kernels read {GRID_BITS}-bit codes, not {bits}")
    per = 32 // bits
    if group % per or K % group:
        raise ValueError(f"group={group} must be a multiple of {per} that divides K={K}")
    N = scales.shape[1]
    if qweight.dtype != torch.int32 or qweight.shape != (K // per, N) or qweight.stride(1) != 1:
        raise ValueError(f"qweight must be int32 [{K // per}, {N}] with contiguous rows, got "
                         f"{qweight.dtype} {tuple(qweight.shape)} strides {qweight.stride()}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.dtype != torch.float32 or t.shape != (K // group, N) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [{K // group}, {N}], got "
                             f"{t.dtype} {tuple(t.shape)}")


def grid_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              bits: int, group: int) -> torch.Tensor:
    """x [M, K] float32 (CPU) · Wᵀ → [M, N] for W a grid read as GPTQ stores it: `qweight` int32
    [K·bits/32, N] (rows may be strided: a view), `scales` and `zeros` contiguous float32
    [K / group, N]; `group` a multiple of 32/bits dividing K. Everything the C code will read is
    checked here."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"grid_gemv takes x as a 2-D float32 CPU tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if qweight.shape[0] * (32 // bits) != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, the codes {qweight.shape[0]} rows of "
                         f"{32 // bits} codes")
    return PreparedGrid(qweight, scales, zeros, bits, group)(x.contiguous())


class PreparedGrid:
    """`grid_gemv` for one layer's tensors, checked once (`check_grid`) and their addresses fixed:
    a decode step calls it for every linear with x alone (contiguous float32 [M, K] on the CPU),
    and working the arguments out again each time would cost as much as a small layer's product.
    It keeps the tensors alive, so the addresses stay valid."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bits: int, group: int):
        K = qweight.shape[0] * (32 // bits)
        check_grid(qweight, scales, zeros, bits, group, K)
        self.tensors = (qweight, scales, zeros)
        self.out_features = scales.shape[1]
        self.in_features = K
        self._weights = (bits, qweight.data_ptr(), qweight.stride(0), scales.data_ptr(),
                         zeros.data_ptr(), group)
        self._gemv = load_library().grid_gemv

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        M = x.shape[0]
        y = torch.empty(M, self.out_features)
        failed = self._gemv(*self._weights, x.data_ptr(), y.data_ptr(), M, self.out_features,
                            self.in_features, torch.get_num_threads())
        if failed:
            raise MemoryError(f"grid_gemv: could not allocate its buffers for {M} rows")
        return y
