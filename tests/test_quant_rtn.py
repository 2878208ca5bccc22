"""Round-to-nearest (nanoserve/quant/rtn.py): the grid convention, error bounds, code ranges, bad
inputs.

Oracles: the bound |W − Ŵ| ≤ scale/2 that any correct rounding meets (a floor instead of a round,
or a wrong zero point, breaks it); hand-computed grids for the AutoGPTQ convention; the
dequantize formula written out with repeat_interleave. Negative controls sit next to the checks.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.errors import NanoserveError
from nanoserve.quant import QuantizedWeight, fake_quantize, quant_params, quantize_rtn

N, K = 256, 512


def _weight(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g, dtype=dtype)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", range(2, 9))
def test_error_bound_and_code_range(bits, sym):
    w = _weight(bits)
    q = quantize_rtn(w, bits, group_size=64, sym=sym)
    maxq = 2**bits - 1
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (N, K)
    assert q.scales.shape == q.zeros.shape == (N, K // 64) and q.zeros.dtype == torch.int32
    assert torch.equal(q.g_idx, torch.arange(K, dtype=torch.int32) // 64)
    assert int(q.codes.max()) <= maxq
    assert 0 <= int(q.zeros.min()) and int(q.zeros.max()) <= maxq
    if sym:
        assert (q.zeros == 2 ** (bits - 1)).all()
    # each weight moves by at most half a step; 1e-4 of slack covers fp32 rounding of w / scale ·
    # scale
    step = q.scales[:, q.g_idx.long()]                                       # N, K
    assert ((w - q.dequantize()).abs() <= step / 2 * (1 + 1e-4)).all()
    # negative control: rounding down instead of to nearest breaks the bound
    floor = (torch.floor(w / step) + q.zeros[:, q.g_idx.long()]).clamp(0, maxq)
    w_floor = (floor - q.zeros[:, q.g_idx.long()]) * step
    assert ((w - w_floor).abs() > step / 2 * (1 + 1e-4)).any()


def test_int8_per_channel_error_is_small():
    w = _weight(1)
    q = quantize_rtn(w, bits=8, group_size=-1, sym=True)
    assert q.scales.shape == (N, 1) and (q.g_idx == 0).all()
    rel = ((w - q.dequantize()).norm() / w.norm()).item()
    # step = 2·max|w|/255 ≈ 0.03σ for 512 Gaussian weights, so rms error ≈ step/√12 ≈ 0.009σ;
    # measured 0.0075
    assert rel < 0.01
    # negative control: 4 bits per channel is 16× coarser
    assert ((w - fake_quantize(w, 4, -1)).norm() / w.norm()).item() > 0.1


def test_grid_convention_by_hand():
    # asymmetric 2-bit: xmin −1, xmax 1 -> scale (1 − (−1)) / 3, zero round(1 / (2/3)) = round(1.5)
    # = 2
    w = torch.tensor([[-1.0, 0.25, 0.5, 1.0]])
    scales, zeros = quant_params(w, bits=2, sym=False)
    assert torch.allclose(scales, torch.tensor([2 / 3])) and zeros.tolist() == [2]
    q = quantize_rtn(w, bits=2, group_size=-1, sym=False)
    # round(−1.5) = −2 (half to even) -> 0; round(0.375) -> 2; round(0.75) = 1 -> 3; round(1.5) = 2
    # -> 4, clamped to 3
    assert q.codes.tolist() == [[0, 2, 3, 3]]
    # symmetric 4-bit: amax 1 -> scale 2/15, zero 8; +amax is 7.5 steps, rounds to 8 -> code 16,
    # clamped to 15
    w = torch.tensor([[-0.5, 0.25, 1.0, 0.0]])
    q = quantize_rtn(w, bits=4, group_size=-1, sym=True)
    assert torch.allclose(q.scales, torch.tensor([[2 / 15]])) and q.zeros.tolist() == [[8]]
    assert q.codes.tolist() == [[4, 10, 15, 8]]
    # the range always contains 0: an all-positive group gets xmin = 0, so zero = 0 (asym) and w = 0
    # stays exact
    scales, zeros = quant_params(torch.tensor([[0.5, 1.0, 2.0]]), bits=4, sym=False)
    assert torch.allclose(scales, torch.tensor([2 / 15])) and zeros.tolist() == [0]
    # an all-zero group gets range [−1, 1] (never a zero scale) and dequantizes to exact zeros
    q = quantize_rtn(torch.zeros(2, 8), bits=4, group_size=4, sym=False)
    assert (q.scales > 0).all() and (q.dequantize() == 0).all()


def test_dequantize_follows_g_idx():
    q = quantize_rtn(_weight(2), bits=4, group_size=128)
    manual = (q.codes.float() - q.zeros.repeat_interleave(128, 1)) * q.scales.repeat_interleave(
        128, 1
    )
    assert torch.equal(q.dequantize(), manual)
    # a permuted grouping (as act-order produces) must be followed, not assumed to be k //
    # group_size
    g_idx = q.g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(0))]
    p = QuantizedWeight(q.codes, q.zeros, q.scales, g_idx, q.bits, q.group_size, q.sym)
    manual = (q.codes.float() - q.zeros[:, g_idx.long()]) * q.scales[:, g_idx.long()]
    assert torch.equal(p.dequantize(), manual) and not torch.equal(p.dequantize(), q.dequantize())


def test_dtypes():
    w16 = _weight(3).half()
    q = quantize_rtn(w16)
    assert q.scales.dtype == torch.float32                 # fp16 weights are quantized in fp32
    assert fake_quantize(w16).dtype == torch.float16
    q64 = quantize_rtn(_weight(3, torch.float64))
    assert q64.scales.dtype == torch.float64 and q64.dequantize().dtype == torch.float64


@pytest.mark.parametrize("kwargs, match", [
    (dict(bits=1), "bits must be an integer from 2 to 8.*got 1"),
    (dict(bits=9), "bits must be .*got 9"),
    (dict(bits=4.0), "bits must be .*got 4.0"),
    (dict(group_size=100),
     "group_size must be -1 .* divisor of the weight's 512 input columns.*got 100"),
    (dict(group_size=0), "group_size .*got 0"),
    (dict(group_size=-2), "group_size .*got -2"),
])
def test_bad_parameters_raise(kwargs, match):
    with pytest.raises(NanoserveError, match=match):
        quantize_rtn(_weight(), **kwargs)
    assert issubclass(NanoserveError, ValueError)


def test_bad_weights_raise():
    with pytest.raises(NanoserveError, match=r"2-D tensor .*got \(2, 4, 8\)"):
        quantize_rtn(torch.randn(2, 4, 8), group_size=-1)
    with pytest.raises(NanoserveError, match=r"2-D tensor .*got \(8,\)"):
        quantize_rtn(torch.randn(8), group_size=-1)
    with pytest.raises(NanoserveError, match="floating-point.*torch.int64"):
        quantize_rtn(torch.ones(4, 8, dtype=torch.long), group_size=-1)
    for bad in (float("nan"), float("inf")):
        w = torch.randn(4, 8)
        w[2, 5] = bad
        with pytest.raises(NanoserveError, match=r"finite, found (nan|inf) at \[2, 5\]"):
            quantize_rtn(w, group_size=-1)
