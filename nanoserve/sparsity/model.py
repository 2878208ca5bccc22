"""Prune a whole model: every linear of every transformer block, block by block.

The loop is quant/model.py's (GPTQ's), reused piece by piece: the calibration text is run up to
block 0 (`block_inputs`); then for each block, group by group in the order the block runs them
(`block_groups`: q/k/v, then o, then the MLP's), the block is run on its inputs with hooks
accumulating each linear's Hessian H = 2XᵀX/T (`GPTQ.add_batch`, `capture_inputs`), the group is
pruned, and the pruned block's outputs become the next block's inputs. So every layer is
calibrated on what the already-pruned layers before it really produce (SparseGPT's and Wanda's
reference code do the same, block by block).

Left dense: the token and position embeddings, every norm, every bias and the LM head (tied to the
embeddings in GPT-2; pruning it hurts most and saves little at these sizes — Wanda and SparseGPT
leave it dense too). Mixture-of-experts models are refused with calibration, as in quantize_model:
an expert may see no calibration token at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import NanoserveError
from ..quant.gptq import GPTQ, capture_inputs
from ..quant.model import block_groups, block_inputs, calibration_ids, decoder_blocks, run_block
from .pruning import SparsityConfig, prune_weight

DENSE_PARTS = ("embeddings", "norms", "biases", "lm_head")


@dataclass
class PruneResult:
    config: SparsityConfig
    masks: dict[str, torch.Tensor]                # full module name → bool [N, K], True = kept
    block_errors: list[float] = field(default_factory=list)   # ‖y_p − y‖² / ‖y‖², calibration

    def sparsity(self) -> float:
        """The fraction of the pruned layers' weights that are zero by the masks."""
        total = sum(m.numel() for m in self.masks.values())
        kept = sum(int(m.sum()) for m in self.masks.values())
        return 1 - kept / max(total, 1)


def calibration_for(tokenizer, text: str, config: SparsityConfig) -> torch.Tensor:
    """[nsamples, seqlen] token ids drawn from `text` as the config says (GPTQ's windows)."""
    return calibration_ids(tokenizer, text, config.nsamples, config.seqlen, config.seed)


def block_linears(model: nn.Module, block: nn.Module) -> list[list[str]]:
    """The names (inside a block) of the linears pruned, grouped by the input they read."""
    return [names for _prev, names in block_groups(model, block)]


@torch.no_grad()
def prune_model(model: nn.Module, config: SparsityConfig,
                calib: torch.Tensor | None = None, batch_size: int = 8) -> PruneResult:
    """Prune every linear of every block in place (weights become Ŵ, zeros in place); returns the
    masks. calib: token ids [n_samples, seqlen]; needed by Wanda and SparseGPT, optional for
    magnitude (then only used to report block errors)."""
    if config.needs_calibration and calib is None:
        raise NanoserveError(f"method={config.method!r} needs calibration text: pass token ids "
                             "[n_samples, seqlen] (calibration_for(tokenizer, text, config))")
    if calib is not None and (calib.dim() != 2 or calib.shape[0] == 0
                              or calib.dtype not in (torch.int32, torch.int64)):
        raise NanoserveError(f"calibration ids must be an integer tensor [n_samples, seqlen], got "
                             f"{calib.dtype} {tuple(calib.shape)}")
    if getattr(model.config, "num_experts", 0) and config.needs_calibration:
        raise NanoserveError(f"method={config.method!r} on a mixture-of-experts model is not "
                             "supported (an expert may see no calibration token); use magnitude")
    prefix, blocks = decoder_blocks(model)
    device = next(model.parameters()).device
    result = PruneResult(config=config, masks={})
    inputs = None
    if calib is not None:
        inputs = block_inputs(model, blocks[0], calib.to(device), batch_size)
    for i, block in enumerate(blocks):
        ref = run_block(block, inputs) if inputs is not None else None
        for names in block_linears(model, block):
            masks = _prune_group(block, names, inputs, config)
            result.masks.update({f"{prefix}.{i}.{n}": m for n, m in masks.items()})
        if inputs is not None:
            outs = run_block(block, inputs)
            result.block_errors.append(_relative_error(outs, ref))
            inputs = [(o, *args[1:]) for o, args in zip(outs, inputs)]
    return result


def _prune_group(block: nn.Module, names: list[str], inputs: list[tuple] | None,
                 config: SparsityConfig) -> dict[str, torch.Tensor]:
    """Calibrate (if the method needs it) and prune the linears of one group, in place."""
    lins = {n: block.get_submodule(n) for n in names}
    stats = {}
    if config.needs_calibration:
        stats = {n: GPTQ(lin.weight, torch.float32) for n, lin in lins.items()}
        with capture_inputs(lins, lambda n, x: stats[n].add_batch(x)):
            run_block(block, inputs)
    masks = {}
    for n, lin in lins.items():
        H = stats[n].H if n in stats else None
        nsamples = stats[n].nsamples if n in stats else 0
        pruned, mask = prune_weight(lin.weight.float(), config, H, nsamples)
        lin.weight.copy_(pruned.to(lin.weight.dtype))
        masks[n] = mask.cpu()
    return masks


def _relative_error(outs: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    err = sum(((o - r).float() ** 2).sum().item() for o, r in zip(outs, ref))
    return err / max(sum((r.float() ** 2).sum().item() for r in ref), 1e-30)


def apply_masks(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """Zero every weight a mask drops (after an optimizer step, to keep the pattern fixed)."""
    with torch.no_grad():
        for name, mask in masks.items():
            weight = model.get_submodule(name).weight
            weight.mul_(mask.to(device=weight.device, dtype=weight.dtype))
