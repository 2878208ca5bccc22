"""8-bit weights and activations (issue 24): W8A8 int8, LLM.int8, SmoothQuant, FP8.

The int8 GEMM is exact against integer arithmetic; each fast layer equals its reference; LLM.int8's
outlier split and SmoothQuant's smoothing beat naive per-token int8 on activations with outlier
features (the negative control: without them, the error is many times larger); folding the smoothing
factors leaves the float model's logits unchanged; FP8 codes are torch's float8_e4m3fn casts. The
engine takes `quantization=` and refuses what it cannot do by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanoserve import LLM, SamplingParams
from nanoserve.errors import NanoserveError
from nanoserve.models.loader import load_model
from nanoserve.quant.fp8 import FP8, FP8Linear, quantize_fp8
from nanoserve.quant.int8 import W8A8Linear, int8_mm, int8_mm_ref, quantize_int8
from nanoserve.quant.llm_int8 import LLMInt8Linear, llm_int8_ref
from nanoserve.quant.model import calibration_ids
from nanoserve.quant.online import quantize_linears
from nanoserve.quant.smoothquant import smooth_model, smoothing_factors


def _outlier_input(seed=0, tokens=24, k=96, features=(5, 40), size=30.0):
    """Activations near 1 with a few outlier features, as LLM.int8 describes them (same columns in
    every token)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    x[:, list(features)] *= size
    return x


def _linear(k=96, n=40, seed=1):
    torch.manual_seed(seed)
    return nn.Linear(k, n)


@pytest.mark.parametrize("shape", [(1, 7, 3), (5, 64, 24), (33, 256, 128)])
def test_int8_gemm_is_exact_integer_arithmetic(shape):
    M, K, N = shape
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    a[0], b[0] = 127, -127  # the extremes: every product at its largest
    want = (a.long()[:, None, :] * b.long()[None, :, :]).sum(-1)  # M, N   int64, term by term
    assert torch.equal(int8_mm(a, b).long(), want) and torch.equal(int8_mm_ref(a, b).long(), want)


def test_w8a8_linear_equals_its_float_reference_and_the_quantizers_bounds():
    lin, x = _linear(), torch.randn(3, 8, 96)
    q = W8A8Linear.from_linear(lin)
    torch.testing.assert_close(q(x), q.forward_ref(x), atol=1e-5, rtol=1e-5)
    codes, s = quantize_int8(x.reshape(-1, 96))  # per token: |x − q·s| ≤ s / 2
    assert ((codes.float() * s[:, None] - x.reshape(-1, 96)).abs() <= s[:, None] / 2 + 1e-6).all()
    with torch.no_grad():
        rel = (q(x) - lin(x)).norm() / lin(x).norm()
    assert rel < 0.02  # plain activations: W8A8 is close


@torch.no_grad()
def test_llm_int8_fast_path_equals_the_feature_by_feature_reference():
    x = _outlier_input()
    q = LLMInt8Linear.from_linear(_linear())
    torch.testing.assert_close(q(x), llm_int8_ref(q, x), atol=1e-4, rtol=1e-5)
    assert q.last_outliers == 2  # the two features above 6.0


@torch.no_grad()
def test_outlier_features_ruin_naive_w8a8_and_llm_int8_and_smoothing_fix_it():
    """Negative control: naive per-token int8 on outlier features errs far more than LLM.int8 or a
    smoothed layer; on the same layer without outliers all three are close."""
    lin, x = _linear(), _outlier_input(features=(5,), size=60.0)
    ref = lin(x)
    err = lambda y: ((y - ref).norm() / ref.norm()).item()  # noqa: E731
    naive, mixed = err(W8A8Linear.from_linear(lin)(x)), err(LLMInt8Linear.from_linear(lin)(x))
    # fold 1/s into x by hand, s into W
    s = smoothing_factors(x.abs().amax(0), [lin.weight], alpha=0.5)
    smoothed = nn.Linear(96, 40)
    smoothed.weight.copy_(lin.weight * s[None, :])
    smoothed.bias.copy_(lin.bias)
    smooth = err(W8A8Linear.from_linear(smoothed)(x / s))
    # 0.022 vs 0.0047 and 0.0038
    assert naive > 3 * mixed and naive > 3 * smooth, (naive, mixed, smooth)
    plain = torch.randn(24, 96, generator=torch.Generator().manual_seed(3))
    ref = lin(plain)
    assert err(W8A8Linear.from_linear(lin)(plain)) < 0.02


def test_smoothing_factors_balance_the_ranges_at_alpha_half():
    lin, x = _linear(), _outlier_input()
    s = smoothing_factors(x.abs().amax(0), [lin.weight], alpha=0.5)
    x_max, w_max = (x / s).abs().amax(0), (lin.weight.detach() * s).abs().amax(0)
    torch.testing.assert_close(x_max, w_max, rtol=1e-4, atol=1e-6)  # max|X'_k| = max|W'_k|
    torch.testing.assert_close(smoothing_factors(x.abs().amax(0), [lin.weight], 0.0),
                               # α = 0: X untouched up to 1/max|W|
                               1 / lin.weight.detach().abs().amax(0))
    with pytest.raises(NanoserveError, match="alpha must lie in"):
        smoothing_factors(x.abs().amax(0), [lin.weight], 1.5)


