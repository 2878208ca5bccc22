"""LoRA adapters (PEFT's format): read, check, merge into the base weights.

    adapter.py   LoRAAdapter, load_lora_adapter, merge_lora, unmerge_lora (W ± s·BA)
    layer.py     LoRALinear, apply_lora, remove_lora (base(x) + x·Aᵀ·(s·B)ᵀ, the base untouched)

`LLM(model, lora=PATH)` merges one adapter at load; `lora_merge=False` applies it beside each target
(what a quantized base needs). Serving several adapters in one batch (each row's x A_i B_i beside the
shared base matmul) is not built yet (issue 26).
"""

from .adapter import LoRAAdapter, load_lora_adapter, merge_lora, target_modules, unmerge_lora
from .layer import LoRALinear, apply_lora, remove_lora

__all__ = ["LoRAAdapter", "load_lora_adapter", "merge_lora", "unmerge_lora", "target_modules", "LoRALinear",
           "apply_lora", "remove_lora"]
