"""Model-level quantization: the block-by-block driver, QuantLinear, GPTQ-format save / reload, AWQ
load.

The layer-level numerics (GPTQ vs RTN, AWQ folding, packing golden vectors) are proven in
test_quant_{rtn,gptq,awq,packing}.py; here the same pieces run on a whole model (the demo draft,
a trained Llama-shaped model) and through a checkpoint on disk.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from nanoserve import NanoserveError
from nanoserve.errors import CheckpointError
from nanoserve.models.loader import load_model
from nanoserve.quant.model import QuantizeConfig, calibration_ids, quantize_model
from nanoserve.quant.packing import pack_awq
from nanoserve.quant.qlinear import QuantLinear
from nanoserve.quant.rtn import quantize_rtn
from nanoserve.quant.save import replace_linears, save_quantized

SHAKESPEARE = (
    Path(__file__).resolve().parents[2] / "shared" / "corpora" / "tinyshakespeare" / "input.txt"
)


@pytest.fixture(scope="module")
def calib():
    _, _, tok = load_model("demo-draft")
    return calibration_ids(tok, SHAKESPEARE.read_text()[:100_000], nsamples=8, seqlen=64, seed=0)


def _quantized(method, calib, **kw):
    model, cfg, tok = load_model("demo-draft")
    res = quantize_model(model, calib, QuantizeConfig(method=method, **kw), progress=False)
    return model, res


def test_quant_linear_matches_dequantized_float_layer():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 24)
    qw = quantize_rtn(lin.weight, bits=4, group_size=32)
    q = QuantLinear.from_quantized(qw, lin.bias, dtype=torch.float32)
    x = torch.randn(3, 5, 64)
    assert torch.allclose(q(x), F.linear(x, q.dequantize(torch.float32), lin.bias), atol=1e-6)
    # fp16 scales: within fp16 rounding of the fp32 dequantization
    assert torch.allclose(q.dequantize(torch.float32), qw.dequantize(), rtol=1e-3, atol=1e-6)
    assert torch.allclose(q.to_linear()(x), q(x), atol=1e-6)
    with pytest.raises(ValueError, match="bits=5"):
        QuantLinear(64, 24, bits=5, group_size=32, bias=False)


def test_gptq_beats_rtn_block_by_block(calib):
    """Every block's output error on the calibration set: GPTQ < RTN (same grid), and the
    dequantized weights sit on the grid the codes describe."""
    rtn_model, rtn = _quantized("rtn", calib, group_size=32)
    gptq_model, gptq = _quantized("gptq", calib, group_size=32)
    assert len(gptq.qweights) == 2 * 7  # 2 blocks × (q, k, v, o, gate, up, down)
    assert all(g < r for g, r in zip(gptq.block_errors, rtn.block_errors)), (
        gptq.block_errors,
        rtn.block_errors,
    )
    name, qw = next(iter(gptq.qweights.items()))
    assert torch.equal(gptq_model.get_submodule(name).weight, qw.dequantize().float())


def test_static_groups_reach_every_layer(calib):
    """QuantizeConfig(static_groups=True) (llmcompressor's default actorder="static"): under
    act-order every layer keeps groups k // group_size and the grid RTN draws from the original
    weights. Negative control: plain act-order permutes the groups of every layer."""
    original, _, _ = load_model("demo-draft")
    model, res = _quantized("gptq", calib, group_size=32, act_order=True, static_groups=True)
    _, plain = _quantized("gptq", calib, group_size=32, act_order=True)
    moved = 0
    for name, qw in res.qweights.items():
        rtn = quantize_rtn(original.get_submodule(name).weight, 4, 32, sym=True)
        assert torch.equal(qw.g_idx, rtn.g_idx) and torch.equal(qw.scales, rtn.scales), name
        assert torch.equal(model.get_submodule(name).weight, qw.dequantize().float())
        moved += not torch.equal(plain.qweights[name].g_idx, rtn.g_idx)
    assert moved == len(res.qweights)  # every layer's act-order groups differ from k // 32


def test_gptq_checkpoint_round_trip_gives_identical_logits(calib, tmp_path):
    model, res = _quantized("gptq", calib, group_size=32, act_order=True)
    out = save_quantized(model, res, tmp_path / "q", tokenizer_from="demo-draft")
    hf = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (
        hf["quant_method"] == "gptq" and hf["bits"] == 4 and hf["group_size"] == 32
        and hf["desc_act"]
    )
    tensors = load_file(str(out / "model.safetensors"))
    q_proj = "model.layers.0.self_attn.q_proj"
    assert f"{q_proj}.qweight" in tensors and f"{q_proj}.weight" not in tensors
    reloaded, _, _ = load_model(out)
    assert isinstance(reloaded.model.layers[1].mlp.down_proj, QuantLinear)
    packed = replace_linears(model, res.qweights)  # the in-memory model, packed the same way
    x = torch.randint(0, 257, (2, 40))
    assert torch.equal(reloaded(x), packed(x))
    # and close to the fake-quantized float model (the only difference: fp16 scales)
    fake, _ = _quantized("gptq", calib, group_size=32, act_order=True)
    assert (reloaded(x) - fake(x)).abs().max() < 2e-2


def test_gpt2_checkpoint_with_biases_round_trips_to_identical_logits(tmp_path):
    """GPT-2 (biases on every linear, Conv1D layout in HF files) saved and reloaded: the same logits
    as the packed in-memory model. Biases stored in fp16 (a GPTQ habit) would break this."""
    model, cfg, tok = load_model("demo")
    calib = calibration_ids(tok, SHAKESPEARE.read_text()[:50_000], nsamples=4, seqlen=64, seed=0)
    res = quantize_model(model, calib, QuantizeConfig(method="gptq", group_size=64), progress=False)
    out = save_quantized(model, res, tmp_path / "q", tokenizer_from="demo")
    reloaded, _, _ = load_model(out)
    packed = replace_linears(model, res.qweights)
    x = torch.randint(0, 257, (2, 40))
    assert torch.equal(reloaded(x), packed(x))
    # the negative control: rounded biases
    fp16_bias = replace_linears(load_model("demo")[0], res.qweights)
    for name in res.qweights:
        fp16_bias.get_submodule(name).bias.copy_(model.get_submodule(name).bias.half())
    assert not torch.equal(reloaded(x), fp16_bias(x))


def test_awq_checkpoint_loads_to_the_same_weights(calib, tmp_path):
    """An AutoAWQ GEMM checkpoint (written here with packing.pack_awq) loads to the same layers as
    packing our codes directly; a zero point of 0 (AWQ can store it, GPTQ v1 cannot) is refused."""
    model, res = _quantized("awq", calib, group_size=32, sym=False)
    tensors = {
        k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"
    }
    for name, qw in res.qweights.items():
        del tensors[f"{name}.weight"]
        tensors.update(
            {f"{name}.{k}": v for k, v in pack_awq(qw.codes, qw.zeros, qw.scales).items()}
        )
    awq_dir = tmp_path / "awq"
    awq_dir.mkdir()
    save_file(tensors, str(awq_dir / "model.safetensors"))
    cfg = json.loads((_demo_draft_dir() / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32,
                                  "version": "gemm",
                                  "zero_point": True}
    (awq_dir / "config.json").write_text(json.dumps(cfg))
    for f in _demo_draft_dir().iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (awq_dir / f.name).write_bytes(f.read_bytes())
    assert not any((qw.zeros == 0).any() for qw in res.qweights.values())  # with this seed
    loaded, _, _ = load_model(awq_dir)
    x = torch.randint(0, 257, (2, 40))
    assert torch.equal(loaded(x), replace_linears(model, res.qweights)(x))
    # an AWQ zero point of 0 (legal there) cannot be held by the GPTQ v1 layout: refused, by name
    name = "model.layers.0.mlp.down_proj"
    qw = res.qweights[name]
    zeros = qw.zeros.clone()
    zeros[0, 0] = 0
    tensors = load_file(str(awq_dir / "model.safetensors"))
    tensors[f"{name}.qzeros"] = pack_awq(qw.codes, zeros, qw.scales)["qzeros"]
    save_file(tensors, str(awq_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="down_proj: 1 groups have AWQ zero point 0"):
        load_model(awq_dir)


def _demo_draft_dir() -> Path:
    from nanoserve.models.loader import resolve_model_path

    return resolve_model_path("demo-draft")


def test_bad_quantization_input(calib, tmp_path):
    with pytest.raises(NanoserveError, match="not a quantization method"):
        QuantizeConfig(method="squeezellm")
    with pytest.raises(NanoserveError, match="act_order"):
        QuantizeConfig(method="awq", act_order=True)
    with pytest.raises(NanoserveError, match="static_groups"):
        QuantizeConfig(method="rtn", static_groups=True)
    with pytest.raises(NanoserveError, match="static_groups must be True or False"):
        QuantizeConfig(static_groups="yes")
    model, _, _ = load_model("demo-draft")
    with pytest.raises(NanoserveError, match="needs calibration"):
        quantize_model(model, None, QuantizeConfig(method="gptq"), progress=False)
    # an asymmetric grid with a zero point of 0 cannot be written in GPTQ v1
    model, res = _quantized("rtn", calib, group_size=32, sym=False)
    next(iter(res.qweights.values())).zeros[0, 0] = 0  # a group with no negative weight gets zero 0
    with pytest.raises(NanoserveError, match="sym=True"):
        save_quantized(model, res, tmp_path / "x")
    # an unknown quant_method in a checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((_demo_draft_dir() / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes((_demo_draft_dir() / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="not supported"):
        load_model(bad)


def test_cli_quantize_then_eval(tmp_path):
    out = tmp_path / "q"
    cmd = [sys.executable, "-m", "nanoserve", "quantize", "--model", "demo-draft", "--method", "gptq",
           "--group-size", "64", "--calib", str(SHAKESPEARE), "--nsamples", "4", "--seqlen", "64",
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "saved to" in r.stderr
    r = subprocess.run([sys.executable, "-m", "nanoserve", "eval", "--model", str(out), "--text",
                        str(SHAKESPEARE),
                        "--max-tokens", "2000"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "nanoserve", "quantize", "--model", "demo-draft",
                        "--method", "gptq",
                        "--out", str(tmp_path / "y")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "needs --calib" in r.stderr and "Traceback" not in r.stderr
