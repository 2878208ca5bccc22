"""compressed-tensors checkpoints: the format llmcompressor writes and most quantized models vLLM
serves use.

config.json carries `"quantization_config": {"quant_method": "compressed-tensors", "format": ...,
"quantization_status": "compressed", "config_groups": {"group_0": {"targets": ["Linear"], "weights":
{...}, "input_activations": {...} or null}}, "ignore": ["lm_head", ...]}`: every nn.Linear not
ignored is quantized as the group says. nanoserve reads and writes three schemes (any other is
refused by name):

| format           | weights                             | activations             | layer      |
|------------------|-------------------------------------|-------------------------|------------|
| pack-quantized   | int4, symmetric or not, per group   | float (W4A16)           | QuantLinear |
| int-quantized    | int8, symmetric, per channel        | int8 per token          | W8A8Linear |
| float-quantized  | FP8-e4m3 per channel or per tensor  | FP8 per token, or float | FP8Linear  |

Tensors of one linear [N, K] (group size g): pack-quantized stores `weight_packed` int32 [N, ⌈K/8⌉]
— each code q ∈ [−8, 7] as the nibble q + 8, eight per word along K, the lowest nibble first —
`weight_scale` [N, K/g], `weight_shape` int64 [N, K] and, asymmetric only, `weight_zero_point` int32
[⌈N/8⌉, K/g]: the zero points z + 8 packed the same way but along N. W = (q − z) · s. int- and
float-quantized store `weight` (int8 or float8_e4m3fn) [N, K] and `weight_scale` [N, 1] (per
channel) or [1] (per tensor): W = weight · s. Scales are in the model's dtype. Against GPTQ v1
(packing.py), a pack-quantized layer is the same grid: code q + 8, zero z + 8; v1 cannot hold a zero
point of 0 (z = −8), which is refused. Proven against the library itself in
tests/test_compressed_tensors.py.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..errors import CheckpointError, NanoserveError
from .fp8 import FP8, FP8Linear
from .int8 import W8A8Linear
from .llm_int8 import LLMInt8Linear
from .packing import pack_gptq, unpack_gptq
from .qlinear import QuantLinear

QUANT_METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


# ----------------------------------------------------------------------------- 4-bit packing
def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [R, C] -> int32 [R, ⌈C/8⌉], eight per word, the lowest nibble first (C padded
    with 0)."""
    R, C = nibbles.shape
    x = torch.nn.functional.pad(nibbles.to(torch.int64), (0, -C % 8)).view(R, -1, 8)  # R, W, 8
    words = sum(x[..., i] << (4 * i) for i in range(8))  # R, W   0 .. 2^32 − 1
    # the same bits, signed
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(words: torch.Tensor, C: int) -> torch.Tensor:
    """int32 [R, W] -> values 0..15 [R, C] (int64): `pack_int4` undone."""
    w = words.to(torch.int64) & 0xFFFFFFFF  # R, W
    return torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], dim=-1).flatten(1)[:, :C]  # R, C


# ----------------------------------------------------------------------------- the config
def scheme(qcfg: dict) -> tuple[str, dict, dict | None, list[str]]:
    """(format, weight args, input-activation args or None, ignore) of a checkpoint's
    quantization_config, or a CheckpointError naming what nanoserve does not read."""
    if qcfg.get("quantization_status", "compressed") != "compressed":
        raise CheckpointError("compressed-tensors "
                              f"quantization_status={qcfg.get('quantization_status')!r}: only "
                              "'compressed' checkpoints are read (a 'frozen' one stores float "
                              "weights with scales)")
    groups = qcfg.get("config_groups") or {}
    if len(groups) != 1:
        raise CheckpointError(f"compressed-tensors checkpoints with {len(groups)} config_groups "
                              "are not supported (one group targeting every Linear is)")
    group = next(iter(groups.values()))
    fmt = group.get("format") or qcfg.get("format")
    w, a = group.get("weights") or {}, group.get("input_activations")
    if group.get("targets") != ["Linear"]:
        raise CheckpointError(f"compressed-tensors targets={group.get('targets')!r}: only "
                              "['Linear'] is supported")
    weights = (w.get("type"), w.get("num_bits"))
    acts = None if a is None else (a.get("type"), a.get("num_bits"), a.get("strategy"),
                                   a.get("dynamic"),
                                   # dynamic, symmetric, per token: what we compute
                                   a.get("symmetric", True))
    symmetric, strategy = w.get("symmetric", True), w.get("strategy")
    fp8 = weights == ("float", 8) and strategy in ("channel", "tensor") and symmetric \
        and acts in (None, ("float", 8, "token", True, True))
    ok = {"pack-quantized": weights == ("int", 4) and strategy in ("group", "channel")
          and acts is None and not w.get("actorder"),
          "int-quantized": weights == ("int", 8) and strategy == "channel" and symmetric
          and acts == ("int", 8, "token", True, True),
          "float-quantized": fp8, "naive-quantized": fp8}.get(fmt, False)
    if not ok:
        raise CheckpointError(f"compressed-tensors scheme not supported: format={fmt!r}, "
                              f"weights={w}, input_activations={a}; nanoserve reads pack-quantized "
                              "int4 (W4A16), int-quantized int8 per channel with dynamic "
                              "per-token int8 activations, and float-quantized FP8")
    return fmt, w, a, list(qcfg.get("ignore") or [])


