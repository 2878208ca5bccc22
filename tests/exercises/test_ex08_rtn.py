"""Exercise 8: RTN quantize / dequantize (nanoserve/quant/rtn.py: quant_params, round_to_codes,
quantize_rtn, QuantizedWeight.dequantize).

Oracles: grids, codes and dequantized weights worked out by hand on tiny tensors (asymmetric and
symmetric, a group of zeros, groups with no negative or no positive value, int8 per channel, int4
and int3 group-wise, a permuted g_idx), and the bound |w − ŵ| ≤ scale / 2 that rounding to the
nearest point of a grid containing the group's range must meet. Hand values avoid exact rounding
ties except where every tie-breaking rule gives the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from explain import expect, expect_close, expect_equal, explained_failure

REFERENCE = "nanoserve.quant.rtn"
EXERCISE = "rtn"
pytestmark = pytest.mark.ex08

ROWS = [[-1.0, 0.25, 0.5, 2.0],    # mixed signs
        [0.5, 1.0, 2.0, 1.5],      # no negative value: the range is widened down to 0
        [-3.0, -1.0, -0.5, -2.0],  # no positive value: widened up to 0
        [0.0, 0.0, 0.0, 0.0],      # all zeros: range [−1, 1], never a zero scale
        # −xmin / scale = 8.75: the zero point must be rounded, not truncated
        [-0.7, 0.1, 0.3, 0.5]]


def _close(a, b):
    return torch.allclose(a, torch.tensor(b, dtype=a.dtype), rtol=1e-6, atol=0)


def _expect_scales(scales, want, case):
    expect_close(scales, torch.tensor(want, dtype=scales.dtype), f"{case}: the scales", atol=0,
                 rtol=1e-6)


def _expect_list(got, want, case):
    expect(got == want, case, want, got)


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_grid_by_hand(impl):
    w = torch.tensor(ROWS)                                                     # 5 groups of 4
    case = f"quant_params(groups {ROWS}, bits=4, sym=False)"
    scales, zeros = impl.quant_params(w, bits=4, sym=False)
    expect((scales.dtype, zeros.dtype) == (torch.float32, torch.int32), case,
           "float32 scales and int32 zeros", (scales.dtype, zeros.dtype))
    # asymmetric: scale = (xmax − xmin) / 15, zero = round(−xmin / scale)
    _expect_scales(scales, [3 / 15, 2 / 15, 3 / 15, 2 / 15, 1.2 / 15], case)
    # the zero group's −xmin / scale = 1 / (2/15) = 7.5 exactly, which fp32 computes as 7.4999995: 7
    # or 8 is right
    got = zeros.tolist()
    expect(got[:3] + got[4:] == [5, 0, 15, 9] and got[3] in (7, 8), f"{case}: the zeros",
           "[5, 0, 15, 7 or 8, 9]", got)
    # symmetric: scale = 2·amax / 15, zero 8 for every group
    case = case.replace("sym=False", "sym=True")
    scales, zeros = impl.quant_params(w, bits=4, sym=True)
    _expect_scales(scales, [4 / 15, 4 / 15, 6 / 15, 2 / 15, 1.4 / 15], case)
    _expect_list(zeros.tolist(), [8] * 5, f"{case}: the zeros")
    # other widths, fp64 stays fp64: int8 (zero 128 when symmetric), int3 (zero 4), int2
    w = torch.tensor([[-1.0, 0.0, 1.55, 0.3]], dtype=torch.float64)
    for bits, sym, scale, zero in [(8, False, 2.55 / 255, 100), (8, True, 3.1 / 255, 128),
                                   (3, False, 2.55 / 7, 3),
                                   (3, True, 3.1 / 7, 4), (2, False, 2.55 / 3, 1),
                                   (2, True, 3.1 / 3, 2)]:
        scales, zeros = impl.quant_params(w, bits, sym)
        case = f"quant_params(float64 [[-1, 0, 1.55, 0.3]], bits={bits}, sym={sym})"
        expect(scales.dtype == torch.float64, case, "float64 scales", scales.dtype)
        _expect_scales(scales, [scale], case)
        _expect_list(zeros.tolist(), [zero], f"{case}: the zero")


def check_round_to_codes_by_hand(impl):
    rows = [[-1.3, -0.2, 0.0, 0.3, 0.62, 5.0],
            [0.0, 0.2, 0.8, 1.1, 3.0, -0.4]]                                  # 2 rows, 6 columns
    w = torch.tensor(rows)
    scales, zeros = torch.tensor([0.25, 0.5]), torch.tensor([4, 0], dtype=torch.int32)
    codes = impl.round_to_codes(w, scales, zeros, 15)
    case = f"round_to_codes({rows}, scales [0.25, 0.5], zeros [4, 0], maxq"
    # row 0: w / 0.25 = −5.2, −0.8, 0, 1.2, 2.48, 20 -> round + 4, clamped to [0, 15]
    # row 1: w / 0.5 = 0, 0.4, 1.6, 2.2, 6, −0.8 -> round + 0, clamped
    expect(codes.dtype == torch.float32, f"{case} 15)", "float32 codes", codes.dtype)
    expect_equal(codes, torch.tensor([[0.0, 3, 4, 5, 6, 15], [0, 0, 2, 2, 6, 0]]), f"{case} 15)")
    # maxq is the top
    _expect_list(impl.round_to_codes(w, scales, zeros, 7)[0].tolist(), [0, 3, 4, 5, 6, 7],
                 f"{case} 7), row 0")


def check_quantize_rtn_by_hand(impl):
    rows = [[-0.9, 0.25, 0.45, 2.0, 0.5, 0.9, 2.0, 1.5],
            [0.0, 0.0, 0.0, 0.0, -0.7, 0.1, 0.3, 0.8]]  # N 2, K 8, groups of 4
    w = torch.tensor(rows)
    # asymmetric: group (0, 0) scale 2.9/15, zero round(0.9 / scale) = round(4.66) = 5, codes
    # round(w / scale) + 5
    q = impl.quantize_rtn(w, bits=4, group_size=4, sym=False)
    case = f"quantize_rtn({rows}, bits=4, group_size=4, sym=False)"
    # your class, so your dequantize
    expect(isinstance(q, impl.QuantizedWeight), case, "a QuantizedWeight", type(q).__name__)
    expect((q.bits, q.group_size, q.sym) == (4, 4, False), f"{case}: (bits, group_size, sym)",
           (4, 4, False), (q.bits, q.group_size, q.sym))
    dtypes = (q.codes.dtype, q.zeros.dtype, q.g_idx.dtype)
    expect(dtypes == (torch.uint8, torch.int32, torch.int32), f"{case}: codes, zeros, g_idx",
           "uint8, int32, int32", dtypes)
    _expect_list(q.g_idx.tolist(), [0, 0, 0, 0, 1, 1, 1, 1], f"{case}: g_idx")
    _expect_scales(q.scales, [[2.9 / 15, 2 / 15], [2 / 15, 1.5 / 15]], case)
    # 7.5 in fp32: see above
    zeros = q.zeros.tolist()
    expect(zeros[0] == [5, 0] and zeros[1][1] == 7 and zeros[1][0] in (7, 8), f"{case}: the zeros",
           "[[5, 0], [7 or 8, 7]]", zeros)
    _expect_list(q.codes[0].tolist(), [0, 6, 7, 15, 4, 7, 15, 11], f"{case}: codes of row 0")
    _expect_list(q.codes[1, 4:].tolist(), [0, 8, 10, 15], f"{case}: codes of row 1, group 1")
    # the zero group: every code is the zero
    _expect_list(q.codes[1, :4].tolist(), [zeros[1][0]] * 4,
                 f"{case}: codes of row 1's group of zeros (each its zero)")
    # symmetric: zero 8; +amax is 7.5 steps, rounds up to code 16, clamped to 15
    q = impl.quantize_rtn(w, bits=4, group_size=4, sym=True)
    case = case.replace("sym=False", "sym=True")
    _expect_scales(q.scales, [[4 / 15, 4 / 15], [2 / 15, 1.6 / 15]], case)
    _expect_list(q.zeros.tolist(), [[8, 8], [8, 8]], f"{case}: the zeros")
    _expect_list(q.codes.tolist(), [[5, 9, 10, 15, 10, 11, 15, 14], [8, 8, 8, 8, 1, 9, 11, 15]],
                 f"{case}: the codes")
    # int8 per channel: group_size −1 is one group per row
    rows = [[-1.0, 0.0, 1.55, 0.3], [0.1, 0.25, 0.3, 0.4]]
    q = impl.quantize_rtn(torch.tensor(rows), bits=8, group_size=-1, sym=False)
    case = f"quantize_rtn({rows}, bits=8, group_size=-1, sym=False)"
    expect(q.group_size == -1 and q.g_idx.tolist() == [0, 0, 0, 0], f"{case}: group_size, g_idx",
           "-1, [0, 0, 0, 0] (one group per row)", (q.group_size, q.g_idx.tolist()))
    _expect_scales(q.scales, [[2.55 / 255], [0.4 / 255]], case)
    _expect_list(q.zeros.tolist(), [[100], [0]], f"{case}: the zeros")
    # row 1: w · 255/0.4, rounded
    _expect_list(q.codes.tolist(), [[0, 100, 255, 130], [64, 159, 191, 255]], f"{case}: the codes")


def check_dequantize_by_hand(impl):
    # g_idx permuted (as GPTQ's act-order leaves it): column k reads group g_idx[k], not k //
    # group_size
    codes = torch.tensor([[0, 15, 8, 3], [5, 0, 3, 4]], dtype=torch.uint8)
    zeros = torch.tensor([[8, 0], [2, 1]], dtype=torch.int32)
    g_idx = torch.tensor([1, 0, 0, 1], dtype=torch.int32)
    for dtype in (torch.float32, torch.float64):
        scales = torch.tensor([[0.5, 0.25], [1.0, 2.0]], dtype=dtype)
        w = impl.QuantizedWeight(codes=codes, zeros=zeros, scales=scales, g_idx=g_idx, bits=4,
                                 group_size=2,
                                 sym=False).dequantize()
        case = (f"QuantizedWeight(codes {codes.tolist()}, zeros {zeros.tolist()}, scales "
                f"{scales.tolist()}, g_idx {g_idx.tolist()}).dequantize() in {dtype}")
        expect(w.dtype == dtype, case, dtype, w.dtype)
        # (0 − 0)·0.25, (15 − 8)·0.5, (8 − 8)·0.5, (3 − 0)·0.25;  (5 − 1)·2, (0 − 2)·1, (3 − 2)·1,
        # (4 − 1)·2
        _expect_list(w.tolist(), [[0.0, 3.5, 0.0, 0.75], [8.0, -2.0, 1.0, 6.0]], case)


def check_round_trip_error(impl):
    """Random weights with every kind of group: |w − ŵ| ≤ scale/2, codes and zeros in range, 0 stays
    0."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)                                        # N, K
    w[0, :32] = 0                                                              # groups of zeros
    # groups with no negative value
    w[1, :32] = w[1, :32].abs()
    # ... and no positive value
    w[2, 32:] = -w[2, 32:].abs()
    # zeros among other values
    w[3, 5::7] = 0
    for bits, group_size in [(8, -1), (4, 16), (4, 64), (3, 32), (2, 16)]:
        gs = 64 if group_size == -1 else group_size
        maxq = 2**bits - 1
        for sym in (False, True):
            q = impl.quantize_rtn(w, bits, group_size, sym)
            case = (f"quantize_rtn(random [8, 64] with groups of zeros, of one sign, bits={bits}, "
                    f"group_size={group_size}, sym={sym})")
            expect(isinstance(q, impl.QuantizedWeight) and q.codes.shape == (8, 64), case,
                   "a QuantizedWeight with codes [8, 64]", getattr(q, "codes", q))
            expect(q.scales.shape == q.zeros.shape == (8, 64 // gs), f"{case}: scales and zeros",
                   f"shape (8, {64 // gs})", (tuple(q.scales.shape), tuple(q.zeros.shape)))
            expect(bool((q.scales > 0).all()), f"{case}: the scales", "all > 0",
                   f"smallest {float(q.scales.min()):.3g}")
            expect_equal(q.g_idx, torch.arange(64, dtype=torch.int32) // gs, f"{case}: g_idx")
            span = (int(q.codes.max()), int(q.zeros.min()), int(q.zeros.max()))
            expect(span[0] <= maxq and 0 <= span[1] and span[2] <= maxq,
                   f"{case}: (largest code, smallest zero, largest zero)", f"within 0..{maxq}",
                   span)
            if sym:
                expect(bool((q.zeros == 2 ** (bits - 1)).all()), f"{case}: the zeros",
                       f"all {2 ** (bits - 1)}", sorted(set(q.zeros.flatten().tolist())))
            w_hat = q.dequantize()                                             # N, K
            step = q.scales.repeat_interleave(gs, dim=1)                       # N, K
            error = (w - w_hat).abs() / (step / 2)  # ≤ 1: within half a step of the grid
            worst = int(error.flatten().argmax())
            expect(bool((error <= 1 + 1e-4).all()), f"{case}: |w − ŵ| / (scale / 2)",
                   "≤ 1 everywhere", f"{float(error.flatten()[worst]):.3g} at "
                   f"[n, k] = {[worst // 64, worst % 64]} (w {float(w.flatten()[worst]):.4g}, "
                   f"ŵ {float(w_hat.flatten()[worst]):.4g})")
            # zero is on every grid
            expect(bool((w_hat[w == 0] == 0).all()), f"{case}: ŵ where w = 0", "0 (on every grid)",
                   sorted(set(w_hat[w == 0].tolist()))[:4])
    q64 = impl.quantize_rtn(w.double(), 4, 16, False)
    assert q64.scales.dtype == torch.float64 and q64.dequantize().dtype == torch.float64


# ----------------------------------------------------------------------------- the tests
def test_ex08_1_quant_params_by_hand(impl):
    check_grid_by_hand(impl)


def test_ex08_2_round_to_codes_by_hand(impl):
    check_round_to_codes_by_hand(impl)


def test_ex08_3_quantize_rtn_by_hand(impl):
    check_quantize_rtn_by_hand(impl)


def test_ex08_4_dequantize_follows_g_idx(impl):
    check_dequantize_by_hand(impl)


def test_ex08_4_round_trip_error_at_most_half_a_step(impl):
    check_round_trip_error(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _rtn(widen=True, sym_zero=lambda maxq: (maxq + 1) // 2, round_zero=True, follow_g_idx=True):
    @dataclass
    class Quantized:
        codes: torch.Tensor
        zeros: torch.Tensor
        scales: torch.Tensor
        g_idx: torch.Tensor
        bits: int
        group_size: int
        sym: bool

        def dequantize(self):
            if follow_g_idx:
                g = self.g_idx.long()                                          # K
            else:  # wrong: assumes consecutive groups, column k in group k // group_size
                g = torch.arange(self.codes.shape[1]) // (
                    self.codes.shape[1] // self.scales.shape[1]
                )
            return (
                self.codes.to(self.scales.dtype) - self.zeros.to(self.scales.dtype)[:, g]
            ) * self.scales[:, g]

    def quant_params(w, bits, sym):
        maxq = 2**bits - 1
        xmin, xmax = w.min(1).values, w.max(1).values                          # rows
        if widen:
            xmin, xmax = xmin.clamp(max=0), xmax.clamp(min=0)
        if sym:
            xmax = torch.maximum(-xmin, xmax)
            xmin = -xmax
        dead = (xmin == 0) & (xmax == 0)
        xmin, xmax = torch.where(dead, -1.0, xmin), torch.where(dead, 1.0, xmax)
        scales = (xmax - xmin) / maxq
        if sym:
            zeros = torch.full_like(scales, sym_zero(maxq))
        else:
            # wrong: the cast truncates
            zeros = torch.round(-xmin / scales) if round_zero else -xmin / scales
        return scales, zeros.to(torch.int32)

    def round_to_codes(w, scales, zeros, maxq):
        return torch.clamp(torch.round(w / scales[:, None]) + zeros[:, None].to(w.dtype), 0, maxq)

    def quantize_rtn(w, bits=4, group_size=128, sym=True):
        w = w.detach() if w.dtype == torch.float64 else w.detach().float()
        n, k = w.shape
        gs = k if group_size == -1 else group_size
        groups = w.reshape(n * (k // gs), gs)
        scales, zeros = quant_params(groups, bits, sym)
        codes = round_to_codes(groups, scales, zeros, 2**bits - 1)
        return Quantized(codes.reshape(n, k).to(torch.uint8), zeros.reshape(n, -1),
                         scales.reshape(n, -1),
                         torch.arange(k, dtype=torch.int32) // gs, bits, group_size, sym)

    return SimpleNamespace(quant_params=quant_params, round_to_codes=round_to_codes,
                           quantize_rtn=quantize_rtn,
                           QuantizedWeight=Quantized)


GRID_CHECKS = [check_grid_by_hand, check_quantize_rtn_by_hand, check_round_trip_error]
WRONG = {
    "zero point truncated, not rounded": (_rtn(round_zero=False), GRID_CHECKS),
    "symmetric zero 7 instead of 8": (_rtn(sym_zero=lambda maxq: maxq // 2), GRID_CHECKS),
    "range not widened to contain 0": (_rtn(widen=False), GRID_CHECKS),
    "dequantize assumes g_idx = k // group_size": (_rtn(follow_g_idx=False),
                                                   [check_dequantize_by_hand]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex08_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex08_the_checks_pass_on_a_right_variant_built_the_same_way():
    right = _rtn()
    for check in (check_grid_by_hand, check_round_to_codes_by_hand, check_quantize_rtn_by_hand,
                  check_dequantize_by_hand, check_round_trip_error):
        check(right)
