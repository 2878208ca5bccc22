"""LoRA adapters (PEFT's format): read, check, merge into the base weights.

    adapter.py   LoRAAdapter, load_lora_adapter, merge_lora, unmerge_lora

`LLM(model, lora=PATH)` merges one adapter at load. Serving several adapters in one batch (each row's
x A_i B_i beside the shared base matmul) is not built yet (issue 26).
"""

from .adapter import LoRAAdapter, load_lora_adapter, merge_lora, unmerge_lora

__all__ = ["LoRAAdapter", "load_lora_adapter", "merge_lora", "unmerge_lora"]