def ignored(name: str, ignore: list[str]) -> bool:
    """Whether a module name matches the config's ignore list (exact names, or "re:<regex>")."""
    return any(re.fullmatch(p[3:], name) if p.startswith("re:") else name == p for p in ignore)


# ----------------------------------------------------------------------------- reading
def read_layers(tensors: dict[str, torch.Tensor], qcfg: dict) -> dict[str, dict]:
    """name -> {"module": an 8-bit layer} or GPTQ v1 tensors for a QuantLinear, for every quantized
    linear; removes their tensors from `tensors`."""
    fmt, w, a, ignore = scheme(qcfg)
    names = sorted(k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale"))
    if not names:
        raise CheckpointError("config.json declares compressed-tensors but no tensor is named "
                              "*.weight_scale")
    layers = {}
    for name in names:
        if ignored(name, ignore):
            raise CheckpointError(f"{name} is quantized in the file but on the config's ignore "
                                  "list")
        take = lambda key, name=name: tensors.pop(f"{name}.{key}", None)  # noqa: E731
        scale, bias = take("weight_scale"), take("bias")
        if fmt == "pack-quantized":
            layers[name] = _w4_to_gptq(name, take("weight_packed"), scale,
                                       take("weight_zero_point"),
                                       take("weight_shape"), w)
            if bias is not None:
                layers[name]["bias"] = bias
            continue
        weight = take("weight")
        if weight is None or scale.numel() not in (1, weight.shape[0]):
            raise CheckpointError(f"{name}: a {fmt} layer needs weight [N, K] and weight_scale [N, "
                                  "1] or [1]")
        if fmt == "int-quantized":
            module = W8A8Linear(weight.to(torch.int8), scale.float().reshape(-1), bias)
        else:
            # N, 1 or 1, 1
            s = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(1, 1)
            module = FP8Linear(weight.to(FP8), s, bias, activations=None if a is None else "token")
        layers[name] = {"module": module}
    return layers


def _w4_to_gptq(name, packed, scale, zero_point, shape, w: dict) -> dict[str, torch.Tensor]:
    """A pack-quantized layer as GPTQ v1 tensors (packing.py): codes q + 8, zero points z + 8."""
    if packed is None or scale is None or shape is None:
        raise CheckpointError(f"{name}: a pack-quantized layer needs weight_packed, weight_scale "
                              "and weight_shape")
    N, K = (int(v) for v in shape.tolist())
    G = scale.shape[1]
    gs = K if w.get("strategy") == "channel" else int(w.get("group_size") or 0)
    if gs < 1 or G != -(-K // gs):  # the last group may be short: ⌈K / g⌉ groups
        raise CheckpointError(f"{name}: weight_scale has {G} groups; "
                              f"group_size={w.get('group_size')!r} over K={K} needs ⌈K / "
                              "group_size⌉")
    codes = unpack_int4(packed, K)  # N, K   q + 8
    if w.get("symmetric", True):
        zeros = torch.full((N, G), 8, dtype=torch.int64)
    elif zero_point is None:
        raise CheckpointError(f"{name}: asymmetric pack-quantized layer without weight_zero_point")
    else:
        zeros = unpack_int4(zero_point.T, N).T  # N, G   z + 8 (packed along N)
    g_idx = torch.arange(K, dtype=torch.int32) // gs
    try:
        parts = pack_gptq(codes.to(torch.uint8), zeros.to(torch.int32), scale, g_idx, 4)
    except ValueError as e:  # e.g. a zero point of −8 (GPTQ v1's field holds zero − 1 ≥ 0)
        raise CheckpointError(f"{name}: {e}") from e
    # the file's scales as they are (pack_gptq rounds to GPTQ's fp16): the layer computes with the
    # same weights
    return {**parts, "scales": scale.t().contiguous(), "bits": 4}  # scales G, N


# ----------------------------------------------------------------------------- writing
def tensors_and_config(model: nn.Module) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Every quantized linear's compressed-tensors tensors (by module name) and the
    quantization_config."""
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    layers = {
        n: m for n, m in model.named_modules()
        if isinstance(m, (QuantLinear, W8A8Linear, FP8Linear))
    }
    kinds = {type(m) for m in layers.values()}
    # LLM.int8 computes its outliers apart: no such scheme
    if len(kinds) != 1 or kinds & {LLMInt8Linear}:
        raise NanoserveError("a compressed-tensors checkpoint holds one scheme of "
                             f"{QuantLinear.__name__}, {W8A8Linear.__name__} or "
                             f"{FP8Linear.__name__} layers; this model has "
                             f"{sorted(k.__name__ for k in kinds) or 'no quantized layer'}")
    kind = kinds.pop()
    # symmetric (every GPTQ zero point 8, i.e. z = 0): the format then stores no zero points
    sym = kind is QuantLinear and all(_symmetric(m) for m in layers.values())
    out = {}
    for name, m in layers.items():
        out[name] = (
            _w4_tensors(name, m, dtype, sym) if kind is QuantLinear else _w8_tensors(m, dtype)
        )
        if m.bias is not None:
            out[name]["bias"] = m.bias.detach().to(dtype)
    first = next(iter(layers.values()))
    if kind is QuantLinear:
        if len({m.group_size for m in layers.values()}) > 1:
            raise NanoserveError("the layers have different group sizes; a compressed-tensors "
                                 "group has one")
        fmt, weights, acts = "pack-quantized", _args("int", 4, "group", sym, first.group_size), None
    elif kind is W8A8Linear:
        fmt = "int-quantized"
        weights = _args("int", 8, "channel")
        acts = _args("int", 8, "token", dynamic=True)
    else:
        if len({m.activations for m in layers.values()}) > 1:
            raise NanoserveError("FP8 layers with and without FP8 activations cannot share one "
                                 "checkpoint")
        strategy = "channel" if first.weight_scale.numel() > 1 else "tensor"
        fmt, weights = "float-quantized", _args("float", 8, strategy)
        acts = _args("float", 8, "token", dynamic=True) if first.activations else None
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if "lm_head" not in layers and "lm_head" not in linears:  # e.g. a head made parallel
        linears.append("lm_head")
    config = {"quant_method": QUANT_METHOD, "format": fmt, "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                            "input_activations": acts,
                                            "output_activations": None, "format": fmt}},
              "ignore": linears,
              "kv_cache_scheme": None}
    return out, config


def _symmetric(q: QuantLinear) -> bool:
    """Every zero point 8 (z = 0 in compressed-tensors' terms)."""
    zeros = unpack_gptq(q.gptq_qweight(), q.qzeros, q.scales, q.g_idx, q.bits)[1]
    return bool((zeros == 8).all())


def _args(type_: str, bits: int, strategy: str, symmetric: bool = True,
          group_size: int | None = None,
          dynamic: bool = False) -> dict:
    return {"num_bits": bits, "type": type_, "symmetric": symmetric, "strategy": strategy,
            "group_size": group_size if strategy == "group" else None, "dynamic": dynamic}


def _w4_tensors(name: str, q: QuantLinear, dtype: torch.dtype,
                symmetric: bool) -> dict[str, torch.Tensor]:
    if q.bits != 4:
        raise NanoserveError(f"{name}: {q.bits}-bit weights; compressed-tensors pack-quantized is "
                             "written for 4 bits")
    # N, K; N, G; N, G; K
    codes, zeros, scales, g_idx = unpack_gptq(q.gptq_qweight(), q.qzeros, q.scales, q.g_idx, 4)
    K = codes.shape[1]
    if not torch.equal(g_idx.long(), torch.arange(K) // q.group_size):
        raise NanoserveError(f"{name}: act-order (a permuted g_idx) is not written to "
                             "compressed-tensors")
    if (zeros > 15).any():
        raise NanoserveError(f"{name}: zero point 16 (z = 8) is outside compressed-tensors' int4 "
                             "range")
    t = {"weight_packed": pack_int4(codes), "weight_scale": scales.to(dtype),
         "weight_shape": torch.tensor([codes.shape[0], K], dtype=torch.int64)}
    if not symmetric:
        t["weight_zero_point"] = pack_int4(zeros.T).T  # zero points z + 8, packed along N
    return t


def _w8_tensors(m: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """W8A8Linear or FP8Linear: the codes, and the scale [N, 1] per channel or [1] per tensor."""
    s = m.weight_scale.reshape(-1, 1) if m.weight_scale.numel() > 1 else m.weight_scale.reshape(1)
    return {"weight": m.weight, "weight_scale": s.to(dtype)}
