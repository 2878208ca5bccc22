"""y = x · Wᵀ with W in a llama.cpp block type (Q8_0, Q4_K, Q6_K), dequantized in registers.

`GGMLLinear` (nanoserve/models/gguf_file.py) keeps a GGUF weight as the file's bytes, uint8
[N, bytes per row]; without a kernel each forward dequantizes all of it to float and then
multiplies, so a decode step writes and reads a float copy of every weight, several times the
bytes it started from. This kernel reads the bytes in place, with no repacking at load, and turns
them into numbers in registers right before they meet x (kernels/dequant_matmul.py explains why
that is what a decode step needs). The byte layouts are those of nanoserve/quant/ggml_blocks.py:

    Q8_0  34 bytes per 32 weights:  fp16 d, 32 int8 codes                  w = d·q
    Q4_K  144 bytes per 256:        fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins,
                                    128 bytes of nibbles (8 sub-blocks of 32)   w = d·s·q − dmin·m
    Q6_K  210 bytes per 256:        128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d
                                    (16 sub-blocks of 16)                  w = d·s·(q − 32)

**Integer codes into the dot, the scales after it.** Within a *part* (a Q8_0 block or a K-quant
sub-block) every weight shares its scale, so the part's contribution to y[m, n] is

    d·s[n] · Σ_l q[n, l]·x[m, l]  −  dmin·m[n] · Σ_l x[m, l]        (the second term: Q4_K only)

and what goes into the product is q: small integers (|q| ≤ 128), exact in fp16 and bf16, so the
tensor cores see exactly the weights' codes and the fp32 scale is applied to the fp32 sum. The
min's term needs only the part's sum of x (the CPU kernel does the same, kernels/cpu_packed_gemv.c).

**One kernel, the type a constexpr.** `_ggml_matmul_kernel` walks K in steps of 256 weights (one
K-quant super-block, or eight Q8_0 blocks) and hands each step to the type's reader (`TYPE`: the
ggml type id, so one compiled kernel per type):
- `_q8_0_step`: 8 parts of 32; a part past K (Q8_0 rows need only be whole blocks of 32) is masked.
- `_q4_k_step`: 4 chunks of 32 bytes, each byte's low nibble in sub-block 2c and its high nibble
  in 2c + 1, so each byte is loaded once; each sub-block's 6-bit scale and min
  (`_q4_k_scale_min`).
- `_q6_k_step`: per half of 128 weights, 16 bytes of qh at a time serve four sub-blocks and 16 bytes
  of ql two, each 6-bit code being a nibble of ql with a bit pair of qh on top.
Each part goes through `_part_dot`: multiply-adds for one or two rows of x (FMA: the codes stay in
registers, no tile of 16 rows is padded for tl.dot), else tl.dot over BLOCK_M rows.

**Launches** (the grid is column tiles × K splits × row tiles), as kernels/dequant_matmul.py:
- M ≤ GEMV_MAX_M (decode): all rows in one tile; by multiply-adds for M ≤ FMA_MAX_M. **Split-K**:
  split s sums whole 256-weight steps of its K range into row s of an fp32 buffer, and the split of
  a column tile that finishes last sums the partials in split order and writes y
  (dequant_matmul's `reduce_splits` and `split_k_partials`: deterministic, no float atomics).
  `choose_split_k` (dequant_matmul's) sizes it.
- larger M: row tiles of BLOCK_M with tl.dot, one split. Correct for any M; on a GPU a prefill's
  many rows are compute-bound and a dequantized copy through cuBLAS is likely faster, so
  `GGMLLinear` uses the kernel below TORCH_MIN_M rows only (`ggml_kernel_serves`; the threshold is
  dequant_matmul's roofline estimate, not a measurement of this kernel).

**Memory access.** Bytes are loaded as uint8 where they lie. Row strides of real layers are
multiples of 16 bytes, but blocks inside a row start at multiples of 34 (Q8_0) or 210 (Q6_K) bytes,
so the compiler cannot prove wider alignment and reads byte by byte (Q4_K's 144-byte blocks are
16-byte aligned). A repack at load into aligned planes (codes apart from scales) would allow
vector loads; it is not done, so W stays the file's bytes, the tensor every other path of
GGMLLinear reads. Tested in the interpreter and compiled for sm_75/80/90; not yet run or timed on a
GPU.

**Precision.** Accumulation in fp32; y in x's dtype. In the interpreter (and on sm_75) x becomes
fp32 right after its load (`UPCAST`). fp32 x uses IEEE fp32 in tl.dot (no TF32). The launch
configs are kernels/configs.py's "ggml_gemv" and "ggml_gemm" rows. `ggml_matmul_ref` is the
plain-torch reference: the whole weight dequantized by quant/ggml_blocks.py, then x · Wᵀ in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.quant.ggml_blocks import BLOCK_TYPES, dequantize

from .checks import DTYPES
from .configs import pick
from .dequant_matmul import choose_split_k, reduce_splits, split_k_partials

TYPES = ("Q8_0", "Q4_K", "Q6_K")  # the block types these kernels read
STEP = 256  # weights of K per loop step: a K-quant super-block, eight Q8_0 blocks
GEMV_MAX_M = 16  # M ≤ this: split-K GEMV, all rows in one tile
FMA_MAX_M = 2  # M ≤ this: the GEMV's rows by multiply-adds (BLOCK_M = M)
TORCH_MIN_M = 64  # GGMLLinear on CUDA, M ≥ this: dequantize + cuBLAS (module docstring)


# ----------------------------------------------------------------------------- the reference
def ggml_matmul_ref(x: torch.Tensor, packed: torch.Tensor, type_name: str,
                    out_features: int) -> torch.Tensor:
    """Plain torch: W [N, K] dequantized to fp32 (quant/ggml_blocks.py), y = x · Wᵀ in fp32, cast
    to x's dtype."""
    w = dequantize(packed, type_name, (out_features, x.shape[-1]))  # N, K
    return (x.float() @ w.to(x.device).t()).to(x.dtype)  # M, N


