"""Loading quantized checkpoints: GPTQ (v1) and AutoAWQ (GEMM) layers become QuantLinears.

A GPTQ checkpoint is an ordinary HF directory (config.json + model.safetensors) where each
quantized linear `<name>.weight` is replaced by `<name>.qweight / .qzeros / .scales / .g_idx`
(packing.py has the layout) and config.json carries

    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                            "desc_act": false, "sym": true, ...}

gptqmodel's GPTQ v2 (`"checkpoint_format": "gptq_v2"`) stores the zero points themselves where v1
stores zero − 1; it is converted to v1 on load. An AutoAWQ (GEMM) checkpoint has
`qweight / qzeros / scales` in its own interleaved layout and
`"quant_method": "awq"`. nanoserve computes with one layout, `QuantLinear`'s (GPTQ v1), so AWQ
tensors are unpacked and repacked on load; since v1 stores zero − 1, a group whose AWQ zero
point is 0 cannot be held and is refused with a clear error.

GPT-2's Conv1D layers are stored in quantized checkpoints with the same [K/8, N] qweight as
any linear (AutoGPTQ replaces them by its QuantLinear), so no transposition applies to them.
compressed-tensors checkpoints (llmcompressor's) are read by compressed_tensors.py: W4A16 layers
become QuantLinears, W8A8 int8 and FP8 ones `W8A8Linear` / `FP8Linear`. models/loader.py calls
`quantized_layers` and `install_quant_linears`; saving is save.py.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import CheckpointError
from . import compressed_tensors
from .packing import pack_gptq, unpack_awq, unpack_gptq
from .qlinear import QuantLinear

SUPPORTED_QUANT_METHODS = ("gptq", "awq", "compressed-tensors")
# v1 stores each zero point − 1 (AutoGPTQ's offset), v2 the zero point itself
GPTQ_FORMATS = ("gptq", "gptq_v2")


def check_quantization_config(qcfg: dict) -> str:
    """The quant_method of a checkpoint's quantization_config, or a CheckpointError."""
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if method == "compressed-tensors":
        compressed_tensors.scheme(qcfg)  # a CheckpointError naming an unsupported scheme
    if method not in SUPPORTED_QUANT_METHODS:
        raise CheckpointError(f"quantization_config.quant_method={method!r} is not supported; "
                              f"nanoserve loads {', '.join(SUPPORTED_QUANT_METHODS)} checkpoints")
    fmt = qcfg.get("checkpoint_format", "gptq")
    if method == "gptq" and fmt not in GPTQ_FORMATS:
        raise CheckpointError(f"GPTQ checkpoint_format={fmt!r} is not supported; allowed: "
                              f"{', '.join(GPTQ_FORMATS)}")
    if method == "awq" and str(qcfg.get("version", "gemm")).lower() != "gemm":
        raise CheckpointError(f"AWQ version={qcfg.get('version')!r} is not supported (only 'gemm')")
    bits = qcfg.get("bits", qcfg.get("w_bit"))
    if method == "awq" and bits != 4:
        raise CheckpointError(f"AWQ checkpoints are 4-bit; this one says bits={bits!r}")
    return method


def quantized_layers(tensors: dict[str, torch.Tensor],
                     qcfg: dict) -> dict[str, dict[str, torch.Tensor]]:
    """name → GPTQ v1 tensors {qweight, qzeros, scales, g_idx, bias?} for every quantized linear;
    AWQ tensors are repacked. Removes those entries from `tensors`."""
    method = check_quantization_config(qcfg)
    if method == "compressed-tensors":
        return compressed_tensors.read_layers(tensors, qcfg)
    bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
    names = sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight"))
    if not names:
        raise CheckpointError(f"config.json declares a {method} quantization_config but no tensor "
                              "is named *.qweight")
    layers = {}
    for name in names:
        parts = {
            p: tensors.pop(f"{name}.{p}") for p in ("qweight", "qzeros", "scales", "g_idx", "bias")
            if f"{name}.{p}" in tensors
        }
        if method == "awq":
            gs = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
            try:
                codes, zeros, scales = unpack_awq(parts["qweight"], parts["qzeros"],
                                                  parts["scales"], gs)
            except (KeyError, ValueError) as e:
                raise CheckpointError(f"{name}: not a valid AWQ GEMM layer: {e}") from e
            if (zeros == 0).any():
                raise CheckpointError(f"{name}: {(zeros == 0).sum().item()} groups have AWQ zero "
                                      "point 0, which the GPTQ v1 layout nanoserve computes with "
                                      "(zero − 1 per field) cannot hold")
            g_idx = torch.arange(codes.shape[1], dtype=torch.int32) // gs
            packed = pack_gptq(codes, zeros, scales, g_idx, 4)
            parts.update(packed)
        elif "g_idx" not in parts:
            raise CheckpointError(f"{name}: GPTQ layer without g_idx")
        elif qcfg.get("checkpoint_format") == "gptq_v2":
            parts.update(_v2_to_v1(name, parts, bits))
        parts["bits"] = bits
        layers[name] = parts
    if qcfg.get("lm_head") is True and "lm_head" not in layers:
        raise CheckpointError("quantization_config says lm_head: true (a quantized LM head) but "
                              "the checkpoint has no lm_head.qweight")
    return layers


