"""Allowed-token bitmasks: which tokens a row may draw, packed 32 to an int32 word.

Bit t % 32 of word t // 32 allows token t. A structured-output grammar (engine/structured_output.py)
computes one such mask per row before each draw; the sampler sets every token whose bit is 0 to
-inf, so the draw, greedy or not, can only pick an allowed token. Packed, a 50k vocabulary's mask
is 6 kB: cheap to build on the host and to move to the device once per step.
"""

from __future__ import annotations

import numpy as np
import torch


def apply_row_bitmasks(logits: torch.Tensor, bitmasks: list) -> torch.Tensor:
    """logits [R, V] with each row whose bitmask (int32 [1, W]) is not None limited to it."""
    rows = [i for i, m in enumerate(bitmasks) if m is not None]
    if not rows:
        return logits
    R, V = logits.shape
    allowed = unpack_bitmask(torch.cat([bitmasks[i] for i in rows]), V)  # S, V (host)
    # a matcher in an error state allows nothing: leave its row free rather than let an all -inf row
    # break the batch's draw (the token drawn then fails that request alone, in Request.emit)
    allowed[~allowed.any(-1)] = True
    if len(rows) < R:  # rows without a grammar allow everything
        full = torch.ones(R, V, dtype=torch.bool)
        full[rows] = allowed
        allowed = full
    return torch.where(allowed.to(logits.device, non_blocking=True), logits, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [R, W] int32 (on the host) -> allowed [R, V] bool: bit t % 32 of word t // 32, least
    significant first. The words' bytes, least significant first on a little-endian host, unpacked
    by numpy, faster than the equivalent torch.arange(32) shifts (benchmarks/RESULTS.md)."""
    words = bitmask.numpy().view(np.uint8)
    bits = np.unpackbits(words, axis=1, count=vocab_size, bitorder="little")  # R, V
    return torch.from_numpy(bits.view(np.bool_))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with every token whose bit is 0 at -inf (a new tensor). bitmask [R, W]
    int32."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])  # R, V
    return torch.where(allowed.to(logits.device), logits, float("-inf"))