# ----------------------------------------------------------------------------- reading bytes
@triton.jit
def _f16(W, at, mask):
    """The little-endian float16 at byte offsets `at` of W (uint8), as fp32: two byte loads joined
    into a uint16, reinterpreted."""
    lo = tl.load(W + at, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(W + at + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _x_part(X, x_rows, m_mask, k0, offs, stride_xk, hi, UPCAST: tl.constexpr):
    """x[:, k0 + offs] [BLOCK_M, P] (zeros from column `hi` on). The mask is a whole tile: a
    scalar condition in a mask is refused by newer Triton interpreters."""
    live = (k0 + offs) < hi  # P
    x = tl.load(X + x_rows[:, None] + (k0 + offs)[None, :] * stride_xk,
                mask=m_mask[:, None] & live[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _part_dot(x, q, FMA: tl.constexpr):
    """x [BLOCK_M, P] · q [BLOCK_N, P]ᵀ → [BLOCK_M, BLOCK_N] in fp32; q holds integer codes, exact
    in x's dtype. FMA: multiply-adds ([BLOCK_M, BLOCK_N, P] products summed), else tl.dot."""
    if FMA:
        out = tl.sum(x.to(tl.float32)[:, None, :] * q.to(tl.float32)[None, :, :], axis=2)
    else:
        out = tl.dot(x, tl.trans(q.to(x.dtype)), input_precision="ieee")
    return out


# ----------------------------------------------------------------------------- one step per type
@triton.jit
def _q8_0_step(X, W, x_rows, m_mask, w_rows, n_mask, start, hi, stride_xk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
               FMA: tl.constexpr):
    """Weights start .. start + 255 of Q8_0 rows: 8 blocks (34 bytes: fp16 d, 32 int8 codes)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs = tl.arange(0, 32)
    for p in tl.static_range(8):
        k0 = start + 32 * p
        # K is whole blocks of 32, not always of 256
        x = _x_part(X, x_rows, m_mask, k0, offs, stride_xk, hi, UPCAST)  # BLOCK_M, 32
        at = w_rows + (k0 // 32) * 34  # BLOCK_N   the block's first byte in each row
        w_mask = n_mask & ((tl.zeros([BLOCK_N], dtype=tl.int32) + k0) < hi)
        d = _f16(W, at, w_mask)  # BLOCK_N
        q = tl.load(W + at[:, None] + 2 + offs[None, :], mask=w_mask[:, None], other=0)
        q = q.to(tl.int8, bitcast=True)  # BLOCK_N, 32
        acc += _part_dot(x, q, FMA) * d[None, :]
    return acc


@triton.jit
def _q4_k_scale_min(W, at, n_mask, s: tl.constexpr):
    """Sub-block s's 6-bit scale and min, from the 12 bytes at `at` + 4 (ggml_blocks'
    `_k4_scales_mins`): s < 4 in the low 6 bits of bytes s and 4 + s; s ≥ 4 in the nibbles of byte
    4 + s, with the top 2 bits in bits 6-7 of bytes s − 4 and s."""
    if s < 4:
        scale = tl.load(W + at + 4 + s, mask=n_mask, other=0).to(tl.int32) & 63
        low = tl.load(W + at + 8 + s, mask=n_mask, other=0).to(tl.int32) & 63
    else:
        nibbles = tl.load(W + at + 8 + s, mask=n_mask, other=0).to(tl.int32)
        scale_top = tl.load(W + at + s, mask=n_mask, other=0).to(tl.int32) >> 6
        min_top = tl.load(W + at + 4 + s, mask=n_mask, other=0).to(tl.int32) >> 6
        scale = (nibbles & 15) | (scale_top << 4)
        low = (nibbles >> 4) | (min_top << 4)
    return scale.to(tl.float32), low.to(tl.float32)


@triton.jit
def _q4_k_step(X, W, x_rows, m_mask, w_rows, n_mask, start, stride_xk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
               FMA: tl.constexpr):
    """One Q4_K super-block of each row (144 bytes): d·s·Σ q·x − dmin·m·Σ x per sub-block."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs = tl.arange(0, 32)
    at = w_rows + (start // 256) * 144  # BLOCK_N
    d = _f16(W, at, n_mask)  # BLOCK_N
    dmin = _f16(W, at + 2, n_mask)
    for c in tl.static_range(4):  # chunks of 32 bytes: sub-blocks 2c (low nibbles), 2c + 1 (high)
        qs = tl.load(W + at[:, None] + 16 + 32 * c + offs[None, :], mask=n_mask[:, None],
                     other=0)  # BLOCK_N, 32
        for half in tl.static_range(2):
            s = 2 * c + half
            x = _x_part(X, x_rows, m_mask, start + 32 * s, offs, stride_xk, start + 256,
                        UPCAST)
            q = (qs >> (4 * half)) & 15  # BLOCK_N, 32
            scale, low = _q4_k_scale_min(W, at, n_mask, s)  # BLOCK_N, BLOCK_N
            x_sum = tl.sum(x.to(tl.float32), axis=1)  # BLOCK_M
            acc += _part_dot(x, q, FMA) * (d * scale)[None, :]
            acc -= x_sum[:, None] * (dmin * low)[None, :]
    return acc


@triton.jit
def _q6_k_step(X, W, x_rows, m_mask, w_rows, n_mask, start, stride_xk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
               FMA: tl.constexpr):
    """One Q6_K super-block of each row (210 bytes). Weight 128·h + 32·g + l (half h, g = 0..3,
    l = 0..31) is nibble g // 2 of ql[64·h + 32·(g % 2) + l] with bit pair g of qh[32·h + l] on
    top, minus 32; sub-block (16 weights) p has the int8 scale at byte 192 + p."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs = tl.arange(0, 16)
    at = w_rows + (start // 256) * 210  # BLOCK_N
    d = _f16(W, at + 208, n_mask)  # BLOCK_N
    for h in tl.static_range(2):
        for l16 in tl.static_range(2):  # l = 16·l16 .. 16·l16 + 15
            qh = tl.load(W + at[:, None] + 128 + 32 * h + 16 * l16 + offs[None, :],
                         mask=n_mask[:, None], other=0)  # BLOCK_N, 16
            for j in tl.static_range(2):  # which 32 bytes of the half's ql
                ql = tl.load(W + at[:, None] + 64 * h + 32 * j + 16 * l16 + offs[None, :],
                             mask=n_mask[:, None], other=0)  # BLOCK_N, 16
                for nib in tl.static_range(2):
                    g = 2 * nib + j
                    p = 8 * h + 2 * g + l16  # the sub-block: weights 16·p .. 16·p + 15
                    low = ((ql >> (4 * nib)) & 15).to(tl.int32)
                    top = ((qh >> (2 * g)) & 3).to(tl.int32)
                    q = (low | (top << 4)) - 32  # BLOCK_N, 16
                    scale = tl.load(W + at + 192 + p, mask=n_mask, other=0)
                    scale = scale.to(tl.int8, bitcast=True).to(tl.float32)  # BLOCK_N
                    x = _x_part(X, x_rows, m_mask, start + 16 * p, offs, stride_xk,
                                start + 256, UPCAST)  # BLOCK_M, 16
                    acc += _part_dot(x, q, FMA) * (d * scale)[None, :]
    return acc


# ----------------------------------------------------------------------------- the kernel
@triton.jit
def _ggml_matmul_kernel(
    X, W, P, C, Counts,
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_ps, stride_pm, stride_pn, stride_cm, stride_cn,
    TYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    FMA: tl.constexpr, REDUCE: tl.constexpr,
):
    split = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # BLOCK_M
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N   rows of W
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = offs_m.to(tl.int64) * stride_xm  # BLOCK_M
    w_rows = offs_n.to(tl.int64) * stride_wn  # BLOCK_N   each row's first byte
    lo = split * k_per_split  # k_per_split: whole steps of 256
    hi = tl.minimum(lo + k_per_split, K)  # lo ≥ hi: an empty split, which writes zeros
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(lo, hi, 256):
        if TYPE == 8:  # Q8_0
            acc += _q8_0_step(X, W, x_rows, m_mask, w_rows, n_mask, start, hi, stride_xk,
                              BLOCK_M, BLOCK_N, UPCAST, FMA)
        elif TYPE == 12:  # Q4_K
            acc += _q4_k_step(X, W, x_rows, m_mask, w_rows, n_mask, start, stride_xk,
                              BLOCK_M, BLOCK_N, UPCAST, FMA)
        else:  # 14: Q6_K
            acc += _q6_k_step(X, W, x_rows, m_mask, w_rows, n_mask, start, stride_xk,
                              BLOCK_M, BLOCK_N, UPCAST, FMA)
    p_ptrs = P + split * stride_ps + offs_m[:, None] * stride_pm + offs_n[None, :] * stride_pn
    tl.store(p_ptrs, acc.to(P.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    if REDUCE:  # the tile's last split to finish sums every partial, in split order
        tl.debug_barrier()  # every thread's part of the partial stored before it is counted
        tile = tl.program_id(0)
        arrived = tl.atomic_add(Counts + tile, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:
            reduce_splits(P, C, offs_m, offs_n, m_mask, n_mask, stride_ps, stride_pm, stride_pn,
                           stride_cm, stride_cn, BLOCK_M, BLOCK_N)
            tl.atomic_xchg(Counts + tile, 0)  # ready for the next launch


# ----------------------------------------------------------------------------- the wrappers
def check_ggml_matmul(x: torch.Tensor, packed: torch.Tensor, type_name: str,
                      out_features: int) -> int:
    """Everything the kernel will read, checked; returns K."""
    if type_name not in TYPES:
        raise ValueError(f"ggml_matmul reads {', '.join(TYPES)}, not {type_name!r}")
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be 2-D in one of {DTYPES}, got {x.dtype} {tuple(x.shape)}")
    kind = BLOCK_TYPES[type_name]
    K = x.shape[1]
    if K % kind.block_weights:
        raise ValueError(f"K={K} is not a whole number of {kind.block_weights}-weight "
                         f"{type_name} blocks")
    expected = (out_features, K // kind.block_weights * kind.block_bytes)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != expected:
        raise ValueError(f"packed must be uint8 {expected} for {type_name} [{out_features}, {K}], "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    if packed.shape[1] > 1 and packed.stride(1) != 1:
        raise ValueError(f"packed's rows must be contiguous bytes, got strides {packed.stride()}")
    if packed.device != x.device:
        raise ValueError(f"x is on {x.device} and packed on {packed.device}: they must share one")
    return K


def ggml_kernel_serves(x: torch.Tensor, packed: torch.Tensor, type_name: str) -> bool:
    """Whether `GGMLLinear` calls `ggml_matmul` for these rows: on CUDA, a type read here, x and W
    on one device, fewer than TORCH_MIN_M rows (above them dequantize + cuBLAS)."""
    return (x.is_cuda and packed.device == x.device and type_name in TYPES
            and x.dtype in DTYPES and x.shape[0] < TORCH_MIN_M)


def ggml_matmul(x: torch.Tensor, packed: torch.Tensor, type_name: str, out_features: int, *,
                split_k: int | None = None, fma: bool | None = None) -> torch.Tensor:
    """y [M, out_features] = x [M, K] · Wᵀ, W the GGML blocks `packed`, uint8 [out_features,
    K / block weights · block bytes] (a GGUF tensor's bytes as they lie). x is fp16, bf16 or fp32;
    y has its dtype. M ≤ GEMV_MAX_M: the split-K GEMV (split_k None: `choose_split_k`; fma None:
    multiply-adds for M ≤ FMA_MAX_M); larger M: row tiles with tl.dot (split_k must be None or 1,
    fma not True)."""
    K = check_ggml_matmul(x, packed, type_name, out_features)
    M = x.shape[0]
    gemv = M <= GEMV_MAX_M
    if fma and M > FMA_MAX_M:
        raise ValueError(f"fma=True takes M ≤ {FMA_MAX_M} rows, got M={M}")
    if split_k is not None and (type(split_k) is not int or split_k < 1):
        raise ValueError(f"split_k must be None or an int ≥ 1, got {split_k!r}")
    if not gemv and split_k not in (None, 1):
        raise ValueError(f"split_k > 1 takes M ≤ {GEMV_MAX_M} rows, got M={M}")
    launch = pick("ggml_gemv" if gemv else "ggml_gemm", x.device, x.dtype)
    block_m, block_n = launch.tiles
    if M == 0 or out_features == 0:
        return torch.zeros(M, out_features, dtype=x.dtype, device=x.device)  # M, N
    if fma is None:
        fma = gemv and M <= FMA_MAX_M
    if fma:  # only the real rows, rounded up to a power of two (tl.arange's)
        block_m = triton.next_power_of_2(M)
    if split_k is None:
        split_k = choose_split_k(out_features, K, tiles=(block_m, block_n, STEP)) if gemv else 1
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), STEP) * STEP  # whole steps per split
    tiles_n = triton.cdiv(out_features, block_n)
    out = torch.empty(M, out_features, dtype=x.dtype, device=x.device)  # M, N
    partials, p_strides, counts = split_k_partials(out, split_k, tiles_n)
    _ggml_matmul_kernel[(tiles_n, split_k, triton.cdiv(M, block_m))](
        x, packed, partials, out, counts,
        M, out_features, K, k_per_split,
        *x.stride(), packed.stride(0), *p_strides, *out.stride(),
        TYPE=BLOCK_TYPES[type_name].type_id, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=launch.upcast, FMA=fma, REDUCE=split_k > 1, **launch.options(),
    )
    return out
