"""LoRA adapters in PEFT's format: read them, check them against the model, merge them into its
weights.

LoRA (Hu et al. 2021) fine-tunes a linear layer W [out, in] by a low-rank update instead of all of
W: y = W x + s · B (A x), with A [r, in], B [out, r], r ≪ in, out and a scale s = lora_alpha / r
(rsLoRA, Kalajdzievski 2023: lora_alpha / √r). Merged, the update is one matrix, ΔW = s · B A, added
to W once: the model then costs exactly what the base costs, and serves that one adapter only.

PEFT saves an adapter as a directory: `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors`, with tensors named `base_model.model.<module path>.lora_A.weight` and
`.lora_B.weight`. The module paths are transformers'; nanoserve's modules carry the same names and
the same [out, in] layout (GPT-2's Conv1D weights are transposed at load, and PEFT's A and B are [r,
in], [out, r] for Conv1D too), so ΔW lands on our parameter of that name. A target that is one of
Phi-3's fused matrices (qkv_proj, gate_up_proj) is split by rows like its weight (models/fused.py).

What would change the math and is not implemented is refused by name (no silent wrong answer): DoRA,
biases trained with the adapter, `modules_to_save`, per-module rank or alpha patterns, embedding
targets, adapters for modules the model lacks, shapes that do not fit; merging into a tied LM head;
and merging into a quantized layer (applied beside it instead, layer.py, that one is served).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import CheckpointError
from ..models.config import ModelConfig
from ..models.fused import split_fused

PREFIX = "base_model.model."
# adapter_config.json fields that change the math, and the value under which nanoserve computes it
# right
UNSUPPORTED = {"use_dora": False, "bias": "none", "lora_bias": False, "modules_to_save": None,
               "rank_pattern": {},
               "alpha_pattern": {}, "layer_replication": None, "use_qalora": False,
               "trainable_token_indices": None}


@dataclass
class LoRAAdapter:
    """One adapter read from disk: for each target weight of the model (in our names), its A and
    s·B."""

    path: Path
    rank: int
    scale: float
    # "<module path>.weight" -> (A [r, in], s·B [out, r])
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def deltas(self) -> dict[str, torch.Tensor]:
        """ΔW = s · B A [out, in] of each target, float32 (what merging adds)."""
        return {name: B @ A for name, (A, B) in self.factors.items()}


def load_lora_adapter(path: str | Path, cfg: ModelConfig) -> LoRAAdapter:
    """Read a PEFT LoRA directory: each target's A and s·B in float32, named after the parameter
    they update."""
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise CheckpointError(f"{path} is not a PEFT LoRA adapter: {f.name} is missing")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{config_file}: peft_type {config['peft_type']!r} is not supported; "
                              "allowed: 'LORA'")
    for field, allowed in UNSUPPORTED.items():
        value = config.get(field)
        if value is not None and value != allowed and value not in ({}, [], False):
            raise CheckpointError(f"{config_file}: {field}={value!r} is not supported by "
                                  f"nanoserve's LoRA; allowed: {allowed!r}")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise CheckpointError(f"{config_file}: r must be an int ≥ 1 and lora_alpha a number, got "
                              f"r={r!r}, lora_alpha={alpha!r}")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    tensors = load_file(str(weights_file))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, dot, which = key.removeprefix(PREFIX).rpartition(".lora_")
        if not dot or which not in ("A.weight", "B.weight"):
            raise CheckpointError(f"{weights_file}: tensor {key!r} is not a LoRA A or B weight "
                                  "(embedding LoRA and other tensors are not supported)")
        pairs.setdefault(module, {})[which[0]] = t
    factors = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"{weights_file}: module {module!r} has lora_{next(iter(ab))} "
                                  "but not its partner")
        A, B = ab["A"].float(), ab["B"].float()  # r, in; out, r
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] != r or B.shape[1] != r:
            raise CheckpointError(f"{weights_file}: module {module!r} has A {tuple(A.shape)} and B "
                                  f"{tuple(B.shape)}; expected [r, in] and [out, r] with r={r} "
                                  "(adapter_config.json)")
        key = f"{module}.weight"
        # a fused target: B split by rows, A shared
        for part, B_part in split_fused(cfg, {key: scale * B}).items():
            factors[part] = (A, B_part)
    return LoRAAdapter(path, r, scale, factors)


def target_modules(model: nn.Module, adapter: LoRAAdapter) -> list[tuple[str, nn.Module]]:
    """(module name, module) of every target, each checked to exist and to fit its A and B, before
    anything changes. A module fits when its in_features and out_features are A's and B's (a plain,
    a oneDNN or a quantized linear all have them)."""
    out = []
    for name, (A, B) in adapter.factors.items():
        module_name = name.rpartition(".")[0]
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise CheckpointError(f"{adapter.path}: the adapter updates {module_name!r}, which "
                                  "this model does not have") from None
        shape = (getattr(module, "out_features", None), getattr(module, "in_features", None))
        if shape != (B.shape[0], A.shape[1]):
            raise CheckpointError(f"{adapter.path}: ΔW of {module_name!r} is "
                                  f"{(B.shape[0], A.shape[1])}, the layer {shape} (out, in): the "
                                  "adapter was trained on another model shape")
        out.append((module_name, module))
    return out


def _merge_targets(model: nn.Module,
                   adapter: LoRAAdapter) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, ΔW) of every target; merging needs plain linear layers whose weight no other layer
    shares."""
    # tied weights under each of their names
    params = dict(model.named_parameters(remove_duplicate=False))
    deltas, out = adapter.deltas, []
    for module_name, module in target_modules(model, adapter):
        name = f"{module_name}.weight"
        if not isinstance(module, nn.Linear) or name not in params:
            raise CheckpointError(f"{adapter.path}: {module_name!r} is a {type(module).__name__}, "
                                  "not a plain linear layer: merging into a quantized layer is "
                                  "not supported (lora_merge=False applies the adapter beside it)")
        p = params[name]
        tied = [other for other, q in params.items() if q is p and other != name]
        # PEFT adds BA to this layer's output only; merged, it would change the tied layer too
        if tied:
            raise CheckpointError(f"{adapter.path}: {module_name!r} shares its weight with "
                                  f"{tied[0]!r} (tied embeddings): merging would change both; not "
                                  "supported")
        out.append((p, deltas[name]))
    return out


@torch.no_grad()
def merge_lora(model: nn.Module, adapter: LoRAAdapter) -> None:
    """W ← W + ΔW for every target (in float32, then back to W's dtype)."""
    for p, delta in _merge_targets(model, adapter):
        p.copy_((p.float() + delta.to(p.device)).to(p.dtype))


@torch.no_grad()
def unmerge_lora(model: nn.Module, adapter: LoRAAdapter) -> None:
    """W ← W − ΔW: the base back, up to rounding in W's dtype (exact in float32 only when W + ΔW
    was)."""
    for p, delta in _merge_targets(model, adapter):
        p.copy_((p.float() - delta.to(p.device)).to(p.dtype))
