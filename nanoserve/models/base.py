"""What every nanoserve model shares: one forward for prefill and decode.

A model is embeddings + blocks (`embed_and_blocks`, per family) + an LM head. This class adds
the parts that are the same for all families: default positions, the optional KV cache,
and computing logits only where they are needed (the last position, while generating).
"""

from __future__ import annotations

import torch
from torch import nn


class CausalLM(nn.Module):
    config: object
    # keep the LM head's input as `last_hidden`: True [B, K, C] where the logits are (Medusa's heads
    # read it: spec/medusa.py), "all" [B, T, C] at every position (EAGLE's head:
    # spec/eagle_proposer.py)
    keep_hidden = False

    def embed_and_blocks(self, input_ids, positions, cache):  # pragma: no cover - per family
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache=None, last_only: bool = False,
                logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V]; or [B, 1, V] at the last position (last_only) or
        at position logit_index[b] of each row (ragged batches: only the logits that are sampled);
        a logit_index [B, K] gives [B, K, V] (speculative verification needs several per row).

        Without a cache the T tokens attend causally among themselves (positions 0..T-1).
        With one, they are appended after the cache's `length` tokens and attend to all of them.
        """
        B, T = input_ids.shape
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)  # B, T
        h = self.embed_and_blocks(input_ids, positions, cache)  # B, T, C
        if cache is not None:
            cache.advance(T)
        return self.head(h, logit_index, last_only)

    def head(self, h: torch.Tensor, logit_index: torch.Tensor | None = None,
             last_only: bool = False) -> torch.Tensor:
        """The LM head over the final hidden states h [B, T, C] (after the final norm), where
        forward's logit_index / last_only say (a pipeline's last stage calls it on its own:
        parallel/pipeline.py)."""
        if self.keep_hidden == "all":
            self.last_hidden = h
        if logit_index is not None and h.shape[1] == 1 and logit_index.shape[1:] in ((), (1,)):
            pass  # one position (a decode step), and so one valid index, 0: the logits are h's
        elif logit_index is not None:
            rows = torch.arange(h.shape[0], device=h.device)
            if logit_index.dim() == 1:
                h = h[rows, logit_index][:, None]  # B, 1, C
            else:
                h = h[rows[:, None], logit_index]  # B, K, C
        elif last_only:
            h = h[:, -1:]
        if self.keep_hidden is True:
            self.last_hidden = h
        return self.lm_logits(h)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head on features h [..., C] -> logits [..., V] (and Gemma 2's soft-cap)."""
        logits = self.lm_head(h)
        cap = getattr(self.config, "final_softcap", None)
        # Gemma 2: logits in (−cap, cap)
        return logits if cap is None else cap * torch.tanh(logits / cap)
