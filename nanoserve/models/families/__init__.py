"""The model families added one module each (models/family.py explains the registry).

Each module declares `FAMILY = Family(...)` (or a `FAMILIES` tuple): its HF config table, the
function that reads its config.json, and its model class, usually a small subclass of the Llama
blocks overriding only what the family changes. Importing this package finds them all: `FAMILIES`
maps each model_type to its Family (nanoserve/extensions.py attaches it at "model_families").
"""

from __future__ import annotations

import importlib
import pkgutil

from ...errors import ConfigError
from ..family import Family


def _find() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        declared = tuple(getattr(module, "FAMILIES", ()))
        if hasattr(module, "FAMILY"):
            declared = (module.FAMILY, *declared)
        for family in declared:
            if family.model_type in found:
                raise ConfigError(f"two families declare model_type {family.model_type!r}")
            found[family.model_type] = family
    return found


FAMILIES = _find()
