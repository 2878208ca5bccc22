"""SmoothQuant (Xiao et al. 2023): move the activations' outliers into the weights, then W8A8.

Per-token int8 activations fail on outlier *channels* (int8.py); weights have none and quantize
easily. SmoothQuant divides each input channel k of a linear's input by a factor s_k and multiplies
the matching weight column by it — X·Wᵀ = (X / s)·(W · s)ᵀ exactly — choosing

    s_k = max|X_k|^α / max|W_k|^(1−α)          (max over calibration tokens; over every linear's
                                               rows)

so that α moves the difficulty: α = 0 leaves X alone, α = 1 flattens X entirely onto W, and α = 0.5
gives both the same range, max|X'_k| = max|W'_k| = √(max|X_k| · max|W_k|). 1/s is folded into the
op that produces X (a norm's weight and bias, or the linear before: v → o, up → down), the same
folding AWQ does (awq.fold_scales), so smoothing costs nothing at run time. A group whose input
comes from an op with no per-channel weight (GPT-2's attention output, its GELU) stays unsmoothed.
Then every linear of every block becomes a `W8A8Linear` (int8.py): per-channel weights, per-token
dynamic activations. `smooth_model` measures the channel maxima in one float pass over calibration
text and folds; online.py's `quantize_linears` swaps the layers. Taught in notebooks/13_w8a8.ipynb.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import NanoserveError
from .awq import fold_scales
from .gptq import capture_inputs
from .model import block_groups, block_inputs, decoder_blocks, run_block

MIN = 1e-5  # keeps s finite for a channel that is zero in X or in W


def smoothing_factors(act_max: torch.Tensor, weights: Sequence[torch.Tensor],
                      alpha: float) -> torch.Tensor:
    """s [K] = act_max^α / max|W_k|^(1−α), the weight max over the rows of every linear sharing the
    input."""
    if not 0 <= alpha <= 1:
        raise NanoserveError("alpha must lie in [0, 1] (0: no smoothing, 1: all of it onto the "
                             f"weights), got {alpha!r}")
    w_max = torch.stack([w.detach().abs().amax(0).float() for w in weights]).amax(0)  # K
    return (act_max.float().clamp(min=MIN) ** alpha / w_max.clamp(min=MIN) ** (1 - alpha)).clamp(
        min=MIN
    )


@torch.no_grad()
def channel_maxima(model: nn.Module, calib: torch.Tensor,
                   batch_size: int = 8) -> dict[str, torch.Tensor]:
    """max |x_k| over the calibration tokens of the input of every block linear: {module name:
    [K]}."""
    prefix, blocks = decoder_blocks(model)
    inputs = block_inputs(model, blocks[0], calib, batch_size)
    found: dict[str, torch.Tensor] = {}

    def record(name, x):
        m = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()  # K
        found[name] = torch.maximum(found[name], m) if name in found else m

    for i, block in enumerate(blocks):
        names = [n for _, group in block_groups(model, block) for n in group]
        with capture_inputs({f"{prefix}.{i}.{n}": block.get_submodule(n) for n in names}, record):
            outs = run_block(block, inputs)
        inputs = [(o, *args[1:]) for o, args in zip(outs, inputs)]
    return found


@torch.no_grad()
def smooth_model(model: nn.Module, calib: torch.Tensor, alpha: float = 0.5,
                 batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Fold SmoothQuant's factors into every block (the model's float outputs do not change);
    returns {first linear of each smoothed group: s [K]}. calib: token ids [n_samples, seqlen]."""
    if calib.dim() != 2 or calib.dtype not in (torch.int32, torch.int64) or calib.shape[0] == 0:
        raise NanoserveError(f"calibration ids must be an integer tensor [n_samples, seqlen], got "
                             f"{calib.dtype} {tuple(calib.shape)}")
    maxima = channel_maxima(model, calib.to(next(model.parameters()).device), batch_size)
    prefix, blocks = decoder_blocks(model)
    factors = {}
    for i, block in enumerate(blocks):
        for prev, names in block_groups(model, block):
            if prev is None:  # nothing with a per-channel weight produces this input: left as it is
                continue
            lins = [block.get_submodule(n) for n in names]
            s = smoothing_factors(
                maxima[f"{prefix}.{i}.{names[0]}"], [lin.weight for lin in lins], alpha
            )
            fold_scales(block.get_submodule(prev), lins, s)
            factors[f"{prefix}.{i}.{names[0]}"] = s
    return factors

