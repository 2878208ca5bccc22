"""AWQ for a group of linears sharing an input (nanoserve/quant/awq.py), docs/TESTING.md §C.

Quality: on a layer whose inputs are correlated and have 1 % outlier channels (×20), the held-out
output error ‖WX − ŴX‖ / ‖WX‖ must be ≤ 0.8 × RTN's; on the calibration set AWQ must never lose
to RTN (α = 0 *is* RTN and is on the grid). Negative control: α forced to 0 without clipping is
RTN exactly and must fail the bound. Folding: moving 1/s into the previous norm or linear and s
into the linears leaves the fp output unchanged (≤ 1e-5); folding s the wrong way round must not.
Measured with the seeds below (w4, g128, asym, AWQ's default): RTN 0.101, AWQ 0.651 × RTN
(α = 0.3), scales alone (no clipping) 0.679 ×, α = 0 without clipping 1.000 ×.
"""

from __future__ import annotations

import pytest
import torch
from testdata import outlier_layer, rel_error
from torch import nn

from nanoserve.errors import NanoserveError
from nanoserve.models.layers import RMSNorm
from nanoserve.quant import (
    activation_scale,
    apply_awq,
    awq_search,
    fake_quantize,
    fold_scales,
    quantize_rtn,
    search_clip,
)

F64 = torch.float64


def linear(W, bias=None):
    lin = nn.Linear(W.shape[1], W.shape[0], bias=bias is not None)
    with torch.no_grad():
        lin.weight.copy_(W)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def awq_weight(W, X_cal, bits=4, group_size=128, sym=False, **kw):
    """The weight an AWQ-quantized layer effectively computes with, Q(W·s)/s, in fp64; and the
    result."""
    lin, norm = linear(W), RMSNorm(W.shape[1])
    result = awq_search([lin], X_cal.float(), bits, group_size, sym, **kw)
    apply_awq(norm, [lin], result)
    assert torch.allclose(norm.weight, 1 / result.scales)
    s = result.scales.double()
    return fake_quantize(lin.weight.detach().double(), bits, group_size, sym) / s, result


def test_awq_vs_rtn_held_out():
    W, sample = outlier_layer(0)
    # the fp32 weights an nn.Linear holds
    W = W.float().double()
    # T, K   calibration / held-out
    X_cal, X_test = sample(4096, 100), sample(4096, 200)
    rtn = rel_error(W, fake_quantize(W, 4, 128, sym=False), X_test)
    W_awq, result = awq_weight(W, X_cal)
    awq = rel_error(W, W_awq, X_test)
    scales_only = rel_error(W, awq_weight(W, X_cal, clip=False)[0], X_test)
    alpha0, res0 = awq_weight(W, X_cal, n_grid=1, clip=False)              # negative control: s = 1
    print(f"held-out rel. error: RTN {rtn:.4f}, AWQ {awq / rtn:.3f}× (α = {result.alpha}), scales "
          f"only {scales_only / rtn:.3f}×, α = 0 {rel_error(W, alpha0, X_test) / rtn:.3f}×")
    assert awq <= 0.8 * rtn                                                  # measured 0.651×
    assert scales_only <= 0.8 * rtn                                          # measured 0.679×
    assert res0.alphas == [0.0] and (res0.scales == 1).all()
    # α = 0 without clipping is RTN ...
    assert torch.equal(alpha0, fake_quantize(W, 4, 128, sym=False))
    # ... and fails the bound
    assert rel_error(W, alpha0, X_test) > 0.8 * rtn
    # the α curve: 20 values in [0, 0.95], the chosen α at its minimum
    assert result.alphas == [i / 20 for i in range(20)] and len(result.losses) == 20
    assert result.alpha == result.alphas[result.losses.index(min(result.losses))] > 0


@pytest.mark.parametrize("bits, group_size, sym", [(4, 128, False), (4, 64, True), (3, 128, False)])
def test_never_worse_than_rtn_on_calibration(bits, group_size, sym):
    # a group of three linears reading the same input (q, k, v after a norm)
    Ws = [outlier_layer(s, n=128, k=256)[0].float() for s in (5, 6, 7)]
    sample = outlier_layer(5, n=128, k=256)[1]
    X = sample(2048, 8)
    lins = [linear(W) for W in Ws]
    result = awq_search(lins, X.float(), bits, group_size, sym)
    # loss(α = 0) is RTN's calibration loss, computed independently here
    # (in fp64 from the same fp32 weights: only the fp32 accumulation of the search differs)
    rtn_loss = sum(((X @ (W - fake_quantize(W, bits, group_size,
                                            sym)).double().T) ** 2).sum().item() for W in Ws)
    assert result.losses[0] == pytest.approx(rtn_loss, rel=1e-5)
    assert min(result.losses) <= result.losses[0]
    # the full method (scales, then clipping) on the calibration set, layer by layer
    apply_awq(RMSNorm(256), lins, result)
    s = result.scales.double()
    for W, lin in zip(Ws, lins):
        W_awq = fake_quantize(lin.weight.detach(), bits, group_size, sym).double() / s
        W_rtn = fake_quantize(W, bits, group_size, sym).double()
        assert rel_error(W.double(), W_awq, X) <= rel_error(W.double(), W_rtn, X)


