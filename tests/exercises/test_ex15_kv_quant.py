"""Exercise 15: KV-cache quantization (nanoserve/kv/quant.py: KVQuant.quantize, KVQuant.dequantize,
KVQuantInt4.quantize).

Oracles: the formats' own definitions — int8 rounds to the nearest step of the stored scale (error ≤
half a step), FP8 keeps every value above its smallest normal within half a unit in the last place
(2^-4 relative for e4m3, 2^-3 for e5m2) — checked per element on K/V with an outlier channel; and
torch's own float8 conversion, which decides the FP8 bits. Known-wrong variants at the end:
truncation instead of rounding, a scale per channel over the tokens (the wrong axis), division by
the unrounded scale, and no clamp. int4 (15.3): a group worked by hand, and the definition written
out one value at a time in Python floats; known-wrong: the nibbles in the other order, a symmetric
scale (absmax / 7, no minimum), division by the unrounded scale, the scale and minimum swapped.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from explain import expect, explained_failure

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
def _at(t: torch.Tensor) -> list[int]:
    """The index of t's largest element."""
    return [int(i) for i in torch.unravel_index(t.argmax(), t.shape)]


def check_shapes_and_dtypes(impl):
    x = _kv()
    for name, q in _formats(impl).items():
        codes, scale = q.quantize(x)
        case = f"{name}: quantize(a K/V block {tuple(x.shape)})"
        expect(codes.shape == x.shape and codes.dtype == q.storage, f"{case}: the codes",
               f"shape {tuple(x.shape)}, {q.storage}", (tuple(codes.shape), codes.dtype))
        expect(scale.shape == x.shape[:-1] and scale.dtype == torch.float16, f"{case}: the scales",
               f"shape {tuple(x.shape[:-1])}, torch.float16", (tuple(scale.shape), scale.dtype))
        expect(bool(torch.isfinite(scale).all() and (scale > 0).all()), f"{case}: the scales",
               "finite and > 0 (token 7 is all zeros)", f"min {float(scale.float().min()):.3g}")
        y = q.dequantize(codes, scale, torch.float32)
        expect(y.dtype == torch.float32, f"{name}: dequantize(..., float32)", torch.float32,
               y.dtype)
        expect(torch.equal(y[7], torch.zeros_like(y[7])), f"{name}: token 7 (all zeros) back",
               "zeros", f"values up to {float(y[7].abs().max()):.3g}")
        out = torch.empty_like(y)
        written = q.dequantize(codes, scale, torch.float32, out=out)
        expect(written is out or torch.equal(out, y), f"{name}: dequantize(..., out=out)",
               "the values written into out", "out left as it was")


def check_bounds(impl):
    x = _kv()
    for name, q in _formats(impl).items():
        codes, scale = q.quantize(x)
        err = (q.dequantize(codes, scale, torch.float32) - x).abs()
        s = scale.float()[..., None]
        case = f"{name}: dequantize(quantize(x)) on a K/V block {tuple(x.shape)}"
        if name == "int8":
            ratio = err / (0.5 * s)
            worst = _at(ratio)
            expect(bool((ratio <= 1 + 1e-3).all()), f"{case}: |error| / half a step",
                   "≤ 1 everywhere (rounding to the nearest code)",
                   f"{float(ratio.max()):.3g} at [token, head, d] = {worst}")
            biggest = x.abs().amax(-1, keepdim=True) / 127
            over = s / (biggest + 2.0**-14)
            expect(bool((s <= biggest * (1 + 1e-3) + 2.0**-14).all()), f"{case}: the scale",
                   "at most max|x| / 127 of its token and head", f"{float(over.max()):.3g}× that")
        else:
            normal = x.abs() >= MIN_NORMAL[name] * s
            ratio = (err / (REL[name] * x.abs())).masked_fill(~normal, 0)
            expect(bool((ratio <= 1 + 1e-3).all()), f"{case}: |error| / (its relative bound "
                   f"{REL[name]} × |x|)", "≤ 1 wherever x is normal in the format",
                   f"{float(ratio.max()):.3g} at [token, head, d] = {_at(ratio)}")


def check_fp8_bits(impl):
    """The FP8 codes are exactly torch's conversion of x / (stored scale)."""
    x = _kv(1)
    for name, q in _formats(impl).items():
        if q.fp8 is None:
            continue
        codes, scale = q.quantize(x)
        want = (x / scale.float()[..., None]).clamp(-q.qmax, q.qmax).to(q.fp8).view(torch.uint8)
        differ = (codes != want).nonzero()
        if len(differ):
            at = differ[0].tolist()
            raise AssertionError(
                f"{name}: quantize(x): the codes against torch's conversion of x / (stored scale): "
                f"{len(differ)} differ, the first at [token, head, d] = {at}: expected "
                f"0x{int(want[tuple(at)]):02x}, got 0x{int(codes[tuple(at)]):02x}")


