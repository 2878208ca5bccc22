"""GPTQ for one layer (nanoserve/quant/gptq.py), docs/TESTING.md §C.

Exactness: with H = c·I there is nothing to feed errors through, so GPTQ must equal RTN bit for
bit; the lazy block updates must not change the result (any blocksize, 1e-12 in fp64); the fast
Cholesky version must match `gptq_naive`, the column-by-column OBS update with an explicitly
eliminated inverse, to 1e-8.
Quality: on a layer whose inputs are correlated and have 1 % outlier channels (×20), the
held-out output error ‖WX − ŴX‖ / ‖WX‖ must be ≤ 0.75 × RTN's (≤ 0.5 × with act-order). The
negative controls are GPTQ without error feedback (H with its off-diagonal dropped) and GPTQ
without act-order, which must fail those bounds. Measured with the seeds below (w4, g128, sym):
RTN 0.110, GPTQ 0.659 × RTN, GPTQ + act-order 0.472 × RTN; no feedback 1.000 × RTN (it is
RTN), 1.013 × with act-order.
"""

from __future__ import annotations

import pytest
import torch
from testdata import outlier_layer, rel_error
from torch import nn

from nanoserve.errors import NanoserveError
from nanoserve.quant import (
    GPTQ,
    capture_inputs,
    gptq_naive,
    gptq_quantize,
    quant_params,
    quantize_rtn,
)

F64 = torch.float64


def hessian(X):
    return 2 * X.T @ X / X.shape[0]                                          # K, K


def _same(a, b):
    return (
        torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
        and torch.equal(a.zeros, b.zeros) and torch.equal(a.g_idx, b.g_idx)
    )


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("bits, group_size, sym",
                         [(4, 128, True), (4, 64, False), (3, -1, True), (8, -1, False)])
def test_identity_hessian_equals_rtn_bitwise(bits, group_size, sym, dtype):
    W, sample = outlier_layer(1, n=128, k=256)
    W = W.to(dtype)
    for c in (1.0, 3.7):
        H = c * torch.eye(W.shape[1], dtype=dtype)
        assert _same(gptq_quantize(W, H, bits, group_size, sym),
                     quantize_rtn(W, bits, group_size, sym))
    # negative control: a correlated H feeds errors forward and changes the codes
    assert not _same(gptq_quantize(W, hessian(sample(1024, 1)).to(dtype), bits, group_size, sym),
                     quantize_rtn(W, bits, group_size, sym))


@pytest.mark.parametrize("act_order", [False, True])
def test_blocksize_invariance(act_order):
    W, sample = outlier_layer(2, n=128, k=256)
    H = hessian(sample(2048, 3))
    ref = gptq_quantize(W, H, 4, 64, sym=False, blocksize=128, act_order=act_order)
    for blocksize in (1, 16, 48, 100, 256, 1000):   # 48 and 100 put block edges inside groups
        q = gptq_quantize(W, H, 4, 64, sym=False, blocksize=blocksize, act_order=act_order)
        assert torch.equal(q.codes, ref.codes) and torch.equal(q.zeros, ref.zeros)
        assert (q.scales - ref.scales).abs().max() <= 1e-12
        assert (q.dequantize() - ref.dequantize()).abs().max() <= 1e-12


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits, group_size, sym", [(4, 16, True), (3, 32, False), (4, -1, False)])
def test_matches_naive(bits, group_size, sym, act_order):
    W, sample = outlier_layer(3, n=48, k=64)
    H = hessian(sample(512, 4))
    fast = gptq_quantize(W, H, bits, group_size, sym, blocksize=24, act_order=act_order)
    naive = gptq_naive(W, H, bits, group_size, sym, act_order=act_order)
    assert torch.equal(fast.codes, naive.codes) and torch.equal(fast.zeros, naive.zeros)
    assert torch.equal(fast.g_idx, naive.g_idx)
    assert (fast.scales - naive.scales).abs().max() <= 1e-8
    assert (fast.dequantize() - naive.dequantize()).abs().max() <= 1e-8
    # negative control: the other column order is a different (valid) answer
    other = gptq_naive(W, H, bits, group_size, sym, act_order=not act_order)
    assert (fast.dequantize() - other.dequantize()).abs().max() > 1e-3


