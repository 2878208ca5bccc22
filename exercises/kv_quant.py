"""Exercise 15: quantize a KV block to 8 bits with a scale per token and head, and back; then to 4
bits, two codes a byte, with a scale and a minimum per group.

Your versions of KVQuant.quantize, KVQuant.dequantize and KVQuantInt4.quantize from
nanoserve/kv/quant.py, with the same names and signatures. Each class inherits nanoserve's, so
`self.storage` (torch.int8, or torch.uint8 holding FP8 bits), `self.fp8` (None for int8, else
torch.float8_e4m3fn / torch.float8_e5m2) and `self.qmax` (127, 448 or 57344) are given, and
SCALE_DTYPE (fp16) is imported below; KVQuantInt4 gives `self.group(D)` (values per group) and
`self.qmax` (15). Taught in notebooks/12_kv_cache_quantization.ipynb, sections 2 and 3. Check your
work with

    make exercises EX=ex15        # or: .venv/bin/pytest tests/exercises -m ex15 --impl exercises
"""

from __future__ import annotations

import torch

import nanoserve.kv.quant
from nanoserve.kv.quant import FP16_MAX, MIN_SCALE, SCALE_DTYPE  # noqa: F401  (fp16's range)


class KVQuant(nanoserve.kv.quant.KVQuant):
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> (q [..., D] in self.storage, scale [...] in SCALE_DTYPE) with x ≈ q ·
        scale.

        One scale per row of D values: max|x| / qmax, stored in fp16 and never below 2^-14 (an
        all-zero row must not divide by 0). Divide by the *stored* (fp16-rounded) scale, so that q ·
        scale is what dequantize gives back. int8: round to nearest, clamp to [-127, 127]. FP8:
        clamp to [-qmax, qmax], convert to self.fp8, and return its bits viewed as uint8."""
        raise NotImplementedError(
            "Exercise 15.1: one scale per token and head, so that its largest value maps to the "
            "format's largest code; the scale stored in fp16 (roughly 6 lines; see "
            "notebooks/12_kv_cache_quantization, section 2, 'Per token and head'; more: make hint "
            "EX=ex15 N=2)")

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """q [..., D], scale [...] -> q · scale in `dtype` (written into `out` when it is given).
        FP8 codes arrive as uint8: view them as self.fp8 first."""
        raise NotImplementedError(
            "Exercise 15.2: each code times its token's scale, in the attention's dtype (roughly 3 "
            "lines; see notebooks/12_kv_cache_quantization, section 2, 'Per token and head'; more: "
            "make hint EX=ex15 N=2)")


class KVQuantInt4(nanoserve.kv.quant.KVQuantInt4):
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> (packed codes [..., D / 2] uint8, scales [..., 2 · D / group] fp16).

        Per group of G = self.group(D) consecutive values: the minimum m, stored in fp16 (clamped
        to ±FP16_MAX), and the scale s = (max − m) / 15, never below MIN_SCALE, stored in fp16;
        codes round((x − m) / s) in float32 with the *stored* m and s, clamped to 0 .. 15. Value 2j
        goes to the low four bits of byte j, value 2j + 1 to the high four; the scales hold s, m of
        group 0, then s, m of group 1, and so on."""
        raise NotImplementedError(
            "Exercise 15.3: a minimum and a scale per group of values, codes 0 .. 15 from the "
            "stored (fp16) pair, two codes a byte, low nibble first (roughly 9 lines; see "
            "notebooks/12_kv_cache_quantization, section 3, 'int4: two codes per byte'; more: make "
            "hint EX=ex15 N=2)")
