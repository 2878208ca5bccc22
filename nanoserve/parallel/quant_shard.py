"""Tensor parallelism for GPTQ / AWQ layers (`QuantLinear`, nanoserve/quant/qlinear.py): split the
codes, not W.

A quantized layer holds codes [N, K] (packed along K into qweight), and per group of `group_size`
inputs a zero point and a scale per output (packed zeros, scales [G, N]); g_idx [K] says each
input's group. Splitting:

- **by columns** (outputs, a column-parallel layer): rank r keeps outputs `index` — those rows of
  the codes, zeros and scales; every group stays (each output still sees all K inputs);
- **by rows** (inputs, a row-parallel layer): rank r keeps inputs `index` — those columns of the
  codes, and the groups they use, renumbered. The layer must split along group boundaries (each
  rank's share a whole number of groups, inputs in group order: no act-order), as vLLM requires too;
  a split inside a group is refused.

The split layer is a `QuantLinear` again (repacked with quant/packing.py), so it runs as any other:
the fused W4A16 kernel on CUDA, dequantize-and-matmul on the CPU. Its Ŵ is exactly the slice of the
whole layer's Ŵ (the same codes, zeros and scales), which tests/test_tensor_parallel.py checks
through the logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import NanoserveError
from ..quant.packing import pack_gptq, unpack_gptq
from ..quant.qlinear import QuantLinear


def _rebuilt(layer: QuantLinear, codes, zeros, scales, g_idx, bias) -> QuantLinear:
    """A QuantLinear of these unpacked tensors (codes [N, K], zeros / scales [N, G], g_idx [K])."""
    N, K = codes.shape
    if K % (32 // layer.bits):
        raise NanoserveError(f"a {layer.bits}-bit layer's share of {K} inputs is not a multiple of "
                             f"{32 // layer.bits} (the packing's word): choose a "
                             "tensor_parallel_size that keeps it one")
    out = QuantLinear(K, N, layer.bits, layer.group_size, bias is not None, layer.scales.dtype,
                      codes.device)
    packed = pack_gptq(codes, zeros, scales, g_idx, layer.bits)
    for name in ("qweight", "qzeros", "g_idx"):
        getattr(out, name).copy_(packed[name])
    out.scales.copy_(packed["scales"].to(out.scales.dtype))
    if bias is not None:
        out.bias.copy_(bias)
    return out


def _unpacked(layer: QuantLinear):
    # codes, zeros, scales, g
    return unpack_gptq(layer.gptq_qweight(), layer.qzeros, layer.scales, layer.g_idx, layer.bits)


def column_shard(layer: QuantLinear, index: torch.Tensor) -> QuantLinear:
    """Outputs `index` of a quantized layer (all of its inputs and groups)."""
    codes, zeros, scales, g_idx = _unpacked(layer)  # N, K; N, G; N, G; K
    bias = None if layer.bias is None else layer.bias[index]
    return _rebuilt(layer, codes[index], zeros[index], scales[index], g_idx, bias)


def column_split_problem(layer: QuantLinear, world_size: int) -> str | None:
    """Why `layer` cannot be split by outputs into `world_size` shares (None when it can): zeros
    pack along N."""
    word = 32 // layer.bits
    if layer.out_features % (world_size * word):
        return (f"its {layer.out_features} outputs do not split into {world_size} shares that are "
                f"multiples of {word} (the {layer.bits}-bit packing of its zero points)")
    return None


def row_split_problem(layer: QuantLinear, world_size: int) -> str | None:
    """Why `layer` cannot be split by inputs into `world_size` equal shares (None when it can)."""
    share, gs, word = layer.in_features // world_size, layer.group_size, 32 // layer.bits
    if layer.in_features % world_size or share % gs:
        return (f"its {layer.in_features} inputs in groups of {gs} do not split into {world_size} "
                "whole numbers of groups")
    if share % word:
        return (f"a share of {share} inputs is not a multiple of {word} (the {layer.bits}-bit "
                "packing's word)")
    if not torch.equal(layer.g_idx.long().cpu(), torch.arange(layer.in_features) // gs):
        return "its inputs are in act-order (g_idx not k // group_size): a split would cut groups"
    return None


def row_shard(layer: QuantLinear, index: torch.Tensor) -> QuantLinear:
    """Inputs `index` (contiguous, a whole number of groups: row_split_problem) of a quantized
    layer, with their groups renumbered from 0; no bias (a row-parallel layer adds it once, after
    the all-reduce)."""
    codes, zeros, scales, g_idx = _unpacked(layer)
    gs, first, count = layer.group_size, int(index[0]), len(index)
    problem = row_split_problem(layer, layer.in_features // count)
    if problem:
        raise NanoserveError("tensor parallelism splits a quantized layer by inputs along its "
                             f"groups: {problem}")
    groups = slice(first // gs, (first + count) // gs)
    return _rebuilt(layer, codes[:, index], zeros[:, groups], scales[:, groups],
                    g_idx[index] - first // gs, None)


class ColumnParallelQuantLinear(nn.Module):
    """A quantized layer's outputs `index`: this rank's share, nothing exchanged."""

    def __init__(self, layer: QuantLinear, index: torch.Tensor):
        super().__init__()
        self.local = column_shard(layer, index)
        self.in_features, self.out_features = self.local.in_features, self.local.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., I] -> [..., O/N]
        return self.local(x)


class RowParallelQuantLinear(nn.Module):
    """A quantized layer's inputs `index`: a partial product, summed over ranks, then the bias
    once."""

    def __init__(self, layer: QuantLinear, index: torch.Tensor):
        super().__init__()
        self.local = row_shard(layer, index)
        self.bias = (
            None if layer.bias is None
            else nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
        )
        self.in_features, self.out_features = self.local.in_features, self.local.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., I/N] -> [..., O]
        y = self.local(x)
        dist.all_reduce(y)  # Σ over ranks of the partial products
        return y if self.bias is None else y + self.bias.to(y.dtype)
