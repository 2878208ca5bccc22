"""Exercise 10: AWQ's scale search (nanoserve/quant/awq.py: scaled_loss, search_scales,
fold_scales).

Oracles: the loss evaluated directly in fp64 as the paper writes it, ‖X Wᵀ − (X / s) Q(W·diag(s))ᵀ‖²
summed over the linears sharing X, with Q the RTN grid of exercise 8; the α grid and the scales
s(α) = mean|x|^α / √(max·min) written out here; the α curve's minimum; and the layer's output,
which folding 1/s into the previous op and s into the linears must leave unchanged (≤ 1e-5, fp32).
Quality (docs/TESTING.md §C): on a layer with correlated inputs and 1 % outlier channels ×20, the
held-out output error with AWQ's scales is ≤ 0.8 × RTN's (measured 0.679×, α = 0.3; int4 g128
asymmetric), and AWQ is never worse than RTN on the calibration set (α = 0 is RTN and is on the
grid).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from explain import expect, expect_close, explained_failure
from testdata import outlier_layer, rel_error
from torch import nn

from nanoserve.errors import NanoserveError
from nanoserve.models.layers import RMSNorm
from nanoserve.quant.rtn import fake_quantize

REFERENCE = "nanoserve.quant.awq"
EXERCISE = "awq"
pytestmark = [pytest.mark.ex10, pytest.mark.usefixtures("one_thread")]

F64 = torch.float64




def linear(W, bias=False):
    lin = nn.Linear(W.shape[1], W.shape[0], bias=bias)
    with torch.no_grad():
        lin.weight.copy_(W)
    return lin


def _group(seed=5, sizes=(48, 32), k=128, tokens=512):
    """Two linears (like k and v) reading the same input: their weights and x [tokens, k] fp32."""
    W, sample = outlier_layer(seed, n=sum(sizes), k=k)
    return [linear(w) for w in W.float().split(list(sizes))], sample(tokens, seed + 1).float()


def direct_loss(linears, x, s, bits, group_size, sym):
    """Σ ‖X Wᵀ − (X / s) Q(W·diag(s))ᵀ‖² in fp64; Q of the fp32 product W·s, as the scaled layer
    stores it."""
    X, total = x.double(), 0.0
    for lin in linears:
        W = lin.weight.detach()                                               # N, K   fp32
        Q = fake_quantize(W * s, bits, group_size, sym).double()              # N, K
        total += (X @ W.double().T - (X / s.double()) @ Q.T).pow(2).sum().item()
    return total


def scales_at(x, alpha):
    s = x.abs().mean(0).pow(alpha).clamp(min=1e-4)                            # K
    return s / (s.max() * s.min()).sqrt()


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_scaled_loss(impl):
    linears, x = _group()
    g = torch.Generator().manual_seed(0)
    for bits, group_size, sym in [(4, 32, False), (3, 64, True), (4, -1, False)]:
        # s = 1 is RTN's loss
        for name, s in (("s = 1", torch.ones(128)),
                        ("random s", torch.exp(0.5 * torch.randn(128, generator=g)))):
            loss = impl.scaled_loss(linears, x, s, bits, group_size, sym)
            case = (f"scaled_loss(two linears on 512 tokens, {name}, bits={bits}, "
                    f"group_size={group_size}, sym={sym})")
            expect(isinstance(loss, float), case, "a Python float", type(loss).__name__)
            want = direct_loss(linears, x, s, bits, group_size, sym)
            expect(loss == pytest.approx(want, rel=1e-4), case,
                   f"{want:.6g} (‖X Wᵀ − (X / s) Q(W·diag(s))ᵀ‖², within 1e-4)", f"{loss:.6g}")


def check_search_scales(impl):
    linears, x = _group()
    for bits, group_size, sym, n_grid in [(4, 32, False, 20), (3, 64, True, 8)]:
        s, alpha, alphas, losses = impl.search_scales(linears, x, bits, group_size, sym, n_grid)
        case = f"search_scales(..., bits={bits}, group_size={group_size}, n_grid={n_grid})"
        # 0 .. (n−1)/n: 1.0 is not on it
        want_grid = [i / n_grid for i in range(n_grid)]
        expect(alphas == want_grid, f"{case}: the α grid", want_grid, alphas)
        expect(len(losses) == n_grid, f"{case}: the losses", f"{n_grid} of them", len(losses))
        # the α curve, point by point
        for a, loss in zip(alphas, losses):
            want = direct_loss(linears, x, scales_at(x, a), bits, group_size, sym)
            expect(loss == pytest.approx(want, rel=1e-4), f"{case}: the loss at α = {a}",
                   f"{want:.6g}", f"{loss:.6g}")
        first_minimum = alphas[losses.index(min(losses))]
        expect(alpha == first_minimum, f"{case}: the chosen α",
               f"the first minimum, {first_minimum}", alpha)
        expect_close(s, scales_at(x, alpha), f"{case}: s = mean|x|^α / √(max·min)", atol=0,
                     rtol=1e-6, dims="k")
        centre = float(s.max() * s.min())
        expect(centre == pytest.approx(1.0, rel=1e-5), f"{case}: max(s)·min(s)",
               "1 (centred in log space)", f"{centre:.6g}")
        # never worse than RTN (s = 1) on the calibration tokens
        awq = direct_loss(linears, x, s, bits, group_size, sym)
        rtn = direct_loss(linears, x, torch.ones(128), bits, group_size, sym)
        expect(awq <= rtn * (1 + 1e-5), f"{case}: the loss at the chosen s",
               f"at most RTN's {rtn:.6g}", f"{awq:.6g}")
    s, alpha, alphas, losses = impl.search_scales(linears, x, 4, 32, False, n_grid=1)
    rtn_only = alphas == [0.0] and alpha == 0.0 and len(losses) == 1
    expect(rtn_only and torch.equal(s, torch.ones(128)), "search_scales(..., n_grid=1)",
           "α = 0 only and s = 1 (RTN)", (alphas, alpha))


@functools.cache
def _outlier_case():
    """The layer of docs/TESTING.md §C, W [256, 512] (fp32 values), 4096 calibration and 4096
    held-out tokens."""
    W, sample = outlier_layer(0)
    W = W.float().double()
    X_cal, X_test = sample(4096, 100), sample(4096, 200)
    rtn = fake_quantize(W, 4, 128, sym=False)
    return W, X_cal, X_test, rel_error(W, rtn, X_cal), rel_error(W, rtn, X_test)


def check_beats_rtn(impl):
    W, X_cal, X_test, rtn_cal, rtn_test = _outlier_case()
    s = impl.search_scales([linear(W.float())], X_cal.float(), 4, 128, False)[0].double()
    # N, K   what the AWQ layer computes with
    W_awq = fake_quantize(W * s, 4, 128, sym=False) / s
    calibration = rel_error(W, W_awq, X_cal)
    expect(calibration <= rtn_cal, "AWQ on the outlier layer: calibration error",
           f"at most RTN's {rtn_cal:.4g}", f"{calibration:.4g}")
    held_out = rel_error(W, W_awq, X_test)
    expect(held_out <= 0.8 * rtn_test, "AWQ on the outlier layer: held-out error / RTN's",
           "≤ 0.8", f"{held_out / rtn_test:.3f}")


def _outputs(prev, linears, x):
    with torch.no_grad():
        h = prev(x)
        return torch.cat([lin(h) for lin in linears], dim=-1)


def check_fold_scales(impl):
    k = 96
    for kind in ("rmsnorm", "layernorm", "linear"):
        torch.manual_seed(0)
        prev = {"rmsnorm": RMSNorm(k), "layernorm": nn.LayerNorm(k),
                "linear": nn.Linear(80, k)}[kind]
        with torch.no_grad():
            for p in prev.parameters():
                p.add_(0.1 * torch.randn_like(p))
        linears = [nn.Linear(k, 64), nn.Linear(k, 32, bias=False), nn.Linear(k, 48)]
        x = torch.randn(32, prev.weight.shape[-1])                            # T, K_prev
        s = torch.exp(torch.randn(k))                                         # K   about 0.1 .. 10
        # T, 144   entries O(1)
        before = _outputs(prev, linears, x)
        weights = [lin.weight.detach().clone() for lin in linears]
        returned = impl.fold_scales(prev, linears, s)
        expect(returned is None, f"fold_scales(a {kind}, ...)", "None (it folds in place)",
               type(returned).__name__)
        # fp32 rounding only
        expect_close(_outputs(prev, linears, x), before,
                     f"the layer's outputs after fold_scales into a {kind} (they must not move)",
                     atol=1e-5, dims="token, output")
        for lin, w in zip(linears, weights):
            expect_close(lin.weight, w * s, f"a linear's weight after fold_scales into a {kind}: "
                         "its columns times s", atol=0, rtol=1e-6, dims="out, in")
    # GELU(x) / s ≠ GELU(x / s)
    with pytest.raises(NanoserveError):
        impl.fold_scales(nn.GELU(), [nn.Linear(k, 8)], torch.ones(k))


# ----------------------------------------------------------------------------- the tests
def test_ex10_1_scaled_loss_is_the_output_error(impl):
    check_scaled_loss(impl)


def test_ex10_2_search_scales_grid_curve_and_minimum(impl):
    check_search_scales(impl)


def test_ex10_2_awq_beats_rtn_on_outlier_inputs(impl):
    check_beats_rtn(impl)


def test_ex10_3_fold_scales_keeps_the_fp_output(impl):
    check_fold_scales(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _awq(normalise=True, divide_x=True, grid="open", fold_bias=True):
    def scaled_loss(linears, x, s, bits, group_size, sym):
        loss = 0.0
        for lin in linears:
            w = lin.weight.detach().float()                                   # N, K
            q = fake_quantize(w * s, bits, group_size, sym)                   # N, K
            # wrong: the layer would compute Q(W·s) x, inputs not divided
            w_eff = q / s if divide_x else q
            loss += (x @ (w - w_eff).T).double().pow(2).sum().item()
        return loss

    def search_scales(linears, x, bits=4, group_size=128, sym=False, n_grid=20):
        x = x.reshape(-1, x.shape[-1]).float()                                # T, K
        x_mean = x.abs().mean(0)                                              # K
        if grid == "open":
            alphas = [i / n_grid for i in range(n_grid)]
        else:  # wrong: 0 .. 1 inclusive
            alphas = torch.linspace(0, 1, n_grid).tolist()
        losses, best = [], (float("inf"), None, None)
        for alpha in alphas:
            s = x_mean.pow(alpha).clamp(min=1e-4)                             # K
            if normalise:
                s = s / (s.max() * s.min()).sqrt()
            losses.append(scaled_loss(linears, x, s, bits, group_size, sym))
            if losses[-1] < best[0]:
                best = (losses[-1], s, alpha)
        return best[1], best[2], alphas, losses

    @torch.no_grad()
    def fold_scales(prev, linears, s):
        if isinstance(prev, nn.Linear):
            prev.weight.div_(s[:, None])                                      # K, K_prev   rows
        elif isinstance(getattr(prev, "weight", None),
                        torch.Tensor) and prev.weight.shape == s.shape:
            prev.weight.div_(s)                                               # K
        else:
            raise NanoserveError(f"cannot fold scales into {type(prev).__name__}")
        if fold_bias and getattr(prev, "bias", None) is not None:             # wrong when skipped
            prev.bias.div_(s)
        for lin in linears:
            lin.weight.mul_(s[None, :])                                       # N, K   columns

    return SimpleNamespace(scaled_loss=scaled_loss, search_scales=search_scales,
                           fold_scales=fold_scales)


WRONG = {   # held-out error with "inputs not divided": 1.000× RTN (it picks α = 0)
    "scales not normalised": (_awq(normalise=False), [check_search_scales]),
    "s applied to W, inputs not divided": (_awq(divide_x=False),
                                           [check_scaled_loss, check_search_scales,
                                                                   check_beats_rtn]),
    "alpha grid 0 .. 1 inclusive": (_awq(grid="closed"), [check_search_scales]),
    "previous op's bias not divided": (_awq(fold_bias=False), [check_fold_scales]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex10_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex10_the_checks_pass_on_a_right_variant_built_the_same_way():
    right = _awq()
    for check in (check_scaled_loss, check_search_scales, check_beats_rtn, check_fold_scales):
        check(right)