def test_elimination_is_the_inverse_without_that_column():
    # the identity gptq_naive relies on: eliminating row/column j of H⁻¹ leaves inv(H without j)
    X = torch.randn(200, 12, dtype=F64)
    H = hessian(X)
    Hinv = torch.linalg.inv(H)
    j = 0
    Hinv -= Hinv[:, j:j + 1] @ Hinv[j:j + 1, :] / Hinv[j, j]
    assert torch.allclose(Hinv[1:, 1:], torch.linalg.inv(H[1:, 1:]), atol=1e-10)
    assert Hinv[0].abs().max() < 1e-12


def test_layer_output_error_vs_rtn():
    W, sample = outlier_layer(0)
    # T, K   calibration / held-out
    X_cal, X_test = sample(4096, 100), sample(4096, 200)
    H = hessian(X_cal)
    rtn = rel_error(W, quantize_rtn(W, 4, 128, sym=True).dequantize(), X_test)
    gptq = rel_error(W, gptq_quantize(W, H, 4, 128, sym=True).dequantize(), X_test)
    # negative control: with H's off-diagonal dropped, U is diagonal and no error is fed forward
    no_feedback = rel_error(W,
                            gptq_quantize(W, torch.diag(torch.diag(H)), 4, 128,
                                          sym=True).dequantize(), X_test)
    print(f"held-out rel. error: RTN {rtn:.4f}, GPTQ {gptq / rtn:.3f}×, no feedback "
          f"{no_feedback / rtn:.3f}×")
    assert gptq <= 0.75 * rtn                                                # measured 0.659×
    assert no_feedback > 0.75 * rtn                                          # measured 1.000×


def test_act_order():
    W, sample = outlier_layer(0)
    X_cal, X_test = sample(4096, 100), sample(4096, 200)
    H = hessian(X_cal)
    rtn = rel_error(W, quantize_rtn(W, 4, 128, sym=True).dequantize(), X_test)
    q = gptq_quantize(W, H, 4, 128, sym=True, act_order=True)
    act = rel_error(W, q.dequantize(), X_test)
    plain = rel_error(W, gptq_quantize(W, H, 4, 128, sym=True).dequantize(), X_test)
    diag_act = rel_error(W,
                         gptq_quantize(W, torch.diag(torch.diag(H)), 4, 128,
                                       act_order=True).dequantize(), X_test)
    print(f"held-out rel. error: GPTQ + act-order {act / rtn:.3f}× RTN, without act-order "
          f"{plain / rtn:.3f}×, act-order without feedback {diag_act / rtn:.3f}×")
    assert act <= 0.5 * rtn                                                  # measured 0.472×
    # negative controls: 0.659×, ~1×
    assert plain > 0.5 * rtn and diag_act > 0.5 * rtn
    # g_idx: groups follow the order of decreasing H_jj, each holds exactly group_size columns
    perm = torch.argsort(torch.diag(H), descending=True, stable=True)
    assert torch.equal(q.g_idx[perm].long(), torch.arange(512) // 128)
    assert torch.bincount(q.g_idx.long()).tolist() == [128] * 4
    assert not torch.equal(q.g_idx, torch.arange(512, dtype=torch.int32) // 128)


def test_static_groups():
    W, sample = outlier_layer(0)
    X_cal, X_test = sample(4096, 100), sample(4096, 200)
    H = hessian(X_cal)
    rtn_q = quantize_rtn(W, 4, 128, sym=True)
    q = gptq_quantize(W, H, 4, 128, sym=True, act_order=True, static_groups=True)
    # grids fixed up front from the original weights, groups k // group_size even under act-order
    assert torch.equal(q.scales, rtn_q.scales) and torch.equal(q.zeros, rtn_q.zeros)
    assert torch.equal(q.g_idx, rtn_q.g_idx)
    # measured 0.464×
    assert rel_error(W, q.dequantize(), X_test) <= 0.5 * rel_error(W, rtn_q.dequantize(), X_test)


def _held_out_error(seed, act_order, static_groups):
    W, sample = outlier_layer(seed)
    X_cal, X_test = sample(4096, 100), sample(4096, 200)
    q = gptq_quantize(W, hessian(X_cal), 4, 128, sym=True, act_order=act_order,
                      static_groups=static_groups)
    return rel_error(W, q.dequantize(), X_test)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_what_llmcompressor_default_changes(seed):
    """llmcompressor's default GPTQ (actorder="static") is act-order plus grids fixed from the
    original weights; per layer it gives the same Ŵ as gptq_quantize(act_order=True,
    static_groups=True) (benchmarks/RESULTS.md). Of its two parts, act-order is the one that lowers
    the held-out error: ≥ 25 % below plain GPTQ on every seed (measured 29-34 %); the static grid
    alone moves it by under 5 % (measured 1-3 % lower), and the negative control, static grids
    without act-order, must miss the 25 % bound."""
    plain, static = _held_out_error(seed, False, False), _held_out_error(seed, False, True)
    act, act_static = _held_out_error(seed, True, False), _held_out_error(seed, True, True)
    print(f"seed {seed}: act-order + static {act_static / plain:.3f}× plain GPTQ, "
          f"static alone {static / plain:.3f}×, act-order alone {act / plain:.3f}×")
    assert act_static <= 0.75 * plain and act <= 0.75 * plain
    assert abs(static - plain) <= 0.05 * plain and abs(act_static - act) <= 0.05 * act
    assert static > 0.75 * plain                                              # the control


@pytest.mark.parametrize("percdamp", [0.0, 0.01])
def test_dead_inputs(percdamp):
    # with percdamp = 0 the Cholesky would fail on H_jj = 0 if dead inputs were not given H_jj = 1
    W, sample = outlier_layer(4, n=64, k=128)
    X = sample(1024, 5)
    # two inputs that never fire
    X[:, [3, 77]] = 0
    q = gptq_quantize(W, hessian(X), 4, 32, sym=False, percdamp=percdamp)
    W_hat = q.dequantize()
    assert torch.isfinite(W_hat).all()
    # their weights become exact zeros
    assert (W_hat[:, [3, 77]] == 0).all()
    # undamped, this near-singular H (x = z·A) over-corrects: damping is what makes GPTQ win
    if percdamp > 0:
        rtn = rel_error(W, quantize_rtn(W, 4, 32, sym=False).dequantize(), X)
        assert rel_error(W, W_hat, X) < rtn


def test_hessian_running_average_and_capture_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16)).double()
    layers = {"fc1": model[0], "fc2": model[2]}
    gptq = {name: GPTQ(m.weight, dtype=F64) for name, m in layers.items()}
    seen = {name: [] for name in layers}

    def add(name, x):
        gptq[name].add_batch(x)
        seen[name].append(x)

    batches = [torch.randn(3, 7, 32, dtype=F64), torch.randn(50, 32, dtype=F64),
               torch.randn(1, 32, dtype=F64)]
    with capture_inputs(layers, add):
        for x in batches:
            model(x)
    # hooks are gone: not seen
    model(batches[0])
    assert [len(v) for v in seen.values()] == [3, 3]
    for name in layers:
        X = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen[name]])      # T, K
        assert gptq[name].nsamples == 3 * 7 + 50 + 1 == X.shape[0]
        assert torch.allclose(gptq[name].H, hessian(X), rtol=0, atol=1e-12)
    X = torch.cat([x.reshape(-1, 32) for x in batches])
    assert torch.equal(seen["fc1"][1], batches[1]) and torch.allclose(
        gptq["fc1"].H, hessian(X), atol=1e-12
    )
    assert _same(gptq["fc1"].quantize(4, 16), gptq_quantize(model[0].weight, gptq["fc1"].H, 4, 16))


