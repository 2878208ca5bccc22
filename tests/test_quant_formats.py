"""Checkpoint formats (issue 24): GPTQ v2 read, quantize_config.json written, every tokenizer file
copied whatever its size, errors that name the real problem; compressed-tensors' int4 layout by hand
and `nanoserve quantize` writing it (tests/test_compressed_tensors.py checks it against the library
itself).

GPTQ v2 (gptqmodel) stores each zero point itself where v1 stores zero − 1; the v2 file here is made
from a v1 file by adding 1 to every 4-bit field of qzeros nibble by nibble, independently of
nanoserve's packing code. Negative control: the same v2 tensors declared as v1 give other logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from testdata import shared_path

from nanoserve.errors import CheckpointError, NanoserveError
from nanoserve.models.loader import load_model, resolve_model_path
from nanoserve.quant.model import QuantizeConfig, calibration_ids, quantize_model
from nanoserve.quant.save import save_quantized


@pytest.fixture(scope="module")
def v1_checkpoint(tmp_path_factory):
    model, _, tok = load_model("demo-draft")
    text = shared_path("corpora", "tinyshakespeare", "input.txt").read_text()[:50_000]
    calib = calibration_ids(tok, text, nsamples=4, seqlen=64, seed=0)
    res = quantize_model(model, calib, QuantizeConfig(method="rtn", group_size=32, sym=False),
                         progress=False)
    return save_quantized(model, res, tmp_path_factory.mktemp("q") / "v1",
                          tokenizer_from="demo-draft")


def _plus_one_per_nibble(qzeros: torch.Tensor) -> torch.Tensor:
    """Each of the eight 4-bit fields of every int32 word + 1 (none overflows: v1 fields hold zero −
    1 ≤ 14)."""
    words = qzeros.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(words)
    for i in range(8):
        field = (words >> (4 * i)) & 0xF
        assert (field < 15).all()
        out |= (field + 1) << (4 * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _as_v2(v1, out, fmt="gptq_v2"):
    shutil.copytree(v1, out)
    tensors = load_file(str(v1 / "model.safetensors"))
    save_file(
        {k: _plus_one_per_nibble(t) if k.endswith(".qzeros") else t for k, t in tensors.items()},
        str(out / "model.safetensors"),
    )
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = fmt
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@torch.no_grad()
def test_gptq_v2_loads_to_the_v1_model(v1_checkpoint, tmp_path):
    x = torch.randint(0, 257, (2, 30))
    want = load_model(v1_checkpoint)[0](x)
    assert torch.equal(load_model(_as_v2(v1_checkpoint, tmp_path / "v2"))[0](x), want)
    # negative control
    wrong = load_model(_as_v2(v1_checkpoint, tmp_path / "v2-as-v1", fmt="gptq"))[0](x)
    assert (wrong - want).abs().max() > 1e-2


def test_quantize_config_json_and_the_tokenizer_files(v1_checkpoint, tmp_path):
    qc = json.loads((v1_checkpoint / "quantize_config.json").read_text())
    hf = json.loads((v1_checkpoint / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("bits", "group_size", "desc_act", "sym")} == \
        {k: hf[k] for k in ("bits", "group_size", "desc_act", "sym")} == \
        {"bits": 4, "group_size": 32, "desc_act": False, "sym": False}
    # a tokenizer.json over 1 MiB (a Llama-2 one is 3.6 MB) is copied like the rest
    src = tmp_path / "big"
    shutil.copytree(resolve_model_path("demo-draft"), src)
    big = (src / "tokenizer.json").read_text() + " " * (2 << 20)  # still valid JSON
    (src / "tokenizer.json").write_text(big)
    model, _, tok = load_model(src)
    res = quantize_model(model, None, QuantizeConfig(method="rtn", group_size=32), progress=False)
    out = save_quantized(model, res, tmp_path / "q", tokenizer_from=src)
    assert (
        (out / "tokenizer.json").stat().st_size == (src / "tokenizer.json").stat().st_size > 2 << 20
    )
    assert load_model(out)[2].encode("ROMEO:") == tok.encode("ROMEO:")


def test_errors_name_the_real_problem(v1_checkpoint, tmp_path):
    """stories260K's down_proj has K = 172, not a multiple of 8: the error says so, not 'use
    sym=True'."""
    model, _, _ = load_model(shared_path("models", "stories260K", "stories260K.bin"))
    res = quantize_model(model, None, QuantizeConfig(method="rtn", group_size=-1, sym=True),
                         progress=False)
    with pytest.raises(NanoserveError, match="must be multiples of 8") as e:
        save_quantized(model, res, tmp_path / "x")
    assert "sym=True" not in str(e.value)
    bad = _as_v2(v1_checkpoint, tmp_path / "v3", fmt="gptq_v3")
    with pytest.raises(CheckpointError,
                       match="checkpoint_format='gptq_v3' is not supported; allowed: gptq, "
                             "gptq_v2"):
        load_model(bad)


