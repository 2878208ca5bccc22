"""Saving a pruned model: an ordinary dense checkpoint, zeros in place, that says how it was pruned.

The format is the plain HF one (config.json + model.safetensors, `save_checkpoint`), so any reader
of the architecture — nanoserve, transformers — loads it as a dense model and computes exactly
what the pruned model computes. config.json gains one block:

    "sparsity_config": {
        "format": "dense",                  zeros stored in place (no compressed layout)
        "method": "wanda",                  magnitude | wanda | sparsegpt
        "pattern": "2:4",                   2:4 | unstructured
        "sparsity": 0.5,                    the fraction asked for (0.5 for 2:4)
        "measured_sparsity": 0.5,           zeros / weights over the pruned layers, from the masks
        "targets": ["transformer.h.0.attn.c_attn", ...],   the pruned linears, nanoserve names
        "dense": ["embeddings", "norms", "biases", "lm_head"],
        "producer": "nanoserve"
    }

A 2:4 checkpoint's pattern is a claim a reader can check: nanoserve's loader (through the
"sparsity" extension point) verifies that in every target every group of 4 consecutive inputs
of a row holds at most 2 nonzeros, and refuses the checkpoint naming the first layer that does
not. An unstructured checkpoint claims no pattern; only its target names are checked.
transformers ignores the block (it keeps unknown config keys as attributes).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from ..errors import CheckpointError
from ..models.loader import save_checkpoint
from ..quant.save import copy_tokenizer
from .model import DENSE_PARTS, PruneResult
from .pruning import GROUP, KEEP_PER_GROUP, SEMI_STRUCTURED, is_two_four

PATTERNS = (SEMI_STRUCTURED, "unstructured")


def sparsity_config(result: PruneResult) -> dict:
    """The config.json block describing `result`."""
    cfg = result.config
    return {"format": "dense", "method": cfg.method, "pattern": cfg.pattern,
            "sparsity": cfg.fraction, "measured_sparsity": round(result.sparsity(), 6),
            "targets": sorted(result.masks), "dense": list(DENSE_PARTS), "producer": "nanoserve"}


def save_sparse(model: nn.Module, result: PruneResult, directory: str | os.PathLike,
                tokenizer_from: str | os.PathLike | None = None) -> Path:
    """Write the pruned model (zeros in place) with its sparsity_config; the tokenizer files of
    `tokenizer_from` (a model name or path) are copied beside it. A 2:4 claim is checked first."""
    block = sparsity_config(result)
    check_sparse_model(model, block)
    out = save_checkpoint(model, directory)
    config_path = out / "config.json"
    hf = json.loads(config_path.read_text())
    hf["sparsity_config"] = block
    config_path.write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, out)
    return out


def check_sparse_model(model: nn.Module, block: dict) -> None:
    """Refuse a model that does not hold what its sparsity_config says (CheckpointError naming the
    layer): every target must be a linear of the model; with pattern 2:4, every group of 4
    consecutive inputs of each row of each target has at most 2 nonzeros."""
    if not isinstance(block, dict) or block.get("pattern") not in PATTERNS:
        pattern = block.get("pattern") if isinstance(block, dict) else block
        raise CheckpointError(f"sparsity_config.pattern={pattern!r} is not one nanoserve reads; "
                              f"allowed: {', '.join(PATTERNS)}")
    if block.get("format", "dense") != "dense":
        raise CheckpointError(f"sparsity_config.format={block.get('format')!r}: nanoserve reads "
                              "only 'dense' (zeros stored in place)")
    for name in block.get("targets", []):
        try:
            lin = model.get_submodule(name)
        except AttributeError as e:
            raise CheckpointError(f"sparsity_config names {name}, which is no layer of this "
                                  "model") from e
        if not isinstance(lin, nn.Linear):
            raise CheckpointError(f"sparsity_config names {name}, a {type(lin).__name__}, not a "
                                  "linear layer")
        if block["pattern"] == SEMI_STRUCTURED:
            _check_two_four(name, lin.weight)


def _check_two_four(name: str, weight) -> None:
    n, k = weight.shape
    if k % GROUP:
        raise CheckpointError(f"{name}: sparsity_config says 2:4 but its {k} inputs are not a "
                              f"multiple of {GROUP}")
    ok = is_two_four(weight.detach())                                        # N, K/4
    if not bool(ok.all()):
        row, group = (~ok).nonzero()[0].tolist()
        raise CheckpointError(f"{name}: sparsity_config says 2:4, but {int((~ok).sum())} groups of "
                              f"{GROUP} inputs hold more than {KEEP_PER_GROUP} nonzeros (first: "
                              f"row {row}, inputs {GROUP * group}..{GROUP * group + GROUP - 1})")
