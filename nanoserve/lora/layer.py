"""LoRA applied beside the base layer instead of merged into it: y = base(x) + (x Aᵀ)(s·B)ᵀ.

Unmerged, the adapter costs two thin matmuls per target, [T, in]·[in, r] then [T, r]·[r, out]
(2·T·r·(in + out) FLOPs, small beside the base's 2·T·in·out when r ≪ in, out), and the base stays
untouched. That is what a quantized base needs (QLoRA, Dettmers et al. 2023: int4 weights, 16-bit
adapters; there is no float W to add ΔW to), what a tied LM head needs (ΔW would change the
embedding too), and what serving several adapters at once builds on (each row its own A and B beside
one base
matmul: issue 26, not built yet).

`LoRALinear` wraps any layer with in_features / out_features (nn.Linear, the oneDNN one,
QuantLinear, W8A8Linear, FP8Linear); `apply_lora` swaps every target of an adapter for one,
`remove_lora` swaps the base layers back.
"""

from __future__ import annotations

import torch
from torch import nn

from .adapter import LoRAAdapter, target_modules


class LoRALinear(nn.Module):
    """base(x) + (x Aᵀ) Bᵀ, with the adapter's scale folded into B; A [r, in], B [out, r] in x's
    dtype."""

    def __init__(self, base: nn.Module, A: torch.Tensor, B: torch.Tensor):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_buffer("lora_A", A, persistent=False)  # r, in
        self.register_buffer("lora_B", B, persistent=False)  # out, r

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


def _dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype activations have at this layer (a quantized layer's scales, else its weight) and
    its device."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    return tensors[0].dtype, tensors[0].device


def apply_lora(model: nn.Module, adapter: LoRAAdapter,
               dtype: torch.dtype | None = None) -> list[str]:
    """Wrap every target of `adapter` in a LoRALinear (all checked first); returns their names. A
    and B are kept in `dtype`, the model's activations' (default: each layer's first floating
    tensor's; a quantized layer's scales may be float32 in a bf16 model, so the engine passes its
    dtype)."""
    targets = target_modules(model, adapter)
    for module_name, module in targets:
        if isinstance(module, LoRALinear):
            raise ValueError(f"{module_name!r} already carries an adapter: remove_lora first")
    for module_name, module in targets:
        A, B = adapter.factors[f"{module_name}.weight"]
        own_dtype, device = _dtype_device(module)
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child,
                LoRALinear(module, A.to(device, dtype or own_dtype),
                           B.to(device, dtype or own_dtype)))
    return [name for name, _ in targets]


def remove_lora(model: nn.Module) -> None:
    """Every LoRALinear back to the layer it wraps."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.base)