def _outputs(prev, linears, x):
    with torch.no_grad():
        h = prev(x)
        return torch.cat([lin(h) for lin in linears], dim=-1)


@pytest.mark.parametrize("norm", ["rmsnorm", "gemma-rmsnorm", "layernorm", "linear"])
def test_fold_scales_keeps_fp_output(norm):
    torch.manual_seed(0)
    k = 256
    if norm == "rmsnorm":
        prev = RMSNorm(k)
    elif norm == "gemma-rmsnorm":
        # scales by 1 + w: w ÷ s would be wrong
        prev = RMSNorm(k, unit_offset=True)
    elif norm == "layernorm":
        prev = nn.LayerNorm(k)                                               # weight and bias
    else:
        # v -> o: rows and bias of v
        prev = nn.Linear(192, k)
    with torch.no_grad():
        prev.weight.add_(0.1 * torch.randn_like(prev.weight))
        if getattr(prev, "bias", None) is not None:
            prev.bias.add_(0.1 * torch.randn_like(prev.bias))
    linears = [nn.Linear(k, 128), nn.Linear(k, 64, bias=False), nn.Linear(k, 128)]
    x = torch.randn(64, prev.weight.shape[-1])                               # T, K_prev
    # K   spread like AWQ's (about 0.1 .. 10)
    s = torch.exp(torch.randn(k))
    before = _outputs(prev, linears, x)                                      # T, 320   entries O(1)
    fold_scales(prev, linears, s)
    # exact but for fp32 rounding
    assert (_outputs(prev, linears, x) - before).abs().max() <= 1e-5
    # negative control: s folded into prev instead of 1/s (prev ×s² relative to the correct fold)
    fold_scales(prev, [], 1 / s**2)
    assert (_outputs(prev, linears, x) - before).abs().max() > 1e-2
    if norm == "gemma-rmsnorm":  # and the Llama rule (w ÷ s) on Gemma's norm misses too
        fresh = RMSNorm(k, unit_offset=True)
        fresh.weight.data.copy_(0.1 * torch.randn(k))
        lins = [nn.Linear(k, 32)]
        ref = _outputs(fresh, lins, x)
        fresh.unit_offset = False
        fold_scales(fresh, lins, s)
        fresh.unit_offset = True
        assert (_outputs(fresh, lins, x) - ref).abs().max() > 1e-2


def test_apply_awq_clips_and_otherwise_keeps_output():
    W, sample = outlier_layer(9, n=128, k=256)
    X = sample(1024, 10).float()
    lins, prev = [linear(W)], nn.LayerNorm(256)
    x_in = torch.randn(32, 256)
    before = _outputs(prev, lins, x_in)
    result = awq_search(lins, X, 4, 64, clip=False)
    assert result.max_vals == [None]
    # no clipping: only folds
    apply_awq(prev, lins, result)
    # outputs O(10): fp32 rounding
    assert (_outputs(prev, lins, x_in) - before).abs().max() <= 1e-4
    # search again on the folded layer
    clipped = awq_search(lins, X, 4, 64, clip=True)
    max_val = clipped.max_vals[0]                                            # N, G
    org_max = lins[0].weight.detach().mul(clipped.scales).abs().view(128, 4, 64).amax(-1)
    assert (max_val <= org_max).all() and (max_val >= 0.55 * org_max * (1 - 1e-6)).all()
    # some groups were clipped
    assert (max_val < org_max).any()
    apply_awq(nn.LayerNorm(256), lins, clipped)
    assert (lins[0].weight.abs().view(128, 4, 64) <= max_val[..., None]).all()


