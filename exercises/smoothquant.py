"""Exercise 16: SmoothQuant — the smoothing factors, and folding them into a model.

Your versions of `smoothing_factors` and `smooth_model` from nanoserve/quant/smoothquant.py, with
the same names and signatures. Given (imported below): `channel_maxima(model, calib)` ({linear name:
max |x_k| over the calibration tokens}), `decoder_blocks(model)` ((prefix, blocks)),
`block_groups(model, block)` (per
block: (the op producing an input, the linears reading it)) and `fold_scales(prev, linears, s)`
(divides prev's outputs by s, multiplies the linears' input columns by s). Taught in
notebooks/13_w8a8.ipynb, section 4. Check your work with

    make exercises EX=ex16        # or: .venv/bin/pytest tests/exercises -m ex16 --impl exercises
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from nanoserve.errors import NanoserveError  # noqa: F401  (for a bad alpha)
from nanoserve.quant.awq import fold_scales  # noqa: F401
from nanoserve.quant.model import block_groups, decoder_blocks  # noqa: F401
from nanoserve.quant.smoothquant import MIN, channel_maxima  # noqa: F401


def smoothing_factors(act_max: torch.Tensor, weights: Sequence[torch.Tensor],
                      alpha: float) -> torch.Tensor:
    """s [K] = act_max^α / max|W_k|^(1−α): act_max [K] the activations' largest |x| per input
    channel; the weight maximum per input channel k is over the rows of every linear in `weights`
    (each [N_i, K]). Clamp act_max and the weight maximum, and s itself, to at least MIN (1e-5).
    alpha outside [0, 1]: NanoserveError naming it."""
    raise NotImplementedError(
        "Exercise 16.1: a factor per input channel that balances the activations' range against "
        "the weights', α saying how much moves into the weights (roughly 5 lines; see "
        "notebooks/13_w8a8, section 4, 'SmoothQuant'; more: make hint EX=ex16 N=2)")


@torch.no_grad()
def smooth_model(model: nn.Module, calib: torch.Tensor, alpha: float = 0.5,
                 batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Fold the smoothing factors into every block of `model` (its float outputs must not change);
    return {"<prefix>.<i>.<first linear of the group>": s} for every group smoothed. A group whose
    producing op is None is left alone. calib: token ids [n_samples, seqlen] (NanoserveError on
    anything else)."""
    raise NotImplementedError(
        "Exercise 16.2: in every block, each op that feeds linears takes the factors of its input "
        "channels, folded as AWQ does (roughly 12 lines; see notebooks/13_w8a8, section 4, "
        "'Folding'; more: make hint EX=ex16 N=2)")
