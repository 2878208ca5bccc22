"""LoRA adapters (nanoserve/lora/) against PEFT itself: adapters made with `peft.get_peft_model` on
tiny random HF checkpoints (A and B both random: PEFT's init leaves B = 0, an update that changes
nothing) and saved with `save_pretrained`; `LLM(path, lora=adapter)` must give PEFT's logits (fp32,
1e-4) and its greedy tokens. GPT-2 (Conv1D layers, `c_proj` naming two modules), a GQA Llama, and
Phi-3 (LoRA on its fused qkv_proj and gate_up_proj, split by rows like the weights); rsLoRA's scale.
Negative controls: the base model misses PEFT's logits by far, and unmerging gives the base back.
Refusals: every config field that would change the math and is not implemented, a module the model
lacks, a shape that does not fit, a missing file.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from lora_helpers import TARGETS, make_peft_adapter

from nanoserve import LLM
from nanoserve.errors import CheckpointError
from nanoserve.lora import (
    LoRALinear,
    apply_lora,
    load_lora_adapter,
    merge_lora,
    remove_lora,
    unmerge_lora,
)

peft = pytest.importorskip("peft")

IDS = [5, 17, 99, 3, 42, 8, 77, 1, 64, 23, 11, 90]
_adapter = make_peft_adapter


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("case", ["gpt2", "llama-gqa", "phi3"])
def test_adapter_matches_peft_merged_and_not(hf_checkpoints, tmp_path, case, merge):
    path, hf = hf_checkpoints[case]
    model, adapter = _adapter(hf, tmp_path / "adapter", TARGETS[case])
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].float()  # T, V
        base = hf(torch.tensor([IDS])).logits[0].float()
    llm = LLM(str(path), dtype="float32", lora=str(adapter), lora_merge=merge)
    got = llm.logits(IDS)
    assert (got - want).abs().max().item() <= 1e-4
    # the control: the adapter changes the logits by far more
    assert (base - want).abs().max().item() > 1e-2
    with torch.no_grad():
        hf_tokens = model.generate(
            torch.tensor([IDS]), max_new_tokens=32, do_sample=False,
            attention_mask=torch.ones(1, len(IDS), dtype=torch.long),
        )[0, len(IDS) :].tolist()
    from nanoserve import SamplingParams

    out = llm.generate([IDS], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_tokens
    unmerge_lora(llm.model, llm.lora) if merge else remove_lora(llm.model)  # and the base is back
    assert (llm.logits(IDS) - base).abs().max().item() <= 1e-4


def test_rslora_scale_matches_peft(hf_checkpoints, tmp_path):
    path, hf = hf_checkpoints["llama-gqa"]
    model, adapter = _adapter(hf, tmp_path / "rs", ["q_proj", "v_proj"], seed=1, r=8, lora_alpha=4,
                              use_rslora=True)
    with torch.no_grad():
        want = model(torch.tensor([IDS])).logits[0].float()
    assert load_lora_adapter(adapter,
                             LLM(str(path),
                                 dtype="float32").config).scale == pytest.approx(4 / 8 ** 0.5)
    assert (LLM(str(path), dtype="float32",
                lora=str(adapter)).logits(IDS) - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("field,value",
                         [("use_dora", True), ("bias", "all"), ("modules_to_save", ["lm_head"]),
                                         ("rank_pattern", {"q_proj": 2}),
                          ("alpha_pattern", {"q_proj": 2})])
def test_fields_that_change_the_math_are_refused_by_name(hf_checkpoints, tmp_path, field, value):
    path, hf = hf_checkpoints["llama-gqa"]
    _, adapter = _adapter(hf, tmp_path / "a", ["q_proj"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(CheckpointError, match=re.escape(f"{field}={value!r} is not supported")):
        LLM(str(path), dtype="float32", lora=str(adapter))


def test_adapters_for_another_model_are_refused(hf_checkpoints, tmp_path):
    llama_path, llama = hf_checkpoints["llama-gqa"]
    gpt2_path, gpt2 = hf_checkpoints["gpt2"]
    _, for_gpt2 = _adapter(gpt2, tmp_path / "g", ["c_fc"])
    with pytest.raises(CheckpointError,
                       match="updates 'transformer.h.0.mlp.c_fc', which this model does not have"):
        LLM(str(llama_path), dtype="float32", lora=str(for_gpt2))
    _, for_llama = _adapter(llama, tmp_path / "l", ["q_proj"])
    llm = LLM(str(llama_path), dtype="float32")
    adapter = load_lora_adapter(for_llama, llm.config)
    # as if trained on a model twice as wide there, with the same names
    last = list(adapter.factors)[-1]
    A, B = adapter.factors[last]
    adapter.factors[last] = (A, torch.zeros(2 * B.shape[0], B.shape[1]))
    before = llm.logits(IDS)
    with pytest.raises(CheckpointError, match="the adapter was trained on another model shape"):
        merge_lora(llm.model, adapter)
    assert torch.equal(llm.logits(IDS), before)  # every target is checked before any weight changes
    (for_llama / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="adapter_model.safetensors is missing"):
        LLM(str(llama_path), dtype="float32", lora=str(for_llama))


def test_merging_into_a_quantized_base_is_refused(hf_checkpoints, tmp_path):
    path, hf = hf_checkpoints["llama-gqa"]
    _, adapter = _adapter(hf, tmp_path / "q", ["q_proj"])
    with pytest.raises(CheckpointError,
                       match="not a plain linear layer: merging into a quantized layer"):
        LLM(str(path), dtype="float32", quantization="int8", lora=str(adapter))


def test_a_tied_lm_head_is_refused(hf_checkpoints, tmp_path):
    path, hf = hf_checkpoints["gpt2"]  # lm_head shares the token embedding's weight
    from safetensors.torch import load_file, save_file

    _, adapter = _adapter(hf, tmp_path / "t", ["lm_head"])
    file = adapter / "adapter_model.safetensors"
    with pytest.raises(CheckpointError,
                       match="'base_model.model.lm_head.base_layer.weight' is not a LoRA A or B"):
        # PEFT saved the tied base weight beside A and B
        LLM(str(path), dtype="float32", lora=str(adapter))
    save_file({k: v for k, v in load_file(str(file)).items() if ".lora_" in k}, str(file))
    with pytest.raises(CheckpointError,
                       match="'lm_head' shares its weight with 'transformer.wte.weight'"):
        # A and B alone: merging would change the embedding
        LLM(str(path), dtype="float32", lora=str(adapter))


def test_unmerged_on_an_int4_base_equals_merged_on_its_dequantized_weights(
    hf_checkpoints, tmp_path
):
    """QLoRA-style: RTN int4 QuantLinears (no float W to add ΔW to) with the adapter beside them
    equal the float model holding the same dequantized weights with the adapter merged (proven
    against PEFT above)."""
    import transformers
    from testdata import tiny_hf_checkpoint

    from nanoserve.models.loader import load_model
    from nanoserve.quant.model import QuantizeConfig, quantize_model
    from nanoserve.quant.qlinear import QuantLinear
    from nanoserve.quant.save import replace_linears

    path = tmp_path / "llama"  # every linear's dims multiples of 8, as 4-bit packing needs
    hf = tiny_hf_checkpoint(transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=2,
                                                     num_attention_heads=4, num_key_value_heads=2,
                                                     vocab_size=264,
                                                     max_position_embeddings=64), path, seed=3)
    _, adapter_dir = _adapter(hf, tmp_path / "q4", TARGETS["llama-gqa"])
    model, cfg, _ = load_model(str(path), dtype="float32", device="cpu")
    # W <- Ŵ
    res = quantize_model(model, None, QuantizeConfig(method="rtn", group_size=16), progress=False)
    int4 = copy.deepcopy(model)
    replace_linears(int4, res.qweights)
    adapter = load_lora_adapter(adapter_dir, cfg)
    with pytest.raises(CheckpointError, match="is a QuantLinear, not a plain linear layer"):
        merge_lora(int4, adapter)
    ids = torch.tensor([IDS])
    with torch.no_grad():
        plain_int4 = int4(ids)[0]
        merge_lora(model, adapter)
        want = model(ids)[0]
        names = apply_lora(int4, adapter)
        got = int4(ids)[0]
    assert all(isinstance(int4.get_submodule(n), LoRALinear) for n in names)
    assert all(isinstance(int4.get_submodule(n).base, QuantLinear) for n in names)
    assert (got - want).abs().max().item() <= 1e-4
    # the control: the int4 base without its adapter
    assert (plain_int4 - want).abs().max().item() > 1e-2
    with pytest.raises(ValueError, match="already carries an adapter"):
        apply_lora(int4, adapter)
