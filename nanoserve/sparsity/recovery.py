"""A short recovery fine-tune of a pruned model, its masks held fixed.

Pruning moves a model off the minimum it was trained to; a few hundred steps of ordinary training
win back part of the loss. The zeros must stay zeros: after every optimizer step the masks are
applied again (AdamW's momentum and weight decay would otherwise move a pruned weight off zero).
The step is tools/train.py's, reused piece by piece (`get_batch`, `loss_fn`, `lr_at`,
`TrainConfig`): byte-level data, the first 90 % for training, AdamW, warmup then cosine decay,
gradient clipping. tools/train.py trains from a fresh init; this trains a model it is given.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..tools.train import TrainConfig, estimate, get_batch, load_bytes, loss_fn, lr_at
from .model import apply_masks


def recover(model: torch.nn.Module, masks: dict[str, torch.Tensor], data_path: str | Path,
            tc: TrainConfig) -> dict:
    """Fine-tune `model` in place on byte-level data for tc.steps steps, re-applying `masks` after
    every step. Returns the validation loss (nats/byte) before and after, and the time taken."""
    if tc.threads:
        torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    train_ids, val_ids = load_bytes(data_path)
    before = estimate(model, val_ids, tc)["loss"]
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator().manual_seed(tc.seed)
    start = time.perf_counter()
    for step in range(tc.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        x, y = get_batch(train_ids, tc.batch_size, tc.block_size, gen)
        loss = loss_fn(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        opt.step()
        apply_masks(model, masks)
    seconds = time.perf_counter() - start
    after = estimate(model, val_ids, tc)["loss"]
    model.eval()
    return {"val_loss_before": before, "val_loss_after": after, "steps": tc.steps,
            "seconds": seconds}
