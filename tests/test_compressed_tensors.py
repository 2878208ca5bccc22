"""compressed-tensors checkpoints against the real library (issue 24; compressed-tensors is a test
extra only).

Read: the library itself quantizes and compresses a tiny random Llama (its `calculate_qparams` sets
the scales, `ModelCompressor` packs and writes) in each scheme nanoserve reads; nanoserve loads the
directory and its dequantized weights equal, bit for bit, those transformers decompresses
(`CompressedTensorsConfig(dequantize= True)`), and its logits match transformers'. Write:
nanoserve's own W4A16 (symmetric and asymmetric), W8A8 and FP8 models saved as compressed-tensors
load in transformers with the same weights and logits. Negative
controls: zero points read along the wrong axis, or without their +8 offset, miss."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from testdata import tiny_hf_checkpoint

from nanoserve.errors import CheckpointError
from nanoserve.models.loader import load_model
from nanoserve.quant.compressed_tensors import unpack_int4
from nanoserve.quant.fp8 import FP8Linear
from nanoserve.quant.int8 import W8A8Linear
from nanoserve.quant.model import QuantizeConfig, quantize_model
from nanoserve.quant.online import quantize_on_load
from nanoserve.quant.qlinear import QuantLinear
from nanoserve.quant.save import replace_linears, save_compressed

ct = pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
SCHEMES = ["w4a16_sym", "w4a16_asym", "w8a8", "fp8_dynamic", "fp8_tensor", "fp8_weight_only"]
WEIGHT_ONLY = {"w4a16_sym", "w4a16_asym", "fp8_weight_only"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=264,
                                   max_position_embeddings=128,
                                   tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("ct") / "float"
    tiny_hf_checkpoint(cfg, path, seed=3)
    return path


def _scheme(name):
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        preset_name_to_scheme,
    )

    if name.startswith("w4a16"):
        return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=name.endswith("sym") and not name.endswith("asym"),
            strategy="group",
            group_size=32))
    if name in ("w8a8", "fp8_dynamic"):
        return preset_name_to_scheme(
            {"w8a8": "W8A8", "fp8_dynamic": "FP8_DYNAMIC"}[name], ["Linear"]
        )
    act = (
        None
        if name == "fp8_weight_only"
        else QuantizationArgs(
            num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True
        )
    )
    return QuantizationScheme(targets=["Linear"], format="float-quantized", input_activations=act, weights=(
        QuantizationArgs(num_bits=8, type="float", symmetric=True,
                         strategy="tensor" if name == "fp8_tensor" else "channel")))


@torch.no_grad()
def _library_checkpoint(src, name, out, ignore=("lm_head",)):
    """What llmcompressor's minmax path writes, with compressed-tensors alone: scales from
    calculate_qparams (`ignore=()`: the LM head quantized too)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    apply_quantization_config(model,
                              QuantizationConfig(config_groups={"group_0": _scheme(name)},
                                                 ignore=list(ignore)))
    for mod in model.modules():
        if not hasattr(mod, "quantization_scheme"):
            continue
        args, w = mod.quantization_scheme.weights, mod.weight.float()
        if args.strategy == "group":
            w = w.unflatten(-1, (-1, args.group_size))
        # [N, 1] per channel, [N, K/g] per group, one value per tensor
        keep = args.strategy == "channel"
        mn, mx = (w.amin(), w.amax()) if args.strategy == "tensor" else (w.amin(-1, keepdim=keep),
                                                                          w.amax(-1, keepdim=keep))
        scale, zp = calculate_qparams(mn, mx, args)
        mod.weight_scale.data = scale.to(mod.weight_scale.dtype).reshape(mod.weight_scale.shape)
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data = zp.to(mod.weight_zero_point.dtype).reshape(
                mod.weight_zero_point.shape
            )
        mod.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    return out


