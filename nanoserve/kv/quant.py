"""KV-cache quantization: the paged pool stores K and V in 8 bits with a scale per token and head,
or in 4 bits with a scale and a minimum per group of 64 values.

`kv_cache_dtype` (vLLM's names): "auto" keeps the model's dtype; "int8" stores round(x / s) in
[-127, 127] with s = max|x| / 127; "fp8_e4m3" and "fp8_e5m2" store x / s as an 8-bit float with
s = max|x| / (the format's largest value: 448 and 57344). Quantization happens when a token's K/V is
written (`quantize`), dequantization when attention reads it (`dequantize`).

**Granularity: one scale per (token, head), over the head's D values.** K has outlier *channels* —
a few of the D dimensions are much larger than the rest, in every token — so a scale per channel
would fit K best; but a channel scale must be fixed before the tokens that share it are written,
and a paged cache writes one token at a time. A scale per token and head is computed from that
token alone at write time, needs no calibration, and keeps a token's error independent of the
others; the outlier channels cost precision in their own token only. Stored in fp16, a scale adds 2
bytes per D = 64 or 128 values: the pool holds 2D / (D + 2) ≈ 1.94× (D = 64) the tokens of an fp16
pool, ~3.9× of fp32. vLLM's FP8 cache uses one scale per tensor, calibrated offline (`k_scale` in
checkpoints) or 1.0; FP8 has an exponent, so it tolerates that, but a per-token scale needs no
calibration and costs the same code path as int8 — one path in both backends. Round-trip bounds
(tests/test_kv_quant.py): int8 |error| ≤ s / 2 = max|x| / 254 per element; FP8 a relative error ≤
2^-4 (e4m3) or 2^-3 (e5m2) of each value above the format's subnormal range. Taught in
notebooks/12_*.

**int4** (`KVQuantInt4`): two 4-bit codes per byte, value 2j in the low nibble of byte j and 2j + 1
in the high one. Four bits cannot hold a head with an outlier channel under one scale — the other
channels would round to 0 — so the scale follows a *group* of 64 consecutive values along head_dim
(fewer when head_dim is not a multiple of 64: the largest power of two dividing it, e.g. 8 at D =
8, where int4 takes 8 bits a value against int8's 10: 1.25×, not 3.56×). Asymmetric: per group an
fp16 minimum m and an fp16 scale s = (max − m) / 15, code = round((x − m) / s) in 0 .. 15, x ≈ code
· s + m. Scale and minimum, 4 bytes per 64 values, cost 4 + 32/64 = 4.5 bits a value: 16 / 4.5 ≈
3.56× the tokens of a bf16 pool. Why asymmetric groups of 64 rather than symmetric groups of 32
(one fp16 scale, codes −7 .. 7, the same 4.5 bits): measured on the demo model, the asymmetric
code's error on real K/V is lower (its perplexity differs from the symmetric code's by less than
the text resolves: benchmarks/RESULTS.md, "int4 KV cache") — a group's values are rarely centred on
0, and the minimum spends all 16 levels on the group's own range. Round-trip bound: |error| ≤ s / 2
per element, plus the fp16 rounding of m. """

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import KV_CACHE_DTYPES
from ..errors import NanoserveError

SCALE_DTYPE = torch.float16  # one per (token, head)
# fp16's smallest normal: scales never underflow to 0 (an all-zero head stays 0)
MIN_SCALE = 2.0 ** -14
FP16_MAX = 65504.0  # int4's fp16 minima are clamped into range


