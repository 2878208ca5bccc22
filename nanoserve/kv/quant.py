"""KV-cache quantization: the paged pool stores K and V in 8 bits, with a scale per token and head.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import KV_CACHE_DTYPES
from ..errors import NanoserveError

SCALE_DTYPE = torch.float16  # one per (token, head)
# fp16's smallest normal: scales never underflow to 0 (an all-zero head stays 0)
MIN_SCALE = 2.0 ** -14


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


FORMATS = {"int8": KVQuant("int8", torch.int8, None, 127.0),
           "fp8_e4m3": KVQuant("fp8_e4m3", torch.uint8, torch.float8_e4m3fn, 448.0),
           "fp8_e5m2": KVQuant("fp8_e5m2", torch.uint8, torch.float8_e5m2, 57344.0)}


def kv_quant(kv_cache_dtype: str) -> KVQuant | None:
    """The format for a `kv_cache_dtype` name; None for "auto" (the model's dtype, unquantized)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise NanoserveError(f"kv_cache_dtype={kv_cache_dtype!r}; allowed: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
    return FORMATS.get(kv_cache_dtype)


def kv_element_bytes(kv_cache_dtype: str, head_dim: int) -> float:
    """Bytes one quantized K (or V) value costs in the pool, its share of the scale included (K/V in
    the model's dtype, "auto": kv/cache.py's kv_element_bytes)."""
    quant = FORMATS[kv_cache_dtype]
    return quant.storage.itemsize + SCALE_DTYPE.itemsize / head_dim
