"""8-bit and int4 KV blocks inside the kernels: quantized as `store_kv` writes a token, dequantized
in registers as attention reads a tile.

The formats, and the scale granularity (one fp16 scale per token and kv head, over its D values),
are nanoserve/kv/quant.py's; its `KVQuant.quantize` / `dequantize`, built on torch's own int8 and
float8 dtypes, are the plain-torch reference these functions match bit for bit
(tests/test_kernels_kv_quant.py). A kernel takes `KV_QUANT` as a compile-time constant — NONE (0)
for a pool in the model's dtype, else INT8, E4M3 or E5M2 below — so the unquantized kernel is the
kernel it always was.

**Rounding exactly as torch does.** x / s uses `tl.math.div_rn`, the IEEE-rounded division of
torch's `/` (Triton's plain `/` is an approximate division on a GPU). int8 rounds half to even, as
torch.round: Triton's interpreter has no `rint`, so `rint` below adds and subtracts 1.5·2²³ — a
number whose ulp is 1, so the fp32 adder itself rounds y to an integer (ties to even, the IEEE
default), and the subtraction is exact.

**FP8 without FP8 instructions.** An e5m2 number is the top byte of an fp16 number (the same 5-bit
exponent, bias 15, and 2 of its 10 mantissa bits). An e4m3 number (bias 7, 3 mantissa bits) is an
fp16 number's sign, low 4 exponent bits and top 3 mantissa bits, off by 2⁸ (the biases differ by 8).
So decoding is a shift, a bitcast to fp16 and, for e4m3, × 256: exact, subnormals included, on any
GPU (sm_80 has no FP8 conversion instruction) and in the interpreter. Encoding first rounds y onto
the format's grid: with e = ⌊log₂|y|⌋ read from the fp32 exponent bits (never below the smallest
normal exponent, under which the grid is even: the subnormals), the spacing is 2^(e − mantissa
bits), and rint(y / spacing) · spacing is y rounded to nearest even, a value the format holds
exactly — so the way out through fp16 is exact too. (The interpreter's own fp32 → fp8 cast does not
round to nearest: this path is also what makes the kernels testable on a CPU.)

**int4** (KV_QUANT = INT4, GROUP values per group): a pool row holds D / 2 bytes and D / GROUP
(scale, minimum) pairs; value d is byte d // 2's low nibble (even d) or high nibble (odd d), times
its group's scale, plus its minimum. A tile loads each byte twice (two lanes, one cache line) and
shifts; `store_kv` packs with a reshape to pairs and `tl.split`. Taught in
notebooks/12_kv_cache_quantization.ipynb.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..kv.quant import FORMATS, KV_CACHE_DTYPES, MIN_SCALE
from ..kv.quant import INT4 as INT4_FORMAT

# the kernels' KV_QUANT, by name: the jit code tests these constants, never bare numbers
NONE, INT8, E4M3, E5M2 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
INT4 = tl.constexpr(4)  # two codes a byte, a scale and minimum per GROUP values along head_dim
KV_QUANT_CODES = {"auto": NONE.value, "int8": INT8.value, "fp8_e4m3": E4M3.value,
                  "fp8_e5m2": E5M2.value, "int4": INT4.value}
assert set(KV_QUANT_CODES) == set(KV_CACHE_DTYPES)
# the smallest scale, 2⁻¹⁴ (an all-zero head keeps a normal fp16 scale)
TINY = tl.constexpr(MIN_SCALE)


def kv_quant_code(kv_cache_dtype) -> int:
    """The kernels' KV_QUANT for a `kv_cache_dtype` name."""
    if kv_cache_dtype not in KV_QUANT_CODES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    return KV_QUANT_CODES[kv_cache_dtype]


def kv_bits(kv_cache_dtype) -> int:
    """The bits of a pool's codes (8 or 4; 0 for "auto", K/V in the model's dtype): which launch
    rows its attention takes (kernels/configs.py)."""
    code = kv_quant_code(kv_cache_dtype)
    if code == NONE.value:
        return 0
    return 4 if code == INT4.value else 8


def qmax(kv_cache_dtype: str) -> float:
    """The largest magnitude a quantized pool stores (127, 448, 57344; int4: its top code, 15)."""
    if kv_cache_dtype == INT4_FORMAT.name:
        return INT4_FORMAT.qmax
    return FORMATS[kv_cache_dtype].qmax


def group_size(kv_cache_dtype: str, head_dim: int) -> int:
    """The kernels' GROUP: values per scale of an int4 pool (kv/quant.py); 1 for the others (the
    kernels then never read it)."""
    if kv_cache_dtype == INT4_FORMAT.name:
        return INT4_FORMAT.group(head_dim)
    return 1


@triton.jit
def rint(y):
    """fp32 y rounded to the nearest integer, ties to even (|y| < 2²²)."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _pow2(e):
    """2^e in fp32 for int32 e in −126 .. 127: the exponent field alone."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_grid(y, MANT: tl.constexpr, EMIN: tl.constexpr):
    """fp32 y rounded to the nearest number with MANT mantissa bits and exponent ≥ EMIN, ties to
    even."""
    # ⌊log₂|y|⌋ (a normal y; 0 and subnormals: −127)
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)  # below the smallest normal, the grid's spacing stays 2^(EMIN − MANT)
    return rint(y * _pow2(MANT - e)) * _pow2(e - MANT)


