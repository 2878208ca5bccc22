"""Asymmetric GPTQ grids written in GPTQ v2 (issue 47): the form gptqmodel reads an asymmetric grid
in when another tool wrote it (it refuses asymmetric v1 "unless produced by gptqmodel ≥ 0.9").

The format's definition, from gptqmodel (its v1 → v2 converter): a v2 layer is the v1 layer with
every qzeros field one higher, i.e. for 4 bits the int32 word + 0x11111111; the fields then hold
the zero points themselves. Checked: nanoserve's v2 file is its v1 file with exactly that change,
the fields read back (by hand, nibble i at bits 4i .. 4i + 3) as the quantizer's zero points, both
configs say checkpoint_format "gptq_v2", and nanoserve loads it to the model in memory. Negative
control: the same file read as v1 is another model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from testdata import tiny_hf_checkpoint

from nanoserve.errors import NanoserveError
from nanoserve.models.loader import load_model
from nanoserve.quant.model import QuantizeConfig, quantize_model
from nanoserve.quant.save import replace_linears, save_quantized

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=264,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("v2") / "float"
    tiny_hf_checkpoint(cfg, path, seed=7)
    model = load_model(path)[0]
    res = quantize_model(model, None, QuantizeConfig(method="rtn", group_size=32, sym=False),
                         progress=False)
    return model, res, tmp_path_factory.mktemp("v2")


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, W] -> its 4-bit fields [R, 8W], field i of a word at bits 4i .. 4i + 3."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], dim=-1).flatten(1)


@torch.no_grad()
def test_asymmetric_grids_in_gptq_v2(quantized):
    model, res, tmp = quantized
    v1 = save_quantized(model, res, tmp / "v1")
    v2 = save_quantized(model, res, tmp / "v2", checkpoint_format="gptq_v2")
    for path, fmt in ((v1, "gptq"), (v2, "gptq_v2")):
        assert json.loads((path / "config.json").read_text())["quantization_config"][
            "checkpoint_format"] == fmt
        assert json.loads((path / "quantize_config.json").read_text())["checkpoint_format"] == fmt
    t1 = load_file(str(v1 / "model.safetensors"))
    t2 = load_file(str(v2 / "model.safetensors"))
    assert t1.keys() == t2.keys()
    for k in t1:
        if not k.endswith(".qzeros"):
            assert torch.equal(t1[k], t2[k]), k
            continue
        plus_one = (t1[k].to(torch.int64) + 0x11111111) & 0xFFFFFFFF  # gptqmodel's v1 -> v2
        assert torch.equal(t2[k].to(torch.int64) & 0xFFFFFFFF, plus_one), k
        zeros = res.qweights[k[: -len(".qzeros")]].zeros  # N, G
        assert torch.equal(_nibbles(t2[k]).T, zeros.to(torch.int64)), k  # packed along N

    x = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    want = replace_linears(model, res.qweights)(x)
    assert torch.equal(load_model(v2)[0](x), want)
    assert torch.equal(load_model(v1)[0](x), want)

    cfg = json.loads((v2 / "config.json").read_text())
    cfg["quantization_config"]["checkpoint_format"] = "gptq"  # the v2 file read as v1
    (v2 / "config.json").write_text(json.dumps(cfg))
    assert (load_model(v2)[0](x) - want).abs().max() > 1e-2


def test_unknown_gptq_formats_are_refused(quantized):
    model, res, tmp = quantized
    with pytest.raises(NanoserveError, match="checkpoint_format='gptq_v3'; allowed: gptq, "
                                             "gptq_v2"):
        save_quantized(model, res, tmp / "x", checkpoint_format="gptq_v3")
