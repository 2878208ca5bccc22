"""Exercise 16: SmoothQuant (nanoserve/quant/smoothquant.py: smoothing_factors, smooth_model).

Oracles outside the code under test: the formula's defining property — at α = 0.5 the smoothed input
and weight have the same maximum per channel, √(max|X_k| · max|W_k|) — checked on a layer and,
measured with hooks, on every smoothed group of a real model (demo-draft, a Llama); α = 0 and α = 1
as limits; and the model's logits, which smoothing must not change. Known-wrong variants at the end:
α and 1 − α swapped, the weight maximum of the group's first linear only, and 1/s folded the wrong
way (multiplied).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from explain import expect, expect_close, explained_failure

import nanoserve.quant.smoothquant as reference
from nanoserve.errors import NanoserveError
from nanoserve.models.loader import load_model
from nanoserve.quant.awq import fold_scales
from nanoserve.quant.gptq import capture_inputs
from nanoserve.quant.model import block_groups, decoder_blocks

REFERENCE = "nanoserve.quant.smoothquant"
EXERCISE = "smoothquant"
pytestmark = pytest.mark.ex16


def _layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    act_max = torch.rand(48, generator=g) * 2 + 0.1
    act_max[[3, 30]] = 40.0  # two outlier channels
    act_max[7] = 0.0  # a channel that never fires: clamped, not a division by zero
    # the second dominates
    return act_max, [torch.randn(16, 48, generator=g), torch.randn(24, 48, generator=g) * 3]


LIVE = "channel, the silent channel 7 left out"  # how a failure names a firing channel


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_factors(impl):
    act_max, weights = _layer()
    w_max = torch.maximum(weights[0].abs().amax(0), weights[1].abs().amax(0))  # 48
    s = impl.smoothing_factors(act_max, weights, 0.5)
    case = "smoothing_factors(48 channels, two outliers, one silent; weights [16, 48], [24, 48]"
    expect(s.shape == (48,) and bool(torch.isfinite(s).all() and (s > 0).all()),
           f"{case}, alpha=0.5)", "48 finite factors > 0", tuple(s.shape))
    live = act_max > 0
    # balanced at α = 0.5
    expect_close((act_max / s)[live], (w_max * s)[live], f"{case}, alpha=0.5): max|x| / s "
                 "against max|W| · s (balanced)", atol=0, rtol=1e-4, dims=LIVE)
    expect_close(impl.smoothing_factors(act_max, weights, 1.0)[live], act_max[live],
                 f"{case}, alpha=1): s against max|x|", atol=1e-5, rtol=1.3e-6, dims=LIVE)
    expect_close(impl.smoothing_factors(act_max, weights, 0.0), 1 / w_max,
                 f"{case}, alpha=0): s against 1 / max|W|", atol=1e-5, rtol=1.3e-6,
                 dims="channel")
    with pytest.raises(NanoserveError, match="alpha"):
        impl.smoothing_factors(act_max, weights, -0.1)


def _model_and_calib():
    model, cfg, _ = load_model("demo-draft")
    calib = torch.randint(0, cfg.vocab_size, (3, 32), generator=torch.Generator().manual_seed(0))
    return model, calib


def _input_maxima(model, calib, groups):
    """max |x_k| of each group's input over calib, measured with hooks: {group name: [K]}."""
    seen = {}

    def record(name, x):
        m = x.reshape(-1, x.shape[-1]).abs().amax(0)
        seen[name] = torch.maximum(seen[name], m) if name in seen else m

    with capture_inputs({name: lins[0] for name, (_, lins) in groups.items()}, record):
        model(calib)
    return seen


@torch.no_grad()
def check_smooth_model(impl):
    model, calib = _model_and_calib()
    prefix, blocks = decoder_blocks(model)
    groups = {}
    for i, b in enumerate(blocks):
        for prev, names in block_groups(model, b):
            if prev is not None:
                groups[f"{prefix}.{i}.{names[0]}"] = (names, [b.get_submodule(n) for n in names])
    # e.g. mlp.up_proj, whose rows down_proj's s divides
    prevs = {prev for prev, _ in block_groups(model, blocks[0])}
    before, logits = _input_maxima(model, calib, groups), model(calib)
    factors = impl.smooth_model(model, calib, alpha=0.5)
    # the float model is unchanged
    case = "smooth_model(demo-draft, alpha=0.5)"
    expect_close(model(calib), logits, f"{case}: the logits after folding (they must not move)",
                 atol=1e-4, rtol=1e-5, dims="b, t, v")
    expect(set(factors) == set(groups), f"{case}: the factors' names", sorted(groups),
           sorted(factors))
    after = _input_maxima(model, calib, groups)
    for name, (names, lins) in groups.items():
        # X' = X / s
        expect_close(after[name], before[name] / factors[name], f"{case}: max|x| into {name} "
                     "against before / s", atol=1e-6, rtol=1e-4, dims="channel")
        if not prevs & set(names):  # no later fold touched these weights: balanced at α = 0.5
            w_max = torch.stack([lin.weight.abs().amax(0) for lin in lins]).amax(0)  # K
            expect_close(after[name], w_max, f"{case}: max|x| into {name} against its weights' "
                         "max|W| (balanced)", atol=1e-5, rtol=2e-3, dims="channel")
    with pytest.raises(NanoserveError, match="calibration ids"):
        impl.smooth_model(model, torch.randn(2, 8))


# ----------------------------------------------------------------------------- the tests
def test_ex16_1_smoothing_factors(impl):
    check_factors(impl)


def test_ex16_2_smooth_model_keeps_the_model_and_balances_every_group(impl):
    check_smooth_model(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _variant(swap_alpha=False, first_only=False, fold_wrong=False):
    def smoothing_factors(act_max, weights, alpha):
        if not 0 <= alpha <= 1:
            raise NanoserveError(f"alpha {alpha}")
        weights = weights[:1] if first_only else weights
        w_max = torch.stack([w.abs().amax(0).float() for w in weights]).amax(0)
        a = 1 - alpha if swap_alpha else alpha
        return (act_max.clamp(min=1e-5) ** a / w_max.clamp(min=1e-5) ** (1 - a)).clamp(min=1e-5)

    @torch.no_grad()
    def smooth_model(model, calib, alpha=0.5, batch_size=8):
        if calib.dim() != 2 or calib.dtype not in (torch.int32, torch.int64):
            raise NanoserveError("calibration ids must be an integer tensor")
        maxima = reference.channel_maxima(model, calib, batch_size)
        prefix, blocks = decoder_blocks(model)
        out = {}
        for i, block in enumerate(blocks):
            for prev, names in block_groups(model, block):
                if prev is None:
                    continue
                lins = [block.get_submodule(n) for n in names]
                s = smoothing_factors(maxima[f"{prefix}.{i}.{names[0]}"],
                                      [lin.weight for lin in lins], alpha)
                fold_scales(block.get_submodule(prev), lins, 1 / s if fold_wrong else s)
                out[f"{prefix}.{i}.{names[0]}"] = s
        return out

    return SimpleNamespace(smoothing_factors=smoothing_factors, smooth_model=smooth_model)


WRONG = {
    "α and 1 − α swapped": (_variant(swap_alpha=True), [check_factors]),  # (at α = 0.5 they agree)
    "the first linear's weights only": (_variant(first_only=True),
                                        [check_factors, check_smooth_model]),
    "1/s folded into the weights, s into the norm": (_variant(fold_wrong=True),
                                                     [check_smooth_model]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex16_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex16_the_checks_pass_on_a_right_variant_built_the_same_way():
    right = _variant()
    for check in (check_factors, check_smooth_model):
        check(right)