def _v2_to_v1(name: str, parts: dict, bits: int) -> dict[str, torch.Tensor]:
    """GPTQ v2 tensors (gptqmodel's format: qzeros hold the zero points themselves) in the v1
    layout."""
    try:
        codes, zeros, scales, g_idx = unpack_gptq(parts["qweight"], parts["qzeros"],
                                                  parts["scales"],
                                                  parts["g_idx"], bits)
        # unpack_gptq adds v1's offset back; v2 stored the zero point as it is (a zero of 0 cannot
        # be repacked)
        return pack_gptq(codes, zeros - 1, scales, g_idx, bits)
    except ValueError as e:
        raise CheckpointError(f"{name}: not a GPTQ v2 layer nanoserve can hold: {e}") from e


def install_quant_linears(model: nn.Module, layers: dict[str, dict], dtype: torch.dtype,
                          device: torch.device) -> None:
    """Replace the named linears (on any device, e.g. meta) with QuantLinears filled from
    `layers`."""
    for name, parts in layers.items():
        parent_name, _, child = name.rpartition(".")
        try:
            lin = model.get_submodule(name)
        except AttributeError as e:
            raise CheckpointError(f"quantized layer {name} (its tensors {name}.*) names no layer "
                                  "of this model") from e
        if not isinstance(lin, nn.Linear):
            raise CheckpointError(f"quantized layer {name} names a {type(lin).__name__}, not a "
                                  "linear")
        if "module" in parts:  # an 8-bit layer made whole by its reader (compressed_tensors.py)
            module = parts["module"]
            if (module.in_features, module.out_features) != (lin.in_features, lin.out_features):
                raise CheckpointError(f"{name}: the file's layer is [{module.out_features}, "
                                      f"{module.in_features}], the model's [{lin.out_features}, "
                                      f"{lin.in_features}]")
            if module.bias is None and lin.bias is not None:
                raise CheckpointError(f"{name}: the model's layer has a bias, the file has none")
            module.bias = None if module.bias is None else module.bias.to(dtype)
            setattr(model.get_submodule(parent_name), child, module.to(device))
            continue
        bits, G = parts["bits"], parts["scales"].shape[0]
        K, N = lin.in_features, lin.out_features
        group_size = -(-K // G)
        try:
            q = QuantLinear(
                K, N, bits, group_size, lin.bias is not None or "bias" in parts, dtype, device
            )
        except ValueError as e:
            raise CheckpointError(f"{name}: {e}") from e
        for key in ("qweight", "qzeros", "scales", "g_idx"):
            buf = getattr(q, key)
            src = parts[key]
            if tuple(src.shape) != tuple(buf.shape):
                raise CheckpointError(f"tensor {name}.{key} has shape {tuple(src.shape)}, expected "
                                      f"{tuple(buf.shape)} for a {bits}-bit [{N}, {K}] layer with "
                                      f"{G} groups")
            buf.copy_(src.to(device=device, dtype=buf.dtype))
        if q.bias is not None:
            q.bias.copy_(parts["bias"].to(device=device,
                                          dtype=dtype) if "bias" in parts else torch.zeros(N))
        setattr(model.get_submodule(parent_name), child, q)
