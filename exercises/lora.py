"""Exercise 17: many LoRA adapters in one batch — each token row's x·Aₛᵀ·Bₛᵀ, by segments and by
gathering.

Your versions of `lora_segmented` and `lora_gathered` from nanoserve/lora/batched.py, with the same
names and signatures. The slots hold A [S, R, in] and B [S, out, R] (the adapter's scale already
folded into B); each token row has a slot, −1 meaning no adapter (its part is zero). Taught in
notebooks/14_lora.ipynb, section 5. Check your work with

    make exercises EX=ex17        # or: .venv/bin/pytest tests/exercises -m ex17 --impl exercises
"""

from __future__ import annotations

import torch


def lora_segmented(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                   present: list[int]) -> torch.Tensor:
    """Σ over adapters s in `present` of rows(slot = s)·A[s]ᵀ·B[s]ᵀ. x [N, in], A [S, R, in], B [S,
    out, R], slots [N] -> [N, out]; `present` lists the slots that occur (host values: no device
    read here)."""
    raise NotImplementedError(
        "Exercise 17.1: the rows that share an adapter share its two thin matmuls: each adapter "
        "present runs once, on its rows (roughly 5 lines; see notebooks/14_lora, section 5, 'Many "
        "adapters in one batch'; more: make hint EX=ex17 N=2)")


def lora_gathered(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
    """Each row's own adapter gathered: x [N, in] -> [N, out]; a row with slot −1 gets zeros."""
    raise NotImplementedError(
        "Exercise 17.2: every row its own copy of its adapter, all rows multiplied at once; a row "
        "without an adapter still comes out zero (roughly 5 lines; see notebooks/14_lora, section "
        "5, 'Many adapters in one batch'; more: make hint EX=ex17 N=2)")
