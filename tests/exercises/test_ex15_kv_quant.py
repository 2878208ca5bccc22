"""Exercise 15: KV-cache quantization (nanoserve/kv/quant.py: KVQuant.quantize, KVQuant.dequantize).

Oracles: the formats' own definitions — int8 rounds to the nearest step of the stored scale (error ≤
half a step), FP8 keeps every value above its smallest normal within half a unit in the last place
(2^-4 relative for e4m3, 2^-3 for e5m2) — checked per element on K/V with an outlier channel; and
torch's own float8 conversion, which decides the FP8 bits. Known-wrong variants at the end:
truncation instead of rounding, a scale per channel over the tokens (the wrong axis), division by
the unrounded scale, and no clamp.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import nanoserve.kv.quant as reference

REFERENCE = "nanoserve.kv.quant"
EXERCISE = "kv_quant"
pytestmark = pytest.mark.ex15

MIN_NORMAL = {"fp8_e4m3": 2.0 ** -6, "fp8_e5m2": 2.0 ** -14}
REL = {"fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}


def _formats(impl):
    return {name: impl.KVQuant(q.name, q.storage, q.fp8,
                               q.qmax) for name, q in reference.FORMATS.items()}


def _kv(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 4, 64, generator=g) * torch.rand(300, 4, 1, generator=g) * 8
    x[..., 5] *= 25  # an outlier channel
    x[7] = 0.0  # an all-zero token
    return x


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_shapes_and_dtypes(impl):
    x = _kv()
    for name, q in _formats(impl).items():
        codes, scale = q.quantize(x)
        assert codes.shape == x.shape and codes.dtype == q.storage, name
        assert scale.shape == x.shape[:-1] and scale.dtype == torch.float16, name
        assert torch.isfinite(scale).all() and (scale > 0).all(), (
            f"{name}: scales must be finite and > 0"
        )
        y = q.dequantize(codes, scale, torch.float32)
        assert y.dtype == torch.float32 and torch.equal(y[7], torch.zeros_like(y[7])), name
        out = torch.empty_like(y)
        assert q.dequantize(codes, scale, torch.float32, out=out) is out or torch.equal(out, y)


def check_bounds(impl):
    x = _kv()
    for name, q in _formats(impl).items():
        codes, scale = q.quantize(x)
        err = (q.dequantize(codes, scale, torch.float32) - x).abs()
        s = scale.float()[..., None]
        if name == "int8":
            assert (err <= 0.5 * s * (1 + 1e-3)).all(), "int8: more than half a step"
            assert (s <= x.abs().amax(-1, keepdim=True) / 127 * (1 + 1e-3) + 2.0**-14).all(), (
                "int8: scale too big"
            )
        else:
            normal = x.abs() >= MIN_NORMAL[name] * s
            assert (err[normal] <= REL[name] * x.abs()[normal] * (1 + 1e-3)).all(), (
                f"{name}: relative bound"
            )


def check_fp8_bits(impl):
    """The FP8 codes are exactly torch's conversion of x / (stored scale)."""
    x = _kv(1)
    for name, q in _formats(impl).items():
        if q.fp8 is None:
            continue
        codes, scale = q.quantize(x)
        want = (x / scale.float()[..., None]).clamp(-q.qmax, q.qmax).to(q.fp8).view(torch.uint8)
        assert torch.equal(codes, want), name


# ----------------------------------------------------------------------------- the tests
def test_ex15_1_shapes_dtypes_and_a_zero_token(impl):
    check_shapes_and_dtypes(impl)


def test_ex15_1_round_trip_bounds(impl):
    check_bounds(impl)


def test_ex15_2_fp8_codes_are_torchs_conversion(impl):
    check_fp8_bits(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _variant(truncate=False, wrong_axis=False, unrounded=False, no_clamp=False):
    class KVQuant(reference.KVQuant):
        def quantize(self, x):
            amax = (
                x.abs().amax(0, keepdim=True).expand_as(x)[..., 0] if wrong_axis
                else x.abs().amax(-1)
            )
            exact = (amax.float() / self.qmax).clamp(min=2.0 ** -14)
            scale = exact.to(torch.float16)
            y = x.float() / (exact if unrounded else scale.float())[..., None]
            if wrong_axis:  # one scale per (head, channel): stored per element to dequantize at all
                per = (x.abs().amax(0, keepdim=True) / self.qmax).clamp(min=2.0 ** -14)
                y = x / per
                self._per = per
            if not no_clamp:
                y = y.clamp(-self.qmax, self.qmax)
            if self.fp8 is None:
                y = y.trunc() if truncate else y.round()
                return y.clamp(-128, 127).to(torch.int8), scale
            return y.to(self.fp8).view(torch.uint8), scale

        def dequantize(self, q, scale, dtype, out=None):
            values = q.view(self.fp8) if self.fp8 is not None else q
            if wrong_axis:
                return torch.mul(values.to(dtype), self._per.to(dtype), out=out)
            return torch.mul(values.to(dtype), scale.to(dtype)[..., None], out=out)

    return SimpleNamespace(KVQuant=KVQuant)


WRONG = {
    "int8 truncates instead of rounding": (_variant(truncate=True), [check_bounds]),
    "one scale per channel over the tokens": (_variant(wrong_axis=True), [check_bounds]),
    "divides by the unrounded scale": (_variant(unrounded=True), [check_bounds, check_fp8_bits]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex15_known_wrong_variants_fail(name):
    wrong, checks = WRONG[name]
    for check in checks:
        with pytest.raises(AssertionError):
            check(wrong)


def test_ex15_the_checks_pass_on_a_right_variant_built_the_same_way():
    right = _variant()
    for check in (check_shapes_and_dtypes, check_bounds, check_fp8_bits):
        check(right)
