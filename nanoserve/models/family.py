"""A model family as one unit: how its HF config is read, which module computes it, how its
checkpoint's tensor names map onto that module.

GPT-2 and the Llama-class families (Llama, Mistral, Qwen2/3, Gemma 2/3, SmolLM3, OLMo 2, Phi-3,
Mixtral, Qwen3-MoE) are read by hf_config.py and computed by gpt2.py / llama.py. Every family added
since lives in a module of its own under `models/families/`, which declares a `Family`: its HF
config field table (hf_fields.py's kinds: implemented, refused, inert), the defaults of its HF
config class, a function from the HF dictionary to a `ModelConfig`, and the model class, usually a
small subclass of the Llama blocks that overrides only what differs. Nothing outside that module
names the family: the loader, the config reader and `build_model` ask this registry.

A module is found by looking: every module of `nanoserve.models.families` with a `FAMILY` (or a
`FAMILIES` tuple) is registered when the package is imported, and the package is attached at the
extension point "model_families" (the core names no family).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError


@dataclass(frozen=True)
class Family:
    model_type: str  # HF's model_type, the key of everything below
    architectures: tuple[str, ...]  # HF `architectures[0]` names this family reads
    hf_config_class: str  # transformers' config class (tests check every field is classified)
    fields: dict[str, Any]  # field -> hf_fields.Field: implemented, refused or inert
    config: Callable[[dict[str, Any]], Any]  # the HF dict (defaults filled in) -> ModelConfig
    model_class: Callable[[Any], Any]  # ModelConfig -> an uninitialised CausalLM
    # the HF config class's defaults for keys a config.json may leave out
    defaults: dict[str, Any] = field(default_factory=dict)
    # checkpoint tensors -> the model's names and layouts (None: the names are the model's)
    rename: Callable[[Any, dict], dict] | None = None
    # the README's "What loads" table (scripts/what_loads.py): the family's name, and what it
    # adds to the families before it
    name: str = ""
    summary: str = ""
    # ModelConfig -> the HF config.json dictionary (save_checkpoint); None: saving is refused
    to_hf: Callable[[Any], dict] | None = None

    def __post_init__(self) -> None:
        if not self.architectures or not self.model_type:
            raise ConfigError(f"family {self.model_type!r} names no HF architecture")


def families() -> dict[str, Family]:
    """model_type -> Family, for every module under models/families/ (the extension point
    "model_families": nanoserve/extensions.py registers the package, which finds its modules)."""
    from ..extension_points import extension

    return extension("model_families").FAMILIES


def family_of(model_type: str | None) -> Family | None:
    """The registered family of an HF model_type, or None (a built-in family, or built in code)."""
    if model_type is None:
        return None
    return families().get(model_type)


def architectures() -> dict[str, str]:
    """HF architectures[0] -> model_type, over the registered families."""
    return {arch: fam.model_type for fam in families().values() for arch in fam.architectures}


def what_loads() -> list[tuple[str, list[str], str]]:
    """(name, HF architectures, what it adds) of every family nanoserve loads, built-in ones first:
    the README's table is written from this, so it cannot drift from the code."""
    from .hf_config import BUILT_IN_SUMMARIES, SUPPORTED_ARCHITECTURES

    rows = []
    for model_type, (name, summary) in BUILT_IN_SUMMARIES.items():
        archs = [a for a, t in SUPPORTED_ARCHITECTURES.items() if t == model_type]
        rows.append((name, archs, summary))
    for fam in sorted(families().values(), key=lambda f: f.model_type):
        rows.append((fam.name or fam.model_type, list(fam.architectures), fam.summary))
    return rows
