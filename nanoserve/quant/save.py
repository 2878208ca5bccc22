"""Saving a quantized model in the GPTQ (v1 or v2) or compressed-tensors format, so that other
tools load it too.

A GPTQ checkpoint is an ordinary HF directory (config.json + model.safetensors) where each
quantized linear `<name>.weight` is replaced by `<name>.qweight / .qzeros / .scales / .g_idx`
(packing.py has the layout) and config.json carries a `quantization_config`. Loading is load.py
(which models/loader.py calls, so this module may use the loader without an import cycle).
Taught in notebooks/05_*.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from ..errors import NanoserveError
from ..models.loader import resolve_model_path, save_checkpoint
from . import compressed_tensors
from .model import QuantizeResult
from .packing import pack_gptq, pack_gptq_v2_zeros
from .qlinear import QuantLinear

# v1 (AutoGPTQ: zero points − 1) and gptqmodel's v2 (the zero points themselves)
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def replace_linears(model: nn.Module, qweights: dict,
                    dtype: torch.dtype | None = None) -> nn.Module:
    """Swap each nn.Linear named in `qweights` (name → QuantizedWeight) for a packed QuantLinear."""
    for name, qw in qweights.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        lin = getattr(parent, child)
        if not isinstance(lin, nn.Linear):
            raise NanoserveError(f"{name} is a {type(lin).__name__}, not an nn.Linear; it cannot "
                                 "be quantized")
        try:
            q = QuantLinear.from_quantized(qw, lin.bias, dtype or lin.weight.dtype)
        except ValueError as e:
            raise NanoserveError(f"{name} [{lin.out_features}, {lin.in_features}] cannot be "
                                 f"packed: {e}") from e
        setattr(parent, child, q)
    return model


def save_quantized(model: nn.Module, result: QuantizeResult, directory: str | os.PathLike,
                   tokenizer_from: str | os.PathLike | None = None,
                   checkpoint_format: str = "gptq") -> Path:
    """Write the model of `quantize_model` in the GPTQ format: config.json + model.safetensors
    (+ the tokenizer files of `tokenizer_from`, a model name or path, so the directory loads alone).

    Scales are stored in fp16, as GPTQ checkpoints do; biases in the model's dtype. Other tools
    (transformers + a GPTQ backend, vLLM) load the result. `checkpoint_format` "gptq" is v1
    (AutoGPTQ's: zero points − 1); "gptq_v2" stores the zero points themselves, the form in which
    gptqmodel reads an asymmetric grid written by another tool (it refuses asymmetric v1 unless it
    made the file). Either way a zero point of 0 is refused: nanoserve computes in v1's layout."""
    if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
        raise NanoserveError(f"checkpoint_format={checkpoint_format!r}; allowed: "
                             f"{', '.join(GPTQ_CHECKPOINT_FORMATS)}")
    odd = [r.name for r in result.layers if r.group_size != result.config.group_size]
    if odd:
        raise NanoserveError(f"the GPTQ format has one group size per model; {odd[0]} (and "
                             f"{len(odd) - 1} more) fell back to one group per row because its "
                             f"width is not a multiple of group_size={result.config.group_size}; "
                             "pick a group size that divides every layer's input width, or -1")
    replaced = {}
    for name, qw in result.qweights.items():
        try:
            replaced[name] = pack_gptq(qw.codes, qw.zeros, qw.scales, qw.g_idx, qw.bits)
        except ValueError as e:
            hint = (" Quantize with sym=True (zero points are then "
                    "2^(bits-1))" if not result.config.sym
                    and "zero" in str(e) else "")
            raise NanoserveError(f"{name} cannot be written in the GPTQ v1 format: "
                                 f"{e}.{hint}") from e
        if checkpoint_format == "gptq_v2":
            replaced[name]["qzeros"] = pack_gptq_v2_zeros(qw.zeros, qw.bits)
        bias = model.get_submodule(name).bias
        if bias is not None:
            # the model's own dtype: GPTQ readers cast it anyway, and fp16 here would make the
            # reloaded model differ from the one in memory (scales are fp16 in both: the format's
            # dtype)
            replaced[name]["bias"] = bias.detach()
    hf = {**result.config.hf_config(), "checkpoint_format": checkpoint_format}
    out = save_checkpoint(model, directory, replaced, hf)
    # AutoGPTQ reads its settings from quantize_config.json, not from config.json
    settings = {**quantize_config(result.config), "checkpoint_format": checkpoint_format}
    (out / "quantize_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, out)
    return out


def save_compressed(model: nn.Module, directory: str | os.PathLike,
                    tokenizer_from: str | os.PathLike | None = None) -> Path:
    """Write a model whose block linears are 8-bit (W8A8Linear, FP8Linear) or 4-bit QuantLinears in
    the compressed-tensors format (compressed_tensors.py): llmcompressor's, which vLLM and
    transformers read."""
    check_compressed_target(model.config)
    replaced, qcfg = compressed_tensors.tensors_and_config(model)
    out = save_checkpoint(model, directory, replaced, qcfg)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, out)
    return out


def check_compressed_target(cfg) -> None:
    """compressed-tensors names the layers it leaves float by their HF names, and transformers reads
    the file as it is: refuse the models whose HF layout differs from nanoserve's (before any
    quantization runs)."""
    if cfg.arch == "gpt2":
        raise NanoserveError("compressed-tensors quantizes nn.Linear modules; transformers' GPT-2 "
                             "has Conv1D layers, so its checkpoint would not load: save GPT-2 in "
                             "the GPTQ format")
    if cfg.hf_model_type in ("phi3", "mixtral") or getattr(cfg, "num_experts", 0):
        raise NanoserveError(f"writing compressed-tensors for model_type={cfg.hf_model_type!r} is "
                             "not supported: its HF layout (fused or renamed layers, experts) "
                             "differs from nanoserve's")


def quantize_config(config) -> dict:
    """AutoGPTQ's quantize_config.json for a QuantizeConfig (the same settings as config.json's
    block)."""
    return {"bits": config.bits, "group_size": config.group_size, "damp_percent": config.damp,
            "desc_act": config.act_order, "static_groups": config.static_groups, "sym": config.sym,
            "true_sequential": True, "lm_head": config.lm_head,
            "model_name_or_path": None, "model_file_base_name": "model", "quant_method": "gptq",
            "checkpoint_format": "gptq"}


# the files a tokenizer (and a chat template) may live in: copied by name, whatever their size (a
# Llama-2 tokenizer.json is 3.6 MB); never the weights (a llama2.c checkpoint is a .bin too, but not
# tok*.bin)
TOKENIZER_FILES = ("tokenizer*.json", "tokenizer*.model", "tokenizer*.bin", "tokenizer*.tiktoken",
                   "tok*.bin", "tiktoken_config.json", "vocab.json", "merges.txt", "encoder.json",
                   "vocab.bpe", "vocab.txt", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


def copy_tokenizer(model: str | os.PathLike, out: Path) -> list[str]:
    """The tokenizer files of checkpoint `model` copied into folder `out`; their names."""
    src = resolve_model_path(model)
    src = src if src.is_dir() else src.parent
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and any(fnmatch.fnmatch(f.name, pattern) for pattern in TOKENIZER_FILES):
            shutil.copy(f, out / f.name)
            copied.append(f.name)
    return copied