def test_bad_inputs_raise():
    W = torch.randn(8, 16)
    H = torch.eye(16)
    with pytest.raises(NanoserveError, match=r"H must be \[K, K\] = \[16, 16\].*got \(8, 8\)"):
        gptq_quantize(W, torch.eye(8), group_size=-1)
    with pytest.raises(NanoserveError, match="blocksize must be a positive integer.*got 0"):
        gptq_quantize(W, H, group_size=-1, blocksize=0)
    with pytest.raises(NanoserveError, match=r"percdamp must be in \[0, 1\).*got 1.5"):
        gptq_quantize(W, H, group_size=-1, percdamp=1.5)
    with pytest.raises(NanoserveError, match="group_size .*got 5"):
        gptq_quantize(W, H, group_size=5)
    with pytest.raises(NanoserveError, match="non-finite"):
        gptq_quantize(W, H * float("nan"), group_size=-1)
    with pytest.raises(NanoserveError, match="not positive definite"):
        gptq_quantize(W, -torch.eye(16), group_size=-1)
    g = GPTQ(W)
    with pytest.raises(NanoserveError, match="no calibration inputs"):
        g.quantize(group_size=-1)
    with pytest.raises(NanoserveError, match=r"16 input features .*got shape \(4, 15\)"):
        g.add_batch(torch.randn(4, 15))
    # quant_params is the grid GPTQ shares with RTN: it validates bits too
    with pytest.raises(NanoserveError, match="got 9"):
        quant_params(W, 9, True)
