"""LoRA adapters (PEFT's format): read, check, merge into the base weights.

    adapter.py   LoRAAdapter, load_lora_adapter, merge_lora, unmerge_lora (W ± s·BA)
    layer.py     LoRALinear, apply_lora, remove_lora (base(x) + x·Aᵀ·(s·B)ᵀ, the base untouched)
    batched.py   MultiLoRALinear: adapter slots, each token row its own (segmented and gathered
                 references)
    serving.py   LoRARequest, LoRAManager: per-request adapters in the engine (slots filled and
                 evicted LRU)

`LLM(model, lora=PATH)` merges one adapter at load; `lora_merge=False` applies it beside each target
(what a quantized base needs). `LLM(model, enable_lora=True).generate(prompts, lora_request=...)`
serves each request under its own adapter, several in one batch.
"""

from .adapter import LoRAAdapter, load_lora_adapter, merge_lora, target_modules, unmerge_lora
from .batched import MultiLoRALinear, lora_gathered, lora_segmented
from .layer import LoRALinear, apply_lora, remove_lora
from .serving import LoRAManager, LoRARequest

__all__ = ["LoRAAdapter", "load_lora_adapter", "merge_lora", "unmerge_lora", "target_modules",
           "LoRALinear",
           "apply_lora", "remove_lora", "MultiLoRALinear", "lora_segmented", "lora_gathered",
           "LoRARequest",
           "LoRAManager"]