def test_search_clip_never_worse_per_group():
    W, sample = outlier_layer(11, n=64, k=256)
    X = sample(512, 12).float()
    w = W.float()
    max_val = search_clip(w, X, 4, 64, sym=False)                            # N, G
    xg, wg = X.view(-1, 4, 64), w.view(64, 4, 64)

    # N, G   each group's output error
    def group_err(w_hat):
        out = torch.einsum("tgc,ngc->ngt", xg, w_hat.view(64, 4, 64))
        return (out - torch.einsum("tgc,ngc->ngt", xg, wg)).pow(2).mean(-1)

    clipped = torch.clamp(wg, -max_val[..., None], max_val[..., None]).view(64, 256)
    assert (
        group_err(fake_quantize(clipped, 4, 64, False)) <= group_err(fake_quantize(w, 4, 64, False))
    ).all()
    # negative control: clipping every group at 0.55 is worse than the search's choice somewhere
    half = torch.clamp(wg, -0.55 * wg.abs().amax(-1, keepdim=True),
                       0.55 * wg.abs().amax(-1, keepdim=True))
    assert (group_err(fake_quantize(half.view(64, 256), 4, 64, False)).sum()
            > group_err(fake_quantize(clipped, 4, 64, False)).sum())
    # rows are searched 256 at a time: a row's result does not depend on its batch
    tall = torch.cat([w, torch.randn(300, 256)])
    assert torch.equal(search_clip(tall, X, 4, 64, sym=False)[:64], max_val)


def test_activation_scale():
    x = torch.tensor([[1.0, -2.0, 0.0], [-3.0, 2.0, 0.0]])
    assert activation_scale(x).tolist() == [2.0, 2.0, 0.0]
    assert activation_scale(x.view(1, 2, 3)).tolist() == [2.0, 2.0, 0.0]


def test_bad_inputs_raise():
    lin = nn.Linear(64, 32)
    x = torch.randn(16, 64)
    with pytest.raises(NanoserveError, match="same in_features"):
        awq_search([lin, nn.Linear(48, 32)], x, group_size=16)
    with pytest.raises(NanoserveError, match=r"64 input features .*got \(16, 63\)"):
        awq_search([lin], torch.randn(16, 63), group_size=16)
    with pytest.raises(NanoserveError, match="at least one"):
        awq_search([], x)
    with pytest.raises(NanoserveError, match="n_grid must be a positive integer.*got 0"):
        awq_search([lin], x, group_size=16, n_grid=0)
    with pytest.raises(NanoserveError, match="group_size .*got 128"):
        awq_search([lin], x, group_size=128)
    with pytest.raises(NanoserveError, match="bits .*got 1"):
        awq_search([lin], x, bits=1, group_size=16)
    s = torch.ones(64)
    with pytest.raises(NanoserveError, match="cannot fold scales into GELU"):
        fold_scales(nn.GELU(), [lin], s)
    with pytest.raises(NanoserveError, match="previous linear has 32 outputs, the scales 64"):
        fold_scales(nn.Linear(8, 32), [lin], s)
    with pytest.raises(NanoserveError, match="in_features 64"):
        fold_scales(RMSNorm(64), [lin, nn.Linear(32, 8)], s)
    # the valid call still works
    assert quantize_rtn(lin.weight.detach(), 4, 16).shape == (32, 64)


@pytest.mark.parametrize("name",
                         ["llama-gqa", "qwen2-bias", "mistral-window", "qwen3-window", "gemma2", "gemma3",
                                  "smollm3", "olmo2", "phi3"])
def test_block_groups_fold_exactly_in_every_family(hf_checkpoints, name):
    """AWQ folds 1/s into the op that feeds each group of linears (quant/model.block_groups).
    Folding random scales into every group of every block must leave the model's logits unchanged:
    the right norm per family (Gemma's MLP input is pre_feedforward_layernorm, a (1 + w) norm).
    Negative control on Gemma: Llama's post_attention_layernorm (there the attention's output norm)
    changes them."""
    from nanoserve.models.loader import load_model
    from nanoserve.quant.model import block_groups, decoder_blocks

    def fold_all(model, swap=None):
        torch.manual_seed(1)
        for block in decoder_blocks(model)[1]:
            for prev, names in block_groups(model):
                if prev is not None:
                    lins = [block.get_submodule(n) for n in names]
                    s = torch.exp(0.5 * torch.randn(lins[0].in_features))
                    fold_scales(
                        block.get_submodule(swap.get(prev, prev) if swap else prev), lins, s
                    )

    x = torch.randint(0, 257, (2, 20), generator=torch.Generator().manual_seed(0))
    model, _, _ = load_model(hf_checkpoints[name][0], dtype="float32", device="cpu")
    with torch.no_grad():
        before = model(x)
        fold_all(model)
        assert (model(x) - before).abs().max() <= 1e-4
        if name.startswith("gemma"):
            wrong, _, _ = load_model(hf_checkpoints[name][0], dtype="float32", device="cpu")
            fold_all(wrong, swap={"pre_feedforward_layernorm": "post_attention_layernorm"})
            assert (wrong(x) - before).abs().max() > 1e-2