def _int4_by_definition(x: torch.Tensor, group: int) -> tuple[list[int], list[float]]:
    """One row of D values: its bytes and its (s, m) pairs, one value at a time in Python floats
    (fp16 rounding through torch, the division in float32 as the format defines it)."""
    codes, pairs = [], []
    for g in range(x.numel() // group):
        values = x[g * group:(g + 1) * group].float()
        m = values.min().clamp(-65504.0, 65504.0).to(torch.float16)
        s = ((values.max() - m.float()) / 15).clamp(min=2.0 ** -14).to(torch.float16)
        pairs += [float(s), float(m)]
        codes += [min(max(round(float(v)), 0), 15) for v in (values - m.float()) / s.float()]
    return [lo + 16 * hi for lo, hi in zip(codes[0::2], codes[1::2])], pairs


def check_int4_by_hand(impl):
    """[-1, 0, 0.5, 2] (one group of 4): m = -1, s = fp16(3 / 15) = 0.199951171875; codes
    round([0, 5.0012, 7.5018, 15.0037]) = [0, 5, 8, 15]; bytes [0 + 16·5, 8 + 16·15] = [80, 248]."""
    x = torch.tensor([[-1.0, 0.0, 0.5, 2.0]])
    packed, scales = impl.KVQuantInt4("int4").quantize(x)
    case = "int4: quantize([[-1, 0, 0.5, 2]]) (one group of 4)"
    expect(packed.dtype == torch.uint8 and packed.tolist() == [[80, 248]], f"{case}: the bytes",
           "uint8 [[80, 248]] (codes 0, 5, 8, 15; value 2j in the low nibble)",
           (packed.dtype, packed.tolist()))
    expect(scales.dtype == torch.float16 and scales.tolist() == [[0.199951171875, -1.0]],
           f"{case}: the scales", "fp16 [[0.199951171875, -1.0]] (s = fp16(3 / 15), then m)",
           (scales.dtype, scales.tolist()))


def check_int4_definition(impl):
    q = impl.KVQuantInt4("int4")
    for D in (64, 128, 24):
        x = _kv(2)[:12, :, :D] if D <= 64 else torch.cat([_kv(2)[:12], _kv(3)[:12]], -1)
        packed, scales = q.quantize(x)
        G = q.group(D)
        case = f"int4: quantize(K/V {tuple(x.shape)}) (groups of {G})"
        expect(packed.shape == (*x.shape[:-1], D // 2) and scales.shape ==
               (*x.shape[:-1], 2 * D // G), f"{case}: the shapes",
               ((*x.shape[:-1], D // 2), (*x.shape[:-1], 2 * D // G)),
               (tuple(packed.shape), tuple(scales.shape)))
        rows, pk, sc = x.reshape(-1, D), packed.reshape(-1, D // 2), scales.reshape(-1, 2 * D // G)
        for r in range(rows.shape[0]):
            want_bytes, want_pairs = _int4_by_definition(rows[r], G)
            got_bytes, got_pairs = pk[r].tolist(), sc[r].float().tolist()
            if got_bytes != want_bytes or got_pairs != want_pairs:
                j = next((i for i, (a, b) in enumerate(zip(got_bytes, want_bytes)) if a != b), None)
                where = (f"byte {j}: expected {want_bytes[j]} (codes {want_bytes[j] % 16}, "
                         f"{want_bytes[j] // 16}), got {got_bytes[j]}" if j is not None else
                         f"(s, m) pairs: expected {want_pairs[:4]}..., got {got_pairs[:4]}...")
                raise AssertionError(f"{case}: row {r} differs from the definition at {where}")


# ----------------------------------------------------------------------------- the tests
def test_ex15_1_shapes_dtypes_and_a_zero_token(impl):
    check_shapes_and_dtypes(impl)


def test_ex15_1_round_trip_bounds(impl):
    check_bounds(impl)


def test_ex15_2_fp8_codes_are_torchs_conversion(impl):
    check_fp8_bits(impl)


def test_ex15_3_int4_a_group_by_hand(impl):
    check_int4_by_hand(impl)


def test_ex15_3_int4_equals_its_definition(impl):
    check_int4_definition(impl)


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


def _int4_variant(swap_nibbles=False, symmetric=False, unrounded=False, pairs_swapped=False):
    class KVQuantInt4(reference.KVQuantInt4):
        def quantize(self, x):
            D = x.shape[-1]
            groups = x.float().unflatten(-1, (D // self.group(D), self.group(D)))
            if symmetric:
                exact = (groups.abs().amax(-1) / 7).clamp(min=2.0 ** -14)
                low = -exact * 8
            else:
                low = groups.amin(-1)
                exact = ((groups.amax(-1) - low.half().float()) / 15).clamp(min=2.0 ** -14)
            scale, low = exact.half(), low.half()
            step = exact if unrounded else scale.float()
            y = (groups - low.float()[..., None]) / step[..., None]
            nib = y.round().clamp(0, 15).to(torch.uint8).flatten(-2)
            first, second = (nib[..., 1::2], nib[..., 0::2]) if swap_nibbles else (
                nib[..., 0::2], nib[..., 1::2])
            pair = (low, scale) if pairs_swapped else (scale, low)
            return first | (second << 4), torch.stack(pair, -1).flatten(-2)

    return SimpleNamespace(KVQuantInt4=KVQuantInt4)


WRONG = {
    "int8 truncates instead of rounding": (_variant(truncate=True), [check_bounds]),
    "one scale per channel over the tokens": (_variant(wrong_axis=True), [check_bounds]),
    "divides by the unrounded scale": (_variant(unrounded=True), [check_bounds, check_fp8_bits]),
    "int4: the nibbles in the other order": (_int4_variant(swap_nibbles=True),
                                             [check_int4_by_hand, check_int4_definition]),
    "int4: a symmetric scale, no minimum": (_int4_variant(symmetric=True),
                                            [check_int4_by_hand, check_int4_definition]),
    "int4: divides by the unrounded scale": (_int4_variant(unrounded=True),
                                             [check_int4_definition]),
    "int4: the minimum stored before the scale": (_int4_variant(pairs_swapped=True),
                                                  [check_int4_by_hand, check_int4_definition]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex15_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex15_the_checks_pass_on_a_right_variant_built_the_same_way():
    right = _variant()
    for check in (check_shapes_and_dtypes, check_bounds, check_fp8_bits):
        check(right)
    for check in (check_int4_by_hand, check_int4_definition):
        check(_int4_variant())