@triton.jit
def fp8_encode(y, KV_QUANT: tl.constexpr):
    """fp32 y, already within the format's range, -> its FP8 bits (uint8), rounded to nearest
    even."""
    # y's sign bit, −0 included (torch keeps it too)
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(y)
    if KV_QUANT == E4M3:  # as fp16 the value · 2⁻⁸; keep its 4 exponent and 3 mantissa bits
        h = (
            (_round_to_grid(a, 3, -6) * 0.00390625) .to(tl.float16) .to(tl.int16, bitcast=True)
            .to(tl.int32)
        )
        bits = sign | ((h >> 7) & 0x7F)
    else:  # e5m2: the fp16 number's top byte
        h = _round_to_grid(a, 2, -14).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        bits = sign | ((h >> 8) & 0x7F)
    return bits.to(tl.uint8)


@triton.jit
def fp8_decode(bits, KV_QUANT: tl.constexpr):
    """FP8 bits (uint8) -> their value in fp32, exactly."""
    b = bits.to(tl.int32)
    # sign to bit 15, exponent and mantissa to bits 13..7 of an fp16, then · 2⁸
    if KV_QUANT == E4M3:
        h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        x = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:  # e5m2: the top byte of an fp16
        x = (b << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return x


@triton.jit
def quantize_rows(x, KV_QUANT: tl.constexpr, QMAX: tl.constexpr):
    """x [R, D] fp32 (padding columns 0) -> codes [R, D] (int8, or FP8 bits in uint8) and scales [R]
    (fp16).

    kv/quant.py's `quantize`: s = max(max|x| / QMAX, 2⁻¹⁴) rounded to fp16, codes = x / s
    rounded."""
    amax = tl.max(tl.abs(x), axis=1)  # R
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), TINY).to(
        tl.float16
    )  # R
    y = tl.math.div_rn(x, scale.to(tl.float32)[:, None])  # R, D
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if KV_QUANT == INT8:
        codes = rint(y).to(tl.int8)
    else:
        codes = fp8_encode(y, KV_QUANT)
    return codes, scale


@triton.jit
def quantize_int4_rows(x, GROUP: tl.constexpr):
    """x [R, D] fp32 (padding columns 0, D a multiple of GROUP) -> packed codes [R, D / 2] (uint8:
    value 2j in byte j's low nibble, 2j + 1 in its high one) and scales [R, 2 · D / GROUP] (fp16:
    group g's scale at 2g, its minimum at 2g + 1).

    kv/quant.py's `KVQuantInt4.quantize`: per group m = fp16(min x), s = fp16(max((max x − m) / 15,
    2⁻¹⁴)), code = rint((x − m) / s) clamped to 0 .. 15."""
    R: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    groups = tl.reshape(x, (R, D // GROUP, GROUP))  # R, D/G, G
    low = tl.minimum(tl.maximum(tl.min(groups, axis=2), -65504.0), 65504.0).to(tl.float16)
    span = tl.max(groups, axis=2) - low.to(tl.float32)  # R, D/G
    scale = tl.maximum(tl.math.div_rn(span, tl.full(span.shape, 15.0, tl.float32)), TINY).to(
        tl.float16
    )  # R, D/G
    y = tl.math.div_rn(groups - low.to(tl.float32)[:, :, None], scale.to(tl.float32)[:, :, None])
    nibbles = rint(tl.minimum(tl.maximum(y, 0.0), 15.0)).to(tl.int32)  # R, D/G, G
    even, odd = tl.split(tl.reshape(nibbles, (R, D // 2, 2)))  # R, D/2 each: values 2j and 2j + 1
    scales = tl.reshape(tl.join(scale, low), (R, 2 * (D // GROUP)))  # R, 2·D/G
    return (even | (odd << 4)).to(tl.uint8), scales


@triton.jit
def code_column(d, KV_QUANT: tl.constexpr):
    """Where value d of a head sits in its stored row: d, or byte d // 2 for int4."""
    if KV_QUANT == INT4:
        d = d // 2
    return d


@triton.jit
def scale_index(token_head, d, n_groups, KV_QUANT: tl.constexpr, GROUP: tl.constexpr):
    """The index of value d's scale, for a token's head at scale row `token_head` (slot · Hkv + kv
    head): that row (8-bit), or its group's (scale, minimum) pair among 2 · n_groups (int4)."""
    if KV_QUANT == INT4:
        token_head = token_head * (2 * n_groups) + (d // GROUP) * 2
    return token_head


@triton.jit
def load_kv_tile(ptrs, mask, scale_ptrs, scale_mask, d, KV_QUANT: tl.constexpr,
                 dtype: tl.constexpr):
    """A tile of K or V from a pool, in `dtype`: as stored (KV_QUANT 0), or its codes dequantized
    here, in registers, as kv/quant.py's `dequantize` in `dtype`. 8-bit: codes · scale, one scale
    per token (scale_ptrs broadcast against ptrs). int4 (`code_column`, `scale_index`): ptrs at
    byte d // 2, value d its low nibble for even d and high for odd, scale_ptrs at its group's
    scale, the minimum beside it: code · scale + minimum. Masked positions read 0."""
    x = tl.load(ptrs, mask=mask, other=0)
    if KV_QUANT == INT4:  # a scale and minimum per value, masked as the codes
        scale = tl.load(scale_ptrs, mask=mask, other=0.0).to(dtype)
        low = tl.load(scale_ptrs + 1, mask=mask, other=0.0).to(dtype)
        nibble = (x.to(tl.int32) >> ((d % 2) * 4)) & 15
        x = nibble.to(tl.float32).to(dtype) * scale + low
    elif KV_QUANT != NONE:
        scale = tl.load(scale_ptrs, mask=scale_mask, other=0.0)
        if KV_QUANT == INT8:
            values = x.to(tl.float32)
        else:
            values = fp8_decode(x, KV_QUANT)
        x = values.to(dtype) * scale.to(dtype)
    return x
