"""The LoRA section: per-request adapters, how many in one step and their largest rank
(nanoserve/lora/). None in EngineConfig: no adapters."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NanoserveError
from .base import EngineArg, arg, check_int, flat_name


@dataclass(frozen=True)
class LoRAConfig:
    """Per-request LoRA adapters (lora/serving.py): slots in one step, and the largest rank."""

    max_loras: int = 4  # distinct adapters among the running sequences
    max_lora_rank: int = 16

    def __post_init__(self):
        check_int("max_loras", self.max_loras)
        check_int("max_lora_rank", self.max_lora_rank)


# its keyword arguments (config/args.py)
LORA_ARGS: dict[str, EngineArg] = {
    "enable_lora": arg("lora", "enabled", "serve per-request LoRA adapters"),
    "max_loras": arg("lora", "max_loras", "LoRA adapters in one step (slots)"),
    "max_lora_rank": arg("lora", "max_lora_rank", "the largest adapter rank a slot holds"),
}


def lora_section(values: dict) -> LoRAConfig | None:
    """enable_lora=True turns adapters on; max_loras and max_lora_rank apply to them."""
    values = dict(values)
    enabled = values.pop("enabled", False)
    if not isinstance(enabled, bool):
        raise NanoserveError(f"enable_lora={enabled!r} must be True or False")
    if not enabled and values:
        name = flat_name(LORA_ARGS, "lora", next(iter(values)))
        raise NanoserveError(f"{name} needs enable_lora=True")
    if not enabled:
        return None
    return LoRAConfig(**values)


