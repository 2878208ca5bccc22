"""compressed-tensors checkpoints: the format llmcompressor writes and most quantized models vLLM
serves use.

config.json carries `"quantization_config": {"quant_method": "compressed-tensors", "format": ...,
"quantization_status": "compressed", "config_groups": {"group_0": {"targets": ["Linear"], "weights":
{...}, "input_activations": {...} or null}}, "ignore": ["lm_head", ...]}`: every nn.Linear not
ignored is quantized as the group says. nanoserve reads and writes these schemes (any other is
refused by name):

| format          | weights                               | activations              | layer       |
|-----------------|---------------------------------------|--------------------------|-------------|
| pack-quantized  | int4 or int8, symmetric or not, per   | float (W4A16, W8A16)     | QuantLinear |
|                 | group or channel; any actorder        |                          |             |
| int-quantized   | int8, symmetric, per channel          | int8, dynamic per token  | W8A8Linear  |
| float-quantized | FP8-e4m3 per channel, per tensor or   | FP8 dynamic per token or | FP8Linear   |
|                 | per block (e.g. 128×128)              | per token group, static  |             |
|                 |                                       | per tensor, or float     |             |

Tensors of one linear [N, K] (group size g, b bits): pack-quantized stores `weight_packed` int32
[N, ⌈K·b/32⌉] — each code q ∈ [−2^(b−1), 2^(b−1)) as q + 2^(b−1), 32/b per word along K, the lowest
field first (the library packs any b densely; for 4 and 8 no field straddles a word) —
`weight_scale` [N, ⌈K/g⌉], `weight_shape` int64 [N, K], asymmetric only `weight_zero_point` int32
[⌈N·b/32⌉, ⌈K/g⌉]: the zero points z + 2^(b−1) packed the same way but along N. W = (q − z) · s.

actorder is GPTQ's: "static" (llmcompressor's default) and "weight", its newer name, change only
the order GPTQ quantizes columns in, so the file is a plain grid, groups k // g. "group" (older
"dynamic" or true) also stores `weight_g_idx` int32 [K], the group of each input column (GPTQ's
g_idx: W[n, k] uses group g_idx[k]); compressed-tensors ≥ 0.20 refuses it, vLLM and older tools
read it, nanoserve reads it into QuantLinear's g_idx.

int- and float-quantized store `weight` (int8 or float8_e4m3fn) [N, K] and `weight_scale` [N, 1]
(per channel), [1] (per tensor) or, FP8 per block of bn × bk (`block_structure` [bn, bk]),
[⌈N/bn⌉, ⌈K/bk⌉], the last tiles short: W = weight · s. FP8 activations are dynamic per token,
dynamic per token and group of `group_size` inputs (the partner of 128×128 blocks), or static: one
`input_scale` [1] calibrated offline, applied as the file gives it (as vLLM does). Scales are in the
model's dtype. Against GPTQ v1 (packing.py), a pack-quantized layer is the same grid: code
q + 2^(b−1), zero z + 2^(b−1); v1 cannot hold a zero point of 0 (z = −2^(b−1)), which is refused.
Proven against the library itself in tests/test_compressed_tensors.py.
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
PACKED_BITS = (4, 8)  # pack-quantized widths read: 8 or 4 values per int32 word
# GPTQ's act-order: the file's weight_g_idx gives each input column its group ("dynamic" and True
# are the older names)
GROUP_ACTORDERS = ("group", "dynamic", True)
# the order changed only how GPTQ quantized, not the stored grid: groups k // group_size, no g_idx
# ("static" is "weight"'s older name, llmcompressor's GPTQ default)
ACTORDERS = (None, False, "static", "weight", *GROUP_ACTORDERS)
# input_activations (_activation_key) -> FP8Linear's activations
FP8_ACTIVATIONS = {None: None, ("float", 8, "token", True, True): "token",
                   ("float", 8, "group", True, True): "group",
                   ("float", 8, "tensor", False, True): "static"}


# ----------------------------------------------------------------------------- int packing
def pack_ints(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Values 0 .. 2^bits − 1 [R, C] -> int32 [R, ⌈C·bits/32⌉], 32/bits per word, value i of a word
    at bits [bits·i, bits·i + bits) (C padded with 0). For 4 and 8 bits this is the library's dense
    packing: no value straddles two words."""
    per = 32 // bits
    R, C = values.shape
    x = torch.nn.functional.pad(values.to(torch.int64), (0, -C % per)).view(R, -1, per)  # R, W, per
    words = sum(x[..., i] << (bits * i) for i in range(per))  # R, W   0 .. 2^32 − 1
    # the same bits, signed
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_ints(words: torch.Tensor, C: int, bits: int) -> torch.Tensor:
    """int32 [R, W] -> values 0 .. 2^bits − 1 [R, C] (int64): `pack_ints` undone."""
    w = words.to(torch.int64) & 0xFFFFFFFF  # R, W
    fields = [(w >> (bits * i)) & ((1 << bits) - 1) for i in range(32 // bits)]
    return torch.stack(fields, dim=-1).flatten(1)[:, :C]  # R, C


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
    acts = _activation_key(a)
    ok = {"pack-quantized": _packed_ok(w, acts), "int-quantized": _int8_ok(w, acts),
          "float-quantized": _fp8_ok(w, acts), "naive-quantized": _fp8_ok(w, acts)}.get(fmt, False)
    if not ok:
        raise CheckpointError(f"compressed-tensors scheme not supported: format={fmt!r}, "
                              f"weights={w}, input_activations={a}; nanoserve reads pack-quantized "
                              f"int{'/int'.join(map(str, PACKED_BITS))} weight-only (per group or "
                              f"channel, actorder one of {ACTORDERS}), int-quantized int8 per "
                              "channel with dynamic per-token int8 activations, and "
                              "float-quantized FP8 per tensor, channel or block with FP8 "
                              "activations dynamic per token or per token group, static per "
                              "tensor, or none")
    return fmt, w, a, list(qcfg.get("ignore") or [])


def _activation_key(a: dict | None) -> tuple | None:
    """What nanoserve computes with of input_activations: (type, bits, strategy, dynamic,
    symmetric)."""
    if a is None:
        return None
    return (a.get("type"), a.get("num_bits"), a.get("strategy"), a.get("dynamic"),
            a.get("symmetric", True))


def _packed_ok(w: dict, acts: tuple | None) -> bool:
    return (w.get("type") == "int" and w.get("num_bits") in PACKED_BITS
            and w.get("strategy") in ("group", "channel") and acts is None
            and w.get("actorder") in ACTORDERS)


def _int8_ok(w: dict, acts: tuple | None) -> bool:
    return ((w.get("type"), w.get("num_bits"), w.get("strategy")) == ("int", 8, "channel")
            and w.get("symmetric", True) and acts == ("int", 8, "token", True, True))


def _fp8_ok(w: dict, acts: tuple | None) -> bool:
    block = w.get("block_structure")
    strategy_ok = w.get("strategy") in ("channel", "tensor") or (
        w.get("strategy") == "block" and isinstance(block, list) and len(block) == 2
    )
    return ((w.get("type"), w.get("num_bits")) == ("float", 8) and w.get("symmetric", True)
            and strategy_ok and acts in FP8_ACTIVATIONS)


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
            layers[name] = _packed_to_gptq(name, take("weight_packed"), scale,
                                           take("weight_zero_point"), take("weight_shape"), w,
                                           take("weight_g_idx"))
            if bias is not None:
                layers[name]["bias"] = bias
            continue
        weight = take("weight")
        if weight is None:
            raise CheckpointError(f"{name}: a {fmt} layer needs weight [N, K] and weight_scale")
        if fmt == "int-quantized":
            if scale.numel() != weight.shape[0]:
                raise CheckpointError(f"{name}: an int-quantized layer needs weight_scale [N, 1], "
                                      f"got {tuple(scale.shape)}")
            module = W8A8Linear(weight.to(torch.int8), scale.float().reshape(-1), bias)
        else:
            module = _fp8_layer(name, weight, scale, take("input_scale"), bias, w, a)
        layers[name] = {"module": module}
    return layers


def _fp8_layer(name, weight, scale, input_scale, bias, w: dict, a: dict | None) -> FP8Linear:
    """A float-quantized layer: scales [N, 1], [1] or [⌈N/bn⌉, ⌈K/bk⌉] (block), and the
    activations the config names (a static one with the file's input_scale)."""
    activations = FP8_ACTIVATIONS[_activation_key(a)]
    block = tuple(w["block_structure"]) if w.get("strategy") == "block" else None
    if block is None and scale.numel() > 1:
        scale = scale.reshape(-1, 1)  # N, 1
    elif block is None:
        scale = scale.reshape(1, 1)
    group = a.get("group_size") if activations == "group" else None
    try:
        return FP8Linear(weight.to(FP8), scale, bias, activations, block=block,
                         act_group_size=group, input_scale=input_scale)
    except ValueError as e:
        raise CheckpointError(f"{name}: {e}") from e


def _packed_to_gptq(name, packed, scale, zero_point, shape, w: dict,
                    g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A pack-quantized layer as GPTQ v1 tensors (packing.py): codes q + 2^(b−1), zero points
    z + 2^(b−1), the file's g_idx (act-order) or k // group_size."""
    if packed is None or scale is None or shape is None:
        raise CheckpointError(f"{name}: a pack-quantized layer needs weight_packed, weight_scale "
                              "and weight_shape")
    bits = int(w.get("num_bits", 4))
    N, K = (int(v) for v in shape.tolist())
    G = scale.shape[1]
    gs = K if w.get("strategy") == "channel" else int(w.get("group_size") or 0)
    if gs < 1 or G != -(-K // gs):  # the last group may be short: ⌈K / g⌉ groups
        raise CheckpointError(f"{name}: weight_scale has {G} groups; "
                              f"group_size={w.get('group_size')!r} over K={K} needs ⌈K / "
                              "group_size⌉")
    codes = unpack_ints(packed, K, bits)  # N, K   q + 2^(b−1)
    if w.get("symmetric", True):
        zeros = torch.full((N, G), 1 << (bits - 1), dtype=torch.int64)
    elif zero_point is None:
        raise CheckpointError(f"{name}: asymmetric pack-quantized layer without weight_zero_point")
    else:
        zeros = unpack_ints(zero_point.T, N, bits).T  # N, G   z + 2^(b−1) (packed along N)
    groups = _group_index(name, g_idx, K, gs, w.get("actorder"))
    try:
        parts = pack_gptq(codes.to(torch.uint8), zeros.to(torch.int32), scale, groups, bits)
    except ValueError as e:  # e.g. a zero point of −2^(b−1) (GPTQ v1's field holds zero − 1 ≥ 0)
        raise CheckpointError(f"{name}: {e}") from e
    # the file's scales as they are (pack_gptq rounds to GPTQ's fp16): the layer computes with the
    # same weights
    return {**parts, "scales": scale.t().contiguous(), "bits": bits}  # scales G, N


def _group_index(name: str, g_idx: torch.Tensor | None, K: int, gs: int,
                 actorder) -> torch.Tensor:
    """Each input column's group [K]: the file's weight_g_idx under actorder "group", else
    k // group_size (a g_idx stored anyway must say the same: vLLM would not read it)."""
    plain = torch.arange(K, dtype=torch.int32) // gs
    if actorder in GROUP_ACTORDERS:
        if g_idx is None:
            raise CheckpointError(f"{name}: actorder={actorder!r} needs the tensor "
                                  f"{name}.weight_g_idx (each input column's group)")
        return g_idx.to(torch.int32).reshape(-1)
    if g_idx is not None and not torch.equal(g_idx.reshape(-1).long(), plain.long()):
        raise CheckpointError(f"{name}: weight_g_idx permutes the groups but "
                              f"actorder={actorder!r}; a permuted g_idx is read under actorder in "
                              f"{GROUP_ACTORDERS}")
    return plain


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
    # symmetric (every GPTQ zero point 2^(b−1), i.e. z = 0): the format then stores no zero points
    sym = kind is QuantLinear and all(_symmetric(m) for m in layers.values())
    out = {}
    for name, m in layers.items():
        if kind is QuantLinear:
            out[name] = _packed_tensors(name, m, dtype, sym)
        elif kind is FP8Linear:
            out[name] = _fp8_tensors(m, dtype)
        else:
            out[name] = _w8_tensors(m, dtype)
        if m.bias is not None:
            out[name]["bias"] = m.bias.detach().to(dtype)
    if kind is QuantLinear:
        fmt, weights, acts = "pack-quantized", _packed_args(layers, sym), None
    elif kind is W8A8Linear:
        fmt = "int-quantized"
        weights = _args("int", 8, "channel")
        acts = _args("int", 8, "token", dynamic=True)
    else:
        fmt, (weights, acts) = "float-quantized", _fp8_args(layers)
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
    """Every zero point 2^(b−1) (z = 0 in compressed-tensors' terms)."""
    zeros = unpack_gptq(q.gptq_qweight(), q.qzeros, q.scales, q.g_idx, q.bits)[1]
    return bool((zeros == 1 << (q.bits - 1)).all())


def _args(type_: str, bits: int, strategy: str, symmetric: bool = True,
          group_size: int | None = None,
          dynamic: bool = False) -> dict:
    return {"num_bits": bits, "type": type_, "symmetric": symmetric, "strategy": strategy,
            "group_size": group_size if strategy == "group" else None, "dynamic": dynamic}


def _packed_args(layers: dict[str, QuantLinear], symmetric: bool) -> dict:
    """One width and one group size for all; groups as wide as each layer's rows: per channel."""
    if len({m.bits for m in layers.values()}) > 1:
        raise NanoserveError("the layers have different widths; a compressed-tensors group has one")
    bits = next(iter(layers.values())).bits
    if all(m.group_size == m.in_features for m in layers.values()):
        return _args("int", bits, "channel", symmetric)
    if len({m.group_size for m in layers.values()}) > 1:
        raise NanoserveError("the layers have different group sizes; a compressed-tensors group "
                             "has one")
    return _args("int", bits, "group", symmetric, next(iter(layers.values())).group_size)


def _packed_tensors(name: str, q: QuantLinear, dtype: torch.dtype,
                    symmetric: bool) -> dict[str, torch.Tensor]:
    if q.bits not in PACKED_BITS:
        raise NanoserveError(f"{name}: {q.bits}-bit weights; compressed-tensors pack-quantized is "
                             f"written for {PACKED_BITS} bits")
    # N, K; N, G; N, G; K
    codes, zeros, scales, g_idx = unpack_gptq(q.gptq_qweight(), q.qzeros, q.scales, q.g_idx,
                                              q.bits)
    K = codes.shape[1]
    if not torch.equal(g_idx.long(), torch.arange(K) // q.group_size):
        # actorder "group" (weight_g_idx) is refused by compressed-tensors ≥ 0.20, hence by
        # transformers: a file that loads only in older tools is not written
        raise NanoserveError(f"{name}: act-order (a permuted g_idx) is not written to "
                             "compressed-tensors (its current library refuses actorder 'group'); "
                             "save in the GPTQ format")
    if (zeros >= 1 << q.bits).any():
        raise NanoserveError(f"{name}: zero point {1 << q.bits} (z = {1 << (q.bits - 1)}) is "
                             f"outside compressed-tensors' int{q.bits} range")
    t = {"weight_packed": pack_ints(codes, q.bits), "weight_scale": scales.to(dtype),
         "weight_shape": torch.tensor([codes.shape[0], K], dtype=torch.int64)}
    if not symmetric:
        # zero points z + 2^(b−1), packed along N
        t["weight_zero_point"] = pack_ints(zeros.T, q.bits).T
    return t


def _w8_tensors(m: W8A8Linear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The int8 codes and their scales [N, 1]."""
    return {"weight": m.weight, "weight_scale": m.weight_scale.reshape(-1, 1).to(dtype)}


def _fp8_tensors(m: FP8Linear, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The FP8 codes, the scale [N, 1] per channel, [1] per tensor or [⌈N/bn⌉, ⌈K/bk⌉] per block,
    and a static activation scale [1]."""
    if m.block is not None:
        s = m.weight_scale  # ⌈N/bn⌉, ⌈K/bk⌉
    elif m.weight_scale.numel() > 1:
        s = m.weight_scale.reshape(-1, 1)  # N, 1
    else:
        s = m.weight_scale.reshape(1)
    t = {"weight": m.weight, "weight_scale": s.to(dtype)}
    if m.input_scale is not None:
        t["input_scale"] = m.input_scale.reshape(1).to(dtype)
    return t


def _fp8_args(layers: dict[str, FP8Linear]) -> tuple[dict, dict | None]:
    """(weights, input_activations) of FP8 layers, which must all be alike."""
    kinds = {(m.activations, m.act_group_size, m.block, m.weight_scale.numel() > 1)
             for m in layers.values()}
    if len(kinds) > 1:
        raise NanoserveError("FP8 layers with different weight scales or activations cannot share "
                             f"one checkpoint: {sorted(kinds, key=str)}")
    first = next(iter(layers.values()))
    if first.block is not None:
        weights = {**_args("float", 8, "block"), "block_structure": list(first.block)}
    else:
        weights = _args("float", 8, "channel" if first.weight_scale.numel() > 1 else "tensor")
    acts = {None: None, "token": _args("float", 8, "token", dynamic=True),
            "group": _args("float", 8, "group", group_size=first.act_group_size, dynamic=True),
            "static": _args("float", 8, "tensor")}[first.activations]
    return weights, acts