@dataclass(frozen=True)
class KVQuant:
    """One quantized storage format: what the pool holds, and how to get there and back."""

    name: str
    storage: (
        torch.dtype
    )  # the pool's dtype: int8, or uint8 holding FP8 bits (CPU torch cannot scatter float8)
    fp8: torch.dtype | None  # the FP8 format the bits are, if any
    qmax: float  # the largest magnitude stored

    @property
    def scale_dtype(self) -> torch.dtype:
        """The scales' dtype (SCALE_DTYPE): one per token and head."""
        return SCALE_DTYPE

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> (q [..., D] in `storage`, scale [...] fp16) with x ≈ q · scale."""
        scale = (x.abs().amax(-1).float() / self.qmax).clamp(min=MIN_SCALE).to(SCALE_DTYPE)  # ...
        y = x.float() / scale.float()[..., None]  # ..., D   in [-qmax, qmax]
        if self.fp8 is None:
            return y.round().clamp(-self.qmax, self.qmax).to(torch.int8), scale
        return y.clamp(-self.qmax, self.qmax).to(self.fp8).view(torch.uint8), scale

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """q [..., D], scale [...] -> q · scale in `dtype` (into `out` when given)."""
        values = q.view(self.fp8) if self.fp8 is not None else q
        return torch.mul(values.to(dtype), scale.to(dtype)[..., None], out=out)

    def pool_shapes(self, shape: tuple) -> tuple[tuple, tuple]:
        """K/V of `shape` [..., D] -> the shapes of their codes [..., D] and scales [...]."""
        return tuple(shape), tuple(shape[:-1])


@dataclass(frozen=True)
class KVQuantInt4:
    """4-bit K/V: two codes per byte; per group of values along head_dim an fp16 scale and an fp16
    minimum, side by side (module docstring). The same interface as KVQuant."""

    name: str
    group_size: int = 64  # values per group, at most: head_dim's largest power-of-two divisor ≤ it
    storage: torch.dtype = torch.uint8  # two codes per byte
    qmax: float = 15.0  # codes 0 .. 15: x ≈ code · scale + minimum

    @property
    def scale_dtype(self) -> torch.dtype:
        return SCALE_DTYPE

    def group(self, head_dim: int) -> int:
        """Values per group for this head_dim: the largest power of two ≤ group_size dividing it."""
        if head_dim % 2:
            raise NanoserveError(f"kv_cache_dtype={self.name!r} packs two values per byte: "
                                 f"head_dim must be even, got {head_dim}")
        return math.gcd(head_dim, self.group_size)

    def pool_shapes(self, shape: tuple) -> tuple[tuple, tuple]:
        """K/V of `shape` [..., D] -> codes [..., D / 2] (bytes) and scales [..., 2 · D / group]
        (scale, minimum of group g at 2g, 2g + 1)."""
        D = shape[-1]
        return (*shape[:-1], D // 2), (*shape[:-1], 2 * (D // self.group(D)))

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> (packed codes [..., D / 2] uint8, scales [..., 2 · D / group] fp16)."""
        D = x.shape[-1]
        G = self.group(D)
        groups = x.float().unflatten(-1, (D // G, G))  # ..., D/G, G
        low = groups.amin(-1).clamp(-FP16_MAX, FP16_MAX).to(SCALE_DTYPE)  # ..., D/G
        span = groups.amax(-1) - low.float()  # ..., D/G
        scale = (span / self.qmax).clamp(min=MIN_SCALE).to(SCALE_DTYPE)  # ..., D/G
        y = (groups - low.float()[..., None]) / scale.float()[..., None]  # ..., D/G, G  in [0, 15]
        nibbles = y.round().clamp(0, self.qmax).to(torch.uint8).flatten(-2)  # ..., D
        return pack_nibbles(nibbles), torch.stack((scale, low), -1).flatten(-2)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """q [..., D / 2], scales [..., 2 · D / group] -> code · scale + minimum, [..., D] in
        `dtype` (into `out` when given)."""
        pairs = scale.unflatten(-1, (-1, 2)).to(dtype)  # ..., D/G, 2   (scale, minimum)
        codes = unpack_nibbles(q).unflatten(-1, (pairs.shape[-2], -1))  # ..., D/G, G
        if out is not None:
            out = out.unflatten(-1, codes.shape[-2:])
        deq = torch.mul(codes.to(dtype), pairs[..., :1], out=out)  # ..., D/G, G
        return deq.add_(pairs[..., 1:]).flatten(-2)


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [..., D] -> bytes [..., D / 2]: value 2j low nibble, 2j + 1 high."""
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., D / 2] -> uint8 values 0..15 [..., D] (pack_nibbles undone)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


FORMATS = {"int8": KVQuant("int8", torch.int8, None, 127.0),
           "fp8_e4m3": KVQuant("fp8_e4m3", torch.uint8, torch.float8_e4m3fn, 448.0),
           "fp8_e5m2": KVQuant("fp8_e5m2", torch.uint8, torch.float8_e5m2, 57344.0)}


INT4 = KVQuantInt4("int4")


def kv_quant(kv_cache_dtype: str) -> KVQuant | KVQuantInt4 | None:
    """The format for a `kv_cache_dtype` name; None for "auto" (the model's dtype, unquantized)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise NanoserveError(f"kv_cache_dtype={kv_cache_dtype!r}; allowed: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == INT4.name:
        return INT4
    return FORMATS.get(kv_cache_dtype)


def kv_element_bytes(kv_cache_dtype: str, head_dim: int) -> float:
    """Bytes one quantized K (or V) value costs in the pool, its share of the scale included (K/V in
    the model's dtype, "auto": kv/cache.py's kv_element_bytes). int4: half a byte, and a scale and a
    minimum (4 bytes) per group."""
    if kv_cache_dtype == INT4.name:  # what its pool_shapes allocate, per value
        codes, scales = INT4.pool_shapes((head_dim,))
        return (codes[0] + scales[0] * SCALE_DTYPE.itemsize) / head_dim
    quant = FORMATS[kv_cache_dtype]
    return quant.storage.itemsize + SCALE_DTYPE.itemsize / head_dim
