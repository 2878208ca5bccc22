"""Quantized linear layers: weights stored as GPTQ v1 tensors, activations in 16 or 32 bits.

`QuantLinear` replaces an `nn.Linear` (y = x·Wᵀ + b, W [N, K]) by the four tensors of the GPTQ
format (nanoserve/quant/packing.py): `qweight` int32 [K·bits/32, N], `qzeros` int32
[G, N·bits/32], `scales` [G, N], `g_idx` int32 [K]. The names are the buffers' names in GPTQ
checkpoints, so a layer loads from and saves to one without renaming.

- **W4A16** (bits = 4): on CUDA the forward is one fused kernel,
  `nanoserve.kernels.dequant_matmul` (codes become values in registers, W never exists in
  memory — what makes int4 decode faster than fp16).
- **On the CPU**, 4- and 8-bit layers whose groups are runs of columns (not act-order) run the C
  kernel `nanoserve.kernels.cpu_packed_gemv.grid_gemv` up to KERNEL_MAX_ROWS rows, which reads
  `qweight` as it is stored (the words of 8 neighbouring outputs in one vector load); more rows
  (a prefill, a large batch) decode W in C a slab of outputs at a time, each slab multiplied by a
  BLAS GEMM while it is in cache (`decoded_matmul`). The scales and zero points are
  kept as float32 [G, N] beside the codes, derived once.
- Everywhere else (2-bit, act-order, W8A16 on CUDA): W is dequantized in torch and multiplied
  with `F.linear` — per call, so it costs time, not memory: W lives only for the matmul, but it
  is written and read in float, which makes a decode step slower than float weights.

`to_linear()` gives the equivalent float `nn.Linear` (for comparisons). Taught in
notebooks/07_int4_kernel.ipynb.

**The MMA layout.** On a GPU `use_mma_layout(model)` reorders each 4-bit layer's codes once, in
place, into the order the kernel's tensor-core path reads without a trip through shared memory
(nanoserve/kernels/int4_tiles.py; Marlin's idea); the layer then says `mma_layout = True` and
every reader of its codes goes through `gptq_qweight()`, so the state dict, `dequantize()` and
tensor-parallel splits still see the GPTQ order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import NanoserveError
from ..kernels.cpu_packed_gemv import (
    GRID_BITS,
    KERNEL_MAX_ROWS,
    PreparedGrid,
    cpu_gemv_problem,
    decoded_matmul,
    grid_dequantize,
)
from .packing import GPTQ_BITS, dequantize_gptq, gptq_zeros, pack_gptq


class QuantLinear(nn.Module):
    """y = x · Ŵᵀ + b with Ŵ [N, K] = (codes − zeros[g_idx]) · scales[g_idx], held packed."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool,
                 dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu"):
        super().__init__()
        if bits not in GPTQ_BITS:
            raise ValueError(f"bits={bits} is not supported by the GPTQ format; allowed: "
                             f"{GPTQ_BITS}")
        gs = in_features if group_size in (-1, None) else group_size
        if gs < 1 or in_features % (32 // bits):
            raise ValueError(f"in_features={in_features} must be a multiple of {32 // bits} for "
                             f"{bits}-bit packing")
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = gs
        G = -(-in_features // gs)  # groups along K
        kw = dict(device=device)
        self.register_buffer(
            "qweight", torch.zeros(in_features * bits // 32, out_features, dtype=torch.int32, **kw)
        )
        self.register_buffer("qzeros",
                             torch.zeros(G, -(-out_features * bits // 32), dtype=torch.int32, **kw))
        self.register_buffer("scales", torch.zeros(G, out_features, dtype=dtype, **kw))
        self.register_buffer("g_idx", (torch.arange(in_features, **kw) // gs).to(torch.int32))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, **kw) if bias else None)
        # g_idx == k // group_size (no act-order); None: not looked yet
        self._sorted_groups: bool | None = None
        self.mma_layout = False  # qweight reordered for the kernel (`use_mma_layout`)
        # the CPU kernel's call (float32 scales and zeros [G, N] derived), keyed by the tensors
        self._cpu_plan: tuple | None = None  # (key, PreparedGrid or None, the tensors)

    def _load_from_state_dict(self, *args, **kwargs):
        if self.mma_layout:  # the file's GPTQ-order codes would be read in the other order
            raise NanoserveError("a QuantLinear whose codes are in the MMA layout cannot load a "
                                 "state dict: load before use_mma_layout")
        self._sorted_groups = None  # a new g_idx: look again
        self._cpu_plan = None
        super()._load_from_state_dict(*args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.mma_layout and prefix + "qweight" in destination:
            destination[prefix + "qweight"] = self.gptq_qweight()  # checkpoints hold GPTQ's order

    def gptq_qweight(self) -> torch.Tensor:
        """qweight in the GPTQ order, whatever the layout it is held in (a copy if reordered)."""
        if not self.mma_layout:
            return self.qweight
        from ..kernels.int4_tiles import from_mma_layout

        return from_mma_layout(self.qweight)

    def mma_layout_problem(self) -> str | None:
        """Why this layer's codes cannot take the MMA layout (None: they can): 4-bit, tiles of 128
        rows each inside one group."""
        from ..kernels.int4_tiles import MMA_TILE_K

        if self.bits != 4:
            return f"{self.bits}-bit codes (the layout is for 4-bit ones)"
        if self.in_features % MMA_TILE_K:
            return f"in_features={self.in_features} is not a multiple of {MMA_TILE_K}"
        group = self.kernel_group_size()
        if group is None or group % MMA_TILE_K:
            return f"groups of {group or 'act-order'} rows, not a multiple of {MMA_TILE_K}"
        return None

    def kernel_group_size(self) -> int | None:
        """group_size for the W4A16 kernel when g_idx is k // group_size (one scale row per tile),
        else None.

        Reading g_idx is a host sync, done once (at the first forward, before any CUDA graph is
        captured); during a capture, a layer not looked at yet takes the general act-order path."""
        if self._sorted_groups is None:
            if self.g_idx.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            groups = torch.arange(self.in_features, device=self.g_idx.device) // self.group_size
            self._sorted_groups = bool(torch.equal(self.g_idx.long(), groups))
        return self.group_size if self._sorted_groups else None

    @classmethod
    def from_quantized(cls, qw, bias: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.float16) -> QuantLinear:
        """From a quantizer's result (codes [N, K], zeros / scales [N, G], g_idx [K]; see
        rtn.QuantizedWeight)."""
        N, K = qw.codes.shape
        layer = cls(K, N, qw.bits, qw.group_size, bias is not None, dtype, qw.codes.device)
        packed = pack_gptq(qw.codes, qw.zeros, qw.scales, qw.g_idx, qw.bits)
        for name in ("qweight", "qzeros", "g_idx"):
            getattr(layer, name).copy_(packed[name])
        layer.scales.copy_(packed["scales"].to(dtype))
        if bias is not None:
            layer.bias.copy_(bias.to(dtype))
        return layer

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Ŵ [N, K] in `dtype` (default: the scales' dtype)."""
        # N, K fp32
        w = dequantize_gptq(self.gptq_qweight(), self.qzeros, self.scales, self.g_idx, self.bits)
        return w.to(dtype or self.scales.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.bits == 4:
            from ..kernels.dequant_matmul import dequant_matmul

            x2 = x.reshape(-1, self.in_features)  # M, K
            y = dequant_matmul(
                x2, self.qweight, self.qzeros, self.scales.to(x.dtype), self.g_idx, self.bits,
                group_size=self.kernel_group_size(), mma_layout=self.mma_layout,
            )  # M, N
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        grid = self._cpu_grid() if x.device.type == "cpu" else None
        if grid is not None:  # codes read in place (kernels/cpu_packed_gemv.c)
            return self._forward_cpu_kernel(x, grid)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def cpu_kernel_problem(self, x: torch.Tensor) -> str | None:
        """Why the CPU kernel does not serve this layer for `x` (None: it does); `x` only says the
        device."""
        if x.device.type != "cpu" or self.qweight.device.type != "cpu":
            return "not on the CPU"
        if self.bits not in GRID_BITS or self.mma_layout:
            return f"{self.bits}-bit codes (the CPU kernel reads {GRID_BITS})"
        if self.kernel_group_size() is None:
            return "act-order: groups are not runs of columns"
        if self.group_size % (32 // self.bits) or self.in_features % self.group_size:
            return (f"groups of {self.group_size} columns of {self.in_features}: not whole "
                    "words of codes")
        return cpu_gemv_problem()

    def cpu_floats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales and zero points as float32 [G, N], as the CPU kernel reads them."""
        zeros = gptq_zeros(self.qzeros, self.bits)[:self.out_features]  # N, G
        return self.scales.float().contiguous(), zeros.t().float().contiguous()

    def _cpu_grid(self) -> PreparedGrid | None:
        """The CPU kernel's call for this layer (its checks passed, `cpu_floats()` derived), or
        None where the kernel does not serve it: worked out once per set of tensors — a tensor
        replaced (`.to()`, a state dict assigned) or changed in place (a state dict copied in)
        works it out again — so that a decode step's forward pays for no checks."""
        key = self._cpu_grid_key()
        if self._cpu_plan is None or self._cpu_plan[0] != key:
            grid = None
            if self.cpu_kernel_problem(self.qweight) is None:
                grid = PreparedGrid(self.qweight, *self.cpu_floats(), self.bits, self.group_size)
            # the tensors stay referenced, so their ids in the key cannot be reused
            self._cpu_plan = (key, grid, tuple(self._buffers.values()))
        return self._cpu_plan[1]

    def _cpu_grid_key(self) -> tuple:
        """What `_cpu_grid`'s answer depends on: which tensors, their in-place versions, the
        codes' layout, the groups (read from `_buffers` directly: a decode step asks 7 times a
        layer)."""
        key = [self.mma_layout, self._sorted_groups]
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            t = self._buffers[name]
            key += [id(t), t._version]
        return tuple(key)

    def _forward_cpu_kernel(self, x: torch.Tensor, grid: PreparedGrid) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # M, K
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        if rows.shape[0] <= KERNEL_MAX_ROWS:  # a decode step: the codes read in place
            y = grid(rows)  # M, N
        else:  # a prefill, a large batch: decoded in C a slab at a time, BLAS GEMMs
            qweight, scales, zeros = grid.tensors

            def decode(n0: int, n1: int) -> torch.Tensor:
                return grid_dequantize(qweight[:, n0:n1], scales[:, n0:n1].contiguous(),
                                       zeros[:, n0:n1].contiguous(), self.bits, self.group_size)

            y = decoded_matmul(rows, decode, self.out_features)
        if self.bias is not None:
            y = y + self.bias.float()
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def to_linear(self) -> nn.Linear:
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.qweight.device, dtype=self.scales.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.dequantize())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin

    def extra_repr(self) -> str:
        layout = ", mma_layout=True" if self.mma_layout else ""  # GPTQ's order unless it says so
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, "
                f"act_order={bool((self.g_idx.diff() < 0).any())}{layout}")


def use_mma_layout(model: nn.Module) -> int:
    """Reorder the codes of every 4-bit QuantLinear of `model` that can take it into the MMA
    layout, in place, once (before any CUDA graph is captured); returns how many layers did.

    Layers stacked side by side (models/triton_layers.py: q/k/v, gate/up) share one tensor of
    codes, the stack's, and their own are views of it along the outputs: the reordering runs
    along the inputs, column by column, so it is done once on the stack's tensor and holds for
    every view. A stack takes it only if all its layers can."""
    from ..kernels.int4_tiles import to_mma_layout

    by_storage: dict[int, list[QuantLinear]] = {}
    for m in model.modules():
        if type(m) is QuantLinear and not m.mma_layout:
            by_storage.setdefault(m.qweight.untyped_storage().data_ptr(), []).append(m)
    done = 0
    for layers in by_storage.values():
        if any(m.mma_layout_problem() for m in layers):
            continue
        whole = max(layers, key=lambda m: m.qweight.numel()).qweight  # the stack's, or its own
        if whole.numel() * whole.element_size() != whole.untyped_storage().nbytes():
            continue  # codes that are a view of something no layer holds whole: left as they are
        with torch.no_grad():
            whole.copy_(to_mma_layout(whole))
        for m in layers:
            m.mma_layout = True
        done += len(layers)
    return done