def _transformers_dense(path):
    """transformers' own decompression: every quantized weight dequantized, a plain float model."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.CompressedTensorsConfig(dequantize=True),
        dtype=torch.float32).eval()


def _dequantized(module) -> torch.Tensor:
    if isinstance(module, QuantLinear):
        return module.to_linear().weight
    return module.dequantized_weight()


def _ids():
    return torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", SCHEMES)
@torch.no_grad()
def test_checkpoints_the_library_writes_load_with_its_weights(tiny, tmp_path, name):
    path = _library_checkpoint(tiny, name, tmp_path / name)
    ours, _, _ = load_model(path)
    dense = _transformers_dense(path)
    kind = QuantLinear if name.startswith("w4") else W8A8Linear if name == "w8a8" else FP8Linear
    layers = {n: m for n, m in ours.named_modules() if isinstance(m, kind)}
    assert len(layers) == 2 * 7  # every block linear; the LM head stays float
    for n, m in layers.items():
        assert torch.equal(_dequantized(m).float(), dense.get_submodule(n).weight.float()), n
    x = _ids()
    if name in WEIGHT_ONLY:  # the same weights, float activations: the same model
        torch.testing.assert_close(ours(x), dense(x).logits, atol=1e-4, rtol=1e-4)
    else:
        # 8-bit activations: transformers fake-quantizes them per token as we do; FP8 the same
        # grid (measured: equal), int8 absmax / 127.5 over [-128, 127] where we (and vLLM's
        # kernel) use absmax / 127 (measured 0.006)
        theirs = (
            transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) .eval()(x)
            .logits
        )
        assert (ours(x) - theirs).abs().max() < (0.01 if name == "w8a8" else 1e-5)


@pytest.mark.parametrize("name", ["w4a16_sym", "w4a16_asym", "w8a8", "fp8"])
@torch.no_grad()
def test_our_checkpoints_load_in_transformers(tiny, tmp_path, name):
    model, _, _ = load_model(tiny)
    if name.startswith("w4"):
        res = quantize_model(model, None,
                             QuantizeConfig(method="rtn", group_size=32, sym=name == "w4a16_sym"),
                             progress=False)
        replace_linears(model, res.qweights)
    else:
        quantize_on_load(model, "int8" if name == "w8a8" else "fp8")
    out = save_compressed(model, tmp_path / name)
    dense = _transformers_dense(out)
    for n, m in model.named_modules():
        if isinstance(m, (QuantLinear, W8A8Linear, FP8Linear)):
            torch.testing.assert_close(dense.get_submodule(n).weight.float(),
                                       _dequantized(m).float(), atol=0,
                                       rtol=0, msg=n)
    x = _ids()
    reloaded = load_model(out)[0]
    assert torch.equal(reloaded(x), model(x))  # and back into nanoserve, the same model
    if name.startswith("w4"):
        torch.testing.assert_close(dense(x).logits, model(x), atol=1e-4, rtol=1e-4)
    else:
        theirs = (
            transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32) .eval()(x)
            .logits
        )
        assert (theirs - model(x)).abs().max() < (0.01 if name == "w8a8" else 1e-5)


@torch.no_grad()
def test_negative_controls_zero_points_on_the_wrong_axis_or_without_the_offset(tiny, tmp_path):
    path = _library_checkpoint(tiny, "w4a16_asym", tmp_path / "asym")
    t = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"  # N = 64, K = 128: 4 groups of 32
    N, K = t[f"{name}.weight_shape"].tolist()
    codes = unpack_int4(t[f"{name}.weight_packed"], K)  # N, K   q + 8
    scale = t[f"{name}.weight_scale"].float()  # N, G
    want = _transformers_dense(path).get_submodule(name).weight
    G = scale.shape[1]
    right = unpack_int4(t[f"{name}.weight_zero_point"].T, N).T  # N, G   z + 8, packed along N
    dequant = lambda zeros: (
        (codes - zeros.repeat_interleave(K // G, 1)) * scale.repeat_interleave(K // G, 1)
    )
    assert torch.equal(dequant(right), want)
    assert not torch.allclose(dequant(right - 8), want)  # the +8 offset forgotten
    # packed along G: garbage
    wrong_axis = unpack_int4(t[f"{name}.weight_zero_point"], G * 8)[:, :G]
    wrong = torch.zeros(N, G, dtype=torch.int64)
    wrong[: wrong_axis.shape[0]] = wrong_axis
    assert not torch.allclose(dequant(wrong), want)


@torch.no_grad()
def test_a_quantized_lm_head_both_ways(tiny, tmp_path):
    """The library quantizes the LM head too (nothing ignored): nanoserve loads it as a QuantLinear
    with transformers' weights and logits. nanoserve's own head (`lm_head=True`) is left off the
    ignore list and loads in transformers with its weights. Negative control: the library's head
    ignored stays a float linear."""
    path = _library_checkpoint(tiny, "w4a16_asym", tmp_path / "head", ignore=())
    ours = load_model(path)[0]
    dense = _transformers_dense(path)
    assert isinstance(ours.lm_head, QuantLinear)
    assert torch.equal(_dequantized(ours.lm_head).float(), dense.lm_head.weight.float())
    torch.testing.assert_close(ours(_ids()), dense(_ids()).logits, atol=1e-4, rtol=1e-4)
    ignored = load_model(_library_checkpoint(tiny, "w4a16_asym", tmp_path / "no-head"))[0]
    assert isinstance(ignored.lm_head, torch.nn.Linear)

    model = load_model(tiny)[0]
    res = quantize_model(model, None, QuantizeConfig(method="rtn", group_size=32, lm_head=True),
                         progress=False)
    out = save_compressed(replace_linears(model, res.qweights), tmp_path / "ours")
    assert "lm_head" not in json.loads((out / "config.json").read_text())[
        "quantization_config"]["ignore"]
    dense = _transformers_dense(out)
    assert torch.equal(dense.lm_head.weight.float(), _dequantized(model.lm_head).float())
    torch.testing.assert_close(dense(_ids()).logits, model(_ids()), atol=1e-4, rtol=1e-4)


def test_unsupported_schemes_are_refused_by_name(tiny, tmp_path):
    import shutil

    path = _library_checkpoint(tiny, "w8a8", tmp_path / "w8a8")
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError,
                       match="compressed-tensors scheme not supported: format='int-quantized'"):
        load_model(bad)
    cfg["quantization_config"]["quantization_status"] = "frozen"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quantization_status='frozen'"):
        load_model(bad)
