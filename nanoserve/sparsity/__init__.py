"""Pruning: magnitude, Wanda and SparseGPT, unstructured or 2:4, on one layer or a whole model.

    pruning.py          one layer: the three ways to choose a mask, SparseGPT's update, the config
    model.py            every linear of every block, calibrated block by block (GPTQ's loop)
    checkpoint.py       saving a pruned model as a dense checkpoint with a checked sparsity_config
    recovery.py         a short fine-tune with the masks held fixed
    semi_structured.py  2:4 weights on sparse tensor cores (CUDA sm_80+)

Taught in notebooks/18_pruning.ipynb; exercise 21 (exercises/pruning.py).
"""

from .checkpoint import check_sparse_model, save_sparse, sparsity_config
from .model import PruneResult, apply_masks, calibration_for, prune_model
from .pruning import (
    SparsityConfig,
    magnitude_mask,
    semi_structured_mask,
    sparsegpt_prune,
    wanda_mask,
)

__all__ = ["PruneResult", "SparsityConfig", "apply_masks", "calibration_for",
           "check_sparse_model", "magnitude_mask", "prune_model", "save_sparse",
           "semi_structured_mask", "sparsegpt_prune", "sparsity_config", "wanda_mask"]
