"""Launch configurations: the tiles, warps and pipeline stages each kernel gets on each GPU.

A kernel's tiles decide how much shared memory one program needs (operands staged for tl.dot,
`num_stages` copies of every pipelined load, layout conversions) and how many registers each
thread holds (accumulators, the q tile). Over the GPU's shared memory per block the launch fails
("out of resources"); over 255 registers the compiler spills to slow local memory. Both depend
on the GPU, the dtype and the head dim, so every launcher asks `pick(kernel, device, dtype,
head_dim)` and gets a `Launch` from the tables below:

- **Without CUDA** the kernels run in Triton's interpreter: small tiles (each program step costs
  milliseconds there), tiles upcast to fp32 (it cannot do bf16 arithmetic), no warps or stages.
- **sm_80 and newer** (Ampere, Ada, consumer Blackwell; ≥ 99 KB per block): tiles that fit
  99 KB. **sm_90** (Hopper, 227 KB) takes larger fp16/bf16 flash tiles where they do not spill.
- **fp32** uses IEEE fp32 in every tl.dot (`input_precision="ieee"`, no silent TF32), which
  tensor cores cannot do: the dots run on FMA units and need registers for whole operand rows,
  so fp32 gets small tiles (they spill at the fp16 ones).
- **sm_75** (Turing) gets no Triton attention (`attention_problem`): Triton lowers every tl.dot
  there to FMA (no tensor-core path), flash attention spills up to 39 KB per thread (fp16, head
  dim 128, 64×64 tiles), and sm_75 has no bf16 arithmetic. The engine falls back to the torch
  backend (gather + SDPA, which does use the tensor cores). The W4A16 kernels do run there,
  upcast to fp32 like the interpreter: their dots are FMA on sm_75 anyway, the fp32 ones do not
  spill where the fp16 ones do, and bf16 inputs work the same way.

`smem_kb` is the shared memory the row needs, the largest over the targets it serves, as
compiled by benchmarks/bench_kernels_compile.py (benchmarks/kernels_compile.json, Triton 3.8);
tests/test_kernels_compile.py fails if a row needs more than it says or than its GPU has. The
rows are chosen to fit and not to spill, then the largest tiles, untuned for speed, except those
marked "H100-measured": benchmarks/gpu_tune.py swept their tiles, warps and stages on an H100
(2026-11-26, benchmarks/RESULTS.md). Spills are allowed where the sweep paid for them (the sm_90
head_dim-128 flash row spills in its paged-prefix variant). The sm_80 rows are still unmeasured.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Shared memory per block (opt-in maximum), KB. An arch not listed is taken to have the least of
# sm_80+.
SMEM_LIMIT_KB = {75: 64, 80: 163, 86: 99, 87: 163, 89: 99, 90: 227, 100: 227, 120: 99}
DEFAULT_SMEM_LIMIT_KB = 99
MIN_ATTENTION_ARCH = 80
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Launch:
    """One kernel's launch: its tile sizes (meaning per kernel, see the tables), warps, stages."""

    tiles: tuple[int, ...]
    num_warps: int | None = None  # None: the interpreter, which takes neither
    num_stages: int | None = None
    # no bf16 arithmetic (interpreter, sm_75): tiles become fp32 after their load
    upcast: bool = False
    smem_kb: int = 0

    @property
    def gpu(self) -> bool:
        """A launch for a GPU, not for the interpreter."""
        return self.num_warps is not None

    def options(self) -> dict:
        """The launch keywords for kernel[grid](...): none in the interpreter."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages} if self.gpu else {}


# tiles: flash (BLOCK_M, BLOCK_N); decode (BLOCK_N,); gemm, gemv and w8a8 (BLOCK_M, BLOCK_N,
# BLOCK_K); dequantize (BLOCK_K, BLOCK_N); mla_decode (BLOCK_H, BLOCK_N)
INTERPRETER = {
    "flash": Launch((16, 16), upcast=True),
    "decode": Launch((32,), upcast=True),
    "gemm": Launch((16, 32, 32), upcast=True),
    "gemv": Launch((16, 32, 32), upcast=True),
    "gemv_gather": Launch((16, 32, 32), upcast=True),
    "gemm_mma": Launch((16, 32, 128), upcast=True),  # BLOCK_K: the MMA layout's tile
    "gemv_mma": Launch((16, 32, 128), upcast=True),
    "gemv_mma_fma": Launch((1, 32, 128), upcast=True),
    "dequantize": Launch((32, 32), upcast=True),
    "w8a8": Launch((16, 32, 32)),  # int8 tiles: the interpreter computes them exactly in integers
    "ggml_gemv": Launch((16, 32), upcast=True),  # kernels/ggml_matmul.py: (BLOCK_M, BLOCK_N)
    "ggml_gemm": Launch((16, 32), upcast=True),
    "mla_decode": Launch((16, 32), upcast=True),
}
# (family, bytes per element, head_dim padded: 64, 128 or 256) -> Launch. Families: 80 (sm_80+), 90
# (sm_90).
FLASH = {
    (80, 2, 64): Launch((128, 64), 8, 2, smem_kb=32),
    (80, 2, 128): Launch((128, 32), 8, 2, smem_kb=48),
    (80, 2, 256): Launch((64, 32), 8, 2, smem_kb=68),
    # H100-measured: benchmarks/gpu_tune.py, RESULTS.md
    (90, 2, 64): Launch((64, 64), 4, 3, smem_kb=56),
    # its paged-prefix variant spills ~50-110 B
    (90, 2, 128): Launch((128, 128), 8, 2, smem_kb=160),
    (90, 2, 256): Launch((128, 32), 8, 2, smem_kb=128),
    **{(fam, 4, 64): Launch((64, 16), 4, 1, smem_kb=24) for fam in (80, 90)},
    **{(fam, 4, 128): Launch((32, 16), 8, 1, smem_kb=32) for fam in (80, 90)},
    **{(fam, 4, 256): Launch((16, 16), 4, 1, smem_kb=48) for fam in (80, 90)},
}
# (bytes per element, head_dim padded) -> Launch, the same on every sm_80+ GPU
DECODE = {
    (2, 64): Launch((64,), 4, 2, smem_kb=20),
    (2, 128): Launch((64,), 4, 2, smem_kb=38),
    (2, 256): Launch((32,), 4, 2, smem_kb=41),
    (4, 64): Launch((32,), 4, 2, smem_kb=23),
    (4, 128): Launch((32,), 8, 2, smem_kb=43),
    (4, 256): Launch((32,), 8, 2, smem_kb=83),
}
# 8-bit KV pools (kv_cache_dtype int8 / fp8, dequantized in registers: kernels/kv_quant.py) need
# rows of their own where the ones above spill or outgrow their smem_kb, from the compile matrix
# (benchmarks/kernels_compile.json): (kernel, family (0 = any), bytes per element, head_dim padded)
# -> Launch; elsewhere the rows above serve.
KV8 = {
    ("flash", 80, 2, 64): Launch((128, 32), 8, 2, smem_kb=37),  # the plain (128, 64) spills 88 B
    # (128, 32) w8: 72 KB and 192 B of spills
    ("flash", 80, 2, 128): Launch((64, 32), 4, 2, smem_kb=44),
    ("flash", 80, 2, 256): Launch((64, 16), 8, 2, smem_kb=74),  # (64, 32): 84 KB
    # the plain sm_90 row (128, 128) spills 48-52 B
    ("flash", 90, 2, 128): Launch((128, 64), 8, 2, smem_kb=96),
    ("decode", 0, 4, 128): Launch((32,), 8, 1, smem_kb=40),  # fp32 with 2 stages spills
    ("decode", 0, 4, 256): Launch((32,), 8, 1, smem_kb=80),
    # 16-bit queries: the plain rows (64,) w4 and (32,) w4 hold a whole dequantized tile in too
    # few threads, 187-240 registers on sm_90 (the plain decode: 96). Half the keys a tile over 8
    # warps: 80-120 at head_dim 128, 124-128 at 256, no spills (issue 43)
    ("decode", 0, 2, 128): Launch((32,), 8, 2, smem_kb=14),
    ("decode", 0, 2, 256): Launch((16,), 8, 2, smem_kb=17),
}
# int4 KV pools (two codes a byte, a scale and a minimum per 64 values): the 8-bit rows' tiles,
# their shared memory as int4 measures it (more scale loads), and half the keys a decode tile at
# head_dim 64, where the plain (64,) w4 spills 92-248 B
KV4 = {
    ("flash", 80, 2, 64): Launch((128, 32), 8, 2, smem_kb=40),
    ("flash", 80, 2, 128): Launch((64, 32), 4, 2, smem_kb=48),
    ("flash", 90, 2, 128): Launch((128, 32), 8, 2, smem_kb=64),  # (128, 64): 24 B of spills
    ("decode", 0, 2, 64): Launch((32,), 8, 2, smem_kb=10),
    ("decode", 0, 2, 128): Launch((32,), 8, 2, smem_kb=20),
}
# the rows of a quantized KV pool's attention, by the bits of its codes
KV_ROWS = {8: KV8, 4: KV4}
# (kernel, family, bytes per element; 0 = any) -> Launch
DEQUANT = {
    ("gemm", 75, 0): Launch((64, 64, 32), 4, 3, upcast=True, smem_kb=16),
    ("gemm", 80, 2): Launch((64, 64, 32), 4, 3, smem_kb=33),
    ("gemm", 80, 4): Launch((64, 32, 32), 4, 3, smem_kb=25),
    ("gemv", 75, 0): Launch((16, 64, 64), 4, 2, upcast=True, smem_kb=20),
    # H100-measured (benchmarks/gpu_tune.py)
    ("gemv", 80, 2): Launch((16, 128, 64), 4, 3, smem_kb=29),
    ("gemv", 80, 4): Launch((16, 64, 64), 8, 1, smem_kb=20),
    # the act-order GEMV (zero and scale gathered row by row): the grouped path's tiles would cost
    # it 98 KB
    ("gemv_gather", 75, 0): Launch((16, 64, 64), 4, 2, upcast=True, smem_kb=20),
    # (Triton 3.6.0, the GPU image's, gives it 58 KB and 128-156 registers; 3.8.0 50 KB and 71-80)
    ("gemv_gather", 80, 2): Launch((16, 64, 64), 4, 2, smem_kb=58),
    ("gemv_gather", 80, 4): Launch((16, 64, 64), 8, 1, smem_kb=20),
    # weights in the MMA layout (int4_tiles.py): tiles of its 128 rows. At BLOCK_N = 128 over 4
    # warps the compiler loads the packed words into the tensor cores' operand layout and unpacks
    # them there; at 64, or over 8 warps, it sends each 16-row fp16 slice through shared memory
    # again (the GEMM too: 8 relayouts at 64 × 64 × 128, 0 at 32 × 128 × 128). The multiply-adds
    # (M ≤ FMA_MAX_M) take 135-220 registers on sm_90 at 128 × 128 over 4 warps, 64 at 64 × 128
    ("gemm_mma", 75, 0): Launch((64, 64, 32), 4, 3, upcast=True, smem_kb=16),
    ("gemm_mma", 80, 2): Launch((32, 128, 128), 4, 3, smem_kb=34),
    ("gemm_mma", 80, 4): Launch((32, 64, 128), 4, 2, smem_kb=46),
    ("gemv_mma", 75, 0): Launch((16, 64, 128), 4, 2, upcast=True, smem_kb=20),
    ("gemv_mma", 80, 2): Launch((16, 128, 128), 4, 3, smem_kb=26),
    ("gemv_mma", 80, 4): Launch((16, 64, 128), 8, 1, smem_kb=20),
    ("gemv_mma_fma", 75, 0): Launch((16, 64, 128), 4, 2, upcast=True, smem_kb=20),
    ("gemv_mma_fma", 80, 2): Launch((16, 64, 128), 4, 3, smem_kb=2),
    ("gemv_mma_fma", 80, 4): Launch((16, 64, 128), 8, 1, smem_kb=4),
    ("dequantize", 75, 0): Launch((64, 64), 4, 3, upcast=True, smem_kb=16),
    ("dequantize", 80, 0): Launch((64, 64), 4, 3, smem_kb=16),
    # kernels/int8_matmul.py: int8 mma, sm_80+
    ("w8a8", 80, 0): Launch((64, 128, 64), 4, 3, smem_kb=36),
    # kernels/ggml_matmul.py (Q8_0, Q4_K, Q6_K blocks read in place): (BLOCK_M, BLOCK_N), untimed.
    # Chosen from the compile matrix for no spills: over 4 warps the 16-bit tl.dot rows took
    # 128-255 registers on sm_90 (its steps unroll 8-16 parts) and spilled at BLOCK_M = 32; fp32
    # spilled with 2 stages. Left: 16 B in Q6_K's M = 16 rows on sm_90, 16-24 B in two sm_75 rows
    ("ggml_gemv", 75, 0): Launch((16, 32), 4, 1, upcast=True, smem_kb=6),
    ("ggml_gemv", 80, 2): Launch((16, 64), 8, 2, smem_kb=17),
    ("ggml_gemv", 80, 4): Launch((16, 32), 4, 1, smem_kb=6),
    ("ggml_gemm", 75, 0): Launch((32, 32), 4, 1, upcast=True, smem_kb=8),
    ("ggml_gemm", 80, 2): Launch((32, 64), 8, 2, smem_kb=25),
    ("ggml_gemm", 80, 4): Launch((32, 32), 4, 1, smem_kb=8),
    # kernels/mla_decode.py: (BLOCK_H, BLOCK_N) at DeepSeek's r = 512, d_rope = 64, untimed; the
    # launcher refuses sm_75. From the compile matrix: 32 heads a program over 8 warps, 96-168
    # registers, no spills, within sm_86's 99 KB (2 stages: 4 B of spills at 16 heads; 16 heads
    # over 4 warps read the latents twice as often at 128; 64 heads: 112-144 KB and 255 registers
    # on sm_80; 16 × 64 keys over 4 warps spill)
    ("mla_decode", 80, 2): Launch((32, 32), 8, 3, smem_kb=75),
    ("mla_decode", 80, 4): Launch((16, 16), 8, 1, smem_kb=72),
}


@functools.cache
def _capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def gpu_arch(device: torch.device | str) -> int | None:
    """The compute capability of a CUDA device as one number (sm_86 -> 86); None off CUDA (the
    interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def smem_limit_kb(arch: int) -> int:
    return SMEM_LIMIT_KB.get(arch, DEFAULT_SMEM_LIMIT_KB)


def family(arch: int) -> int:
    """Which column of the tables a GPU uses: 90 (sm_90), 80 (every other sm_80+), 75 (older)."""
    return 90 if arch == 90 else 80 if arch >= 80 else 75


def padded_head_dim(head_dim: int) -> int:
    """The tables' head-dim rows: 64 (any D ≤ 64), 128 or 256, the power of two the kernels pad
    to."""
    return max(64, 1 << (head_dim - 1).bit_length())


def attention_problem(arch: int | None, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the Triton attention kernels cannot run (arch None: the interpreter) for these inputs;
    None if they can."""
    if dtype not in DTYPES:
        return f"the Triton attention kernels take {', '.join(map(str, DTYPES))}, not {dtype}"
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return f"the Triton attention kernels take head_dim 1 .. {MAX_HEAD_DIM}, got {head_dim}"
    if arch is None:
        return None
    if arch < MIN_ATTENTION_ARCH:
        return (f"sm_{arch}: Triton attention needs sm_{MIN_ATTENTION_ARCH} or newer (below it "
                "every tl.dot runs on FMA units, flash attention spills, and there is no bf16)")
    for kernel, launch in (("flash", _flash(arch, dtype, head_dim)),
                           ("decode", _decode(dtype, head_dim))):
        if launch.smem_kb > smem_limit_kb(arch):
            return (f"head_dim {head_dim} in {str(dtype).removeprefix('torch.')} needs "
                    f"{launch.smem_kb} KB of shared memory per block ({kernel}) on sm_{arch} "
                    f"(limit {smem_limit_kb(arch)} KB)")
    return None


def pick(kernel: str, device: torch.device | str, dtype: torch.dtype, head_dim: int = 0,
         kv_bits: int = 0) -> Launch:
    """The launch of `kernel` ("flash", "decode", "gemm", "gemv", "gemv_gather", "gemv_mma",
    "gemv_mma_fma", "dequantize", "w8a8", "ggml_gemv", "ggml_gemm", "mla_decode") on
    `device`; kv_bits: attention over a quantized KV pool of 8- or 4-bit codes (the KV8 or KV4
    rows, where there is one; 0: K/V in the model's dtype).

    ValueError where the kernel cannot run there (attention on sm_75, a row over the GPU's shared
    memory)."""
    arch = gpu_arch(device)
    if arch is None:
        return INTERPRETER[kernel]
    if kernel in ("flash", "decode"):
        problem = attention_problem(arch, dtype, head_dim)
        if problem:
            raise ValueError(problem)
        fam, D = (family(arch) if kernel == "flash" else 0), padded_head_dim(head_dim)
        rows = KV_ROWS.get(kv_bits, {})
        if (kernel, fam, dtype.itemsize, D) in rows:
            return rows[(kernel, fam, dtype.itemsize, D)]
        return _flash(arch, dtype, head_dim) if kernel == "flash" else _decode(dtype, head_dim)
    fam = 75 if arch < 80 else 80  # the W4A16 rows: sm_90 takes the sm_80 ones
    launch = DEQUANT.get((kernel, fam, 0)) or DEQUANT[(kernel, fam, dtype.itemsize)]
    if launch.smem_kb > smem_limit_kb(arch):
        raise ValueError(f"{kernel} needs {launch.smem_kb} KB of shared memory per block on "
                         f"sm_{arch} (limit {smem_limit_kb(arch)} KB)")
    return launch


def _flash(arch: int, dtype: torch.dtype, head_dim: int) -> Launch:
    return FLASH[(family(arch), dtype.itemsize, padded_head_dim(head_dim))]


def _decode(dtype: torch.dtype, head_dim: int) -> Launch:
    return DECODE[(dtype.itemsize, padded_head_dim(head_dim))]
