"""Tokens still on the device, fed into the next forward: the model runner's `late_tokens`.

A sequence whose newest token was sampled on the device but not yet read back holds a
`PLACEHOLDER` in its token ids on the host: its length, slots and blocks are right, only the id is
unknown there. When the model runner builds the next forward's inputs, `LateTokens.fill` copies
the real ids into those places of `input_ids`, device to device, so the host never waits for them.
Two extensions use it: async scheduling (async_step.py: the step before's tokens) and a draft
model's chain of forwards in speculative decoding (spec/proposers.py: the draft before's).
"""

from __future__ import annotations

import torch

from .sequence import Sequence

PLACEHOLDER = -1  # a sampled token's id while it is still on the device


class LateTokens:
    """What the model runner asks while building a step's inputs: which rows' tokens are still on
    the device, and where (ModelRunner.late_tokens)."""

    def __init__(self, tokens: torch.Tensor, index_of: dict[int, tuple[int, int]]):
        self.tokens = tokens  # R, K on the device
        # {seq_id: (r, p)}: the sequence's token at position p + j is tokens[r, j]
        self.index_of = index_of

    def fill(self, input_ids: torch.Tensor, seqs: list[Sequence], num_new: list[int]) -> None:
        """Put the device's tokens into `input_ids` [B, T] (on the device) wherever a row's new
        token is a placeholder: device copies, no read back."""
        rows, cols, src_rows, src_cols = [], [], [], []
        for i, (seq, n) in enumerate(zip(seqs, num_new)):
            where = self.index_of.get(seq.seq_id)
            if where is None:
                continue
            r, first = where
            start = seq.num_computed_tokens  # the row's new tokens: start .. start + n − 1
            for c in range(max(0, first - start), n):
                if seq.token_ids[start + c] == PLACEHOLDER:
                    rows.append(i)
                    cols.append(c)
                    src_rows.append(r)
                    src_cols.append(start + c - first)
        if rows:
            index = torch.tensor([rows, cols, src_rows, src_cols])  # 4, n
            index = index.to(input_ids.device, non_blocking=True)  # one copy
            input_ids[index[0], index[1]] = self.tokens[index[2], index[3]]
