"""The sampling law written out for one row, plainly, as the tests' reference.

nanoserve has one sampling path, batched (nanoserve/engine/sampler.py: `probs_from_logits_batch`,
`sample_batch`; one row is a batch of one). A test that compared that path with itself could not
fail, so the row-by-row law lives here instead, written from its definition — vLLM's order of
settings, temperature, then min-p, top-k and top-p, each keeping at least the most likely token —
and the tests hold the engine's batch to it, row by row and draw for draw.
"""

from __future__ import annotations

import torch

from nanoserve.engine.sampler import process_logits

_F32 = torch.finfo(torch.float32)


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> torch.Tensor:
    """softmax(logits / T) over the tokens min-p, top-k and top-p keep, for one row [V] (or rows
    sharing settings, [..., V]); float32, exact zeros outside the kept set."""
    scaled = logits.float() / temperature
    # a huge logit / a tiny T overflows to ±inf, and softmax(+inf) is NaN: clamp to finite floats
    scaled = scaled.nan_to_num(nan=0.0, posinf=_F32.max, neginf=-_F32.max)
    if min_p > 0:  # drop tokens less likely than min_p × the most likely one's probability
        p = scaled.softmax(dim=-1)
        scaled = scaled.masked_fill(p < min_p * p.amax(dim=-1, keepdim=True), float("-inf"))
    if top_k and top_k < scaled.shape[-1]:  # keep the k largest logits (ties with the k-th too)
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if top_p < 1.0:
        # drop a token once the tokens strictly more likely than it already reach top_p
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop_sorted[..., 0] = False  # the most likely token always stays
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def reference_sample(logits: torch.Tensor, params, seen_ids=None, generator=None,
                     output_ids=(), stop_ids=()) -> int:
    """One token from one row [V]: the request's reshaping (logit bias, min_tokens, penalties),
    then the argmax (greedy) or one multinomial draw from `reference_probs` on `generator`."""
    logits = process_logits(logits, params, seen_ids, output_ids, stop_ids)
    if params.greedy:
        return int(logits.argmax())
    probs = reference_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    return int(torch.multinomial(probs, 1, generator=generator))