@pytest.mark.parametrize("model", ["demo", "llama-gqa"])
@torch.no_grad()
def test_smoothing_leaves_the_float_model_unchanged(model, hf_checkpoints):
    path = "demo" if model == "demo" else str(hf_checkpoints[model][0])
    m, cfg, tok = load_model(path)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    before = m(ids)
    factors = smooth_model(m, ids, alpha=0.5)
    assert factors and all((s != 1).any() for s in factors.values())  # something really moved
    # the bound; measured ≤ 6e-6
    torch.testing.assert_close(m(ids), before, atol=1e-5, rtol=1e-5)
    names = quantize_linears(m, W8A8Linear.from_linear)
    assert names and all(isinstance(m.get_submodule(n), W8A8Linear) for n in names)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("activations", [None, "token"])
@torch.no_grad()
def test_fp8_linear_codes_are_torch_float8_and_the_cpu_path_dequantizes(per_channel, activations):
    lin, x = _linear(), torch.randn(2, 5, 96)
    q = FP8Linear.from_linear(lin, "channel" if per_channel else "tensor", activations)
    s = (
        lin.weight.abs().amax(-1, keepdim=True) if per_channel
        else lin.weight.abs().amax().reshape(1, 1)
    )
    assert torch.equal(q.weight.view(torch.uint8),
                       (lin.weight / (s / 448)).to(FP8).view(torch.uint8))
    x2 = x.reshape(-1, 96)
    if activations:
        xq, xs = quantize_fp8(x2, per_row=True)
        x2 = xq.float() * xs
    want = x2.double() @ q.dequantized_weight().double().T + lin.bias.double()
    torch.testing.assert_close(q(x).reshape(-1, 40).double(), want, atol=1e-5, rtol=1e-5)
    assert (q(x) - lin(x)).norm() / lin(x).norm() < 0.06  # FP8: 3 mantissa bits


@pytest.mark.parametrize("quantization", ["fp8", "int8", "llm.int8"])
def test_the_engine_quantizes_on_load(quantization):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM("demo").generate(["ROMEO:"], params, use_tqdm=False)[0]
    llm = LLM("demo", quantization=quantization)
    kinds = {type(m).__name__ for m in llm.model.modules()}
    assert {"fp8": "FP8Linear", "int8": "W8A8Linear",
            "llm.int8": "LLMInt8Linear"}[quantization] in kinds
    out = llm.generate(["ROMEO:"], params, use_tqdm=False)[0]
    agree = sum(a == b for a, b in zip(out.outputs[0].token_ids, plain.outputs[0].token_ids))
    assert agree >= 20, (quantization, out.text, plain.text)  # measured 24 of 24 for all three


def test_the_cli_offers_every_method_the_engine_takes():
    from nanoserve.cli import build_parser
    from nanoserve.config import ENGINE_ARGS, QUANTIZATION_METHODS
    from nanoserve.quant.online import QUANTIZERS

    assert ENGINE_ARGS["quantization"].choices == QUANTIZATION_METHODS == tuple(QUANTIZERS)
    assert build_parser().parse_args(["serve", "--quantization",
                                      "llm.int8"]).quantization == "llm.int8"


def test_bad_quantization_settings_are_refused_by_name(tmp_path):
    with pytest.raises(NanoserveError,
                       match=r"quantization='int4'; allowed: None .*fp8, int8, llm.int8"):
        LLM("demo", quantization="int4")
    with pytest.raises(ValueError, match="threshold must be > 0"):
        LLMInt8Linear.from_linear(_linear(), threshold=0)
    with pytest.raises(ValueError, match="weight_scale must be one of tensor, channel"):
        FP8Linear.from_linear(_linear(), "group")
    from nanoserve.quant.online import quantize_on_load
    from nanoserve.quant.qlinear import QuantLinear

    m = nn.Sequential(QuantLinear(64, 8, 4, 64, False))
    with pytest.raises(NanoserveError, match="already quantized"):
        quantize_on_load(m, "fp8")
    from nanoserve.quant.save import save_compressed

    llm_int8 = load_model("demo-draft")[0]
    quantize_on_load(llm_int8, "llm.int8")
    with pytest.raises(NanoserveError,
                       match=r"one scheme of .* this model has \['LLMInt8Linear'\]"):
        save_compressed(llm_int8, tmp_path / "x")
    model, cfg, tok = load_model("demo")
    with pytest.raises(NanoserveError, match="calibration ids must be an integer tensor"):
        smooth_model(model, torch.randn(2, 8))
    assert calibration_ids(tok, "abc " * 100, 2, 16).shape == (2, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_fp8_and_int8_on_cuda():
    """sm_89+: FP8 × FP8 through torch._scaled_mm; any GPU: int8 through torch._int_mm (padded under
    17 rows)."""
    lin = _linear().cuda().to(torch.bfloat16)
    for M in (1, 40):
        x = torch.randn(M, 96, device="cuda", dtype=torch.bfloat16)
        a = torch.randint(-127, 128, (M, 96), dtype=torch.int8, device="cuda")
        b = torch.randint(-127, 128, (40, 96), dtype=torch.int8, device="cuda")
        assert torch.equal(int8_mm(a, b), int8_mm_ref(a, b))
        q = FP8Linear.from_linear(lin)
        y, ref = q(x).float(), lin(x).float()
        assert (y - ref).norm() / ref.norm() < 0.08