# ----------------------------------------------------------------------------- compressed-tensors,
# without the library
def test_int4_nibbles_are_packed_lowest_first_with_the_plus_8_offset():
    """compressed-tensors' layout, written out by hand: q = −8..7 stored as q + 8, eight per int32,
    lowest first."""
    from nanoserve.quant.compressed_tensors import pack_ints, unpack_ints

    q = torch.arange(-8, 8).repeat(3, 1)  # 3, 16
    words = pack_ints(q + 8, 4)
    assert words.dtype == torch.int32 and words.shape == (3, 2)
    # the second word's top nibble sets the sign
    assert words[0].tolist() == [0x76543210, 0xFEDCBA98 - 2**32]
    ragged = torch.randint(0, 16, (5, 13))
    assert torch.equal(unpack_ints(pack_ints(ragged, 4), 13, 4), ragged)


def test_a_group_size_that_does_not_divide_k_reads_right():
    """K = 96 with group_size 64: two groups, the second one short (the library allows it)."""
    from nanoserve.quant.compressed_tensors import _packed_to_gptq, pack_ints
    from nanoserve.quant.qlinear import QuantLinear

    g = torch.Generator().manual_seed(0)
    N, K, gs = 8, 96, 64
    q = torch.randint(-8, 8, (N, K), generator=g)
    scale = torch.rand(N, 2, generator=g) + 0.1  # N, ⌈96 / 64⌉
    parts = _packed_to_gptq("x", pack_ints(q + 8, 4), scale, None, torch.tensor([N, K]),
                        {"strategy": "group", "group_size": gs, "symmetric": True})
    # the loader's group_size guess; g_idx decides
    layer = QuantLinear(K, N, 4, 48, False, torch.float32)
    for key in ("qweight", "qzeros", "scales", "g_idx"):
        getattr(layer, key).copy_(parts[key])
    want = q.float() * scale.repeat_interleave(gs, 1)[:, :K]
    torch.testing.assert_close(layer.dequantize(), want)
    with pytest.raises(CheckpointError, match="needs ⌈K / group_size⌉"):
        _packed_to_gptq("x", pack_ints(q + 8, 4), scale, None, torch.tensor([N, K]),
                    {"strategy": "group", "group_size": 32, "symmetric": True})


def test_cli_quantize_fp8_and_smoothquant_write_checkpoints_that_load(tmp_path):
    import subprocess
    import sys

    from nanoserve.quant.fp8 import FP8Linear
    from nanoserve.quant.int8 import W8A8Linear

    text = shared_path("corpora", "tinyshakespeare", "input.txt")
    for method, kind, extra in (("fp8", FP8Linear, []),
                                ("smoothquant", W8A8Linear,
                                 ["--calib", str(text), "--nsamples", "4", "--seqlen", "64",
                                                             "--alpha", "0.6"])):
        out = tmp_path / method
        r = subprocess.run([sys.executable, "-m", "nanoserve", "quantize", "--model", "demo-draft",
                            "--method", method,
                            *extra, "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        model, _, tok = load_model(out)
        assert tok is not None and sum(isinstance(m, kind) for m in model.modules()) == 2 * 7
        assert (
            json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"]
            == "compressed-tensors"
        )
    bad = subprocess.run([sys.executable, "-m", "nanoserve", "quantize", "--model", "demo-draft",
                          "--method", "int8",
                          "--bits", "3", "--out", str(tmp_path / "x")], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "--bits does not apply" in bad.stderr
    not_8 = "LM head's 257 outputs (the vocabulary) are not a multiple of 8"
    for method, error in (("int8", "--lm-head does not apply"), ("rtn", not_8)):
        head = subprocess.run([sys.executable, "-m", "nanoserve", "quantize", "--model",
                               "demo-draft", "--method", method, "--lm-head", "--out",
                               str(tmp_path / "z")], capture_output=True, text=True, timeout=300)
        assert head.returncode != 0 and error in head.stderr, head.stderr[-2000:]
    gpt2 = subprocess.run([sys.executable, "-m", "nanoserve", "quantize", "--model", "demo",
                           "--method", "fp8",
                           "--out", str(tmp_path / "y")], capture_output=True, text=True,
                          timeout=300)
    assert gpt2.returncode != 0 and "Conv1D" in gpt2.stderr


def test_a_quantized_model_is_not_quantized_twice(tmp_path):
    from nanoserve.quant.online import quantize_on_load

    model, _, _ = load_model("demo-draft")
    quantize_on_load(model, "int8")
    with pytest.raises(NanoserveError, match="already quantized \\(W8A8Linear layers"):
        quantize_on_load(model, "fp8")
