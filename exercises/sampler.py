"""Exercise 3: from logits to a token: temperature, top-k, top-p, the repetition penalty, greedy.

Your versions of functions in nanoserve/engine/sampler.py, with the same names and signatures.
Taught in notebooks/01_engine_core.ipynb (section 5) and notebooks/00_tour.ipynb (section 3).
Check your work with

    make exercises EX=ex03        # or: .venv/bin/pytest tests/exercises -m ex03 --impl exercises

The pipeline, in the order vLLM and HF apply it:

    logits ─ repetition penalty ─ /temperature ─ top-k ─ top-p ─ softmax ─ draw (seeded)
"""

from __future__ import annotations

import torch

from nanoserve.engine.sampler import SamplingParams  # sample_next's settings: temperature, top_k, top_p, ...


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution sampled from: softmax(logits / T) restricted to the top-k / top-p set.

    logits [..., V] -> probs [..., V] in float32. Tokens outside the kept set get exactly 0.
    In this order: divide by the temperature (> 0; greedy never comes here); top-k keeps every
    token whose logit is ≥ the k-th largest (ties at the k-th are all kept, as in HF and vLLM);
    softmax; top-p then keeps, going down in probability, each token while the tokens before it
    hold less than top_p (the one that crosses top_p is kept), and renormalises. top_k = 0 or
    ≥ V and top_p = 1 mean off: they must keep every token, whatever float32 rounding does."""
    raise NotImplementedError(
        "Exercise 3.1: logits / T; top-k with torch.topk and masked_fill(-inf); softmax; top-p on the "
        "probabilities sorted in descending order (cumsum minus the token's own probability), the mask "
        "scattered back to vocabulary order, renormalised "
        "(roughly 12 lines; see notebooks/01_engine_core, section 5, 'Sampling in one cell')")


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's rule: for every token already seen, a positive logit is divided by the penalty and a
    negative one multiplied by it (both make it less likely for penalty > 1). logits [V] or [B, V].

    seen_ids [N] may repeat a token (it is penalised once) and may be empty; every row of a batch
    shares them. Do not modify the input logits in place: the caller still holds them."""
    raise NotImplementedError(
        "Exercise 3.2: a boolean mask of the seen tokens, then torch.where on the logits' sign "
        "(roughly 6 lines; see notebooks/01_engine_core, section 5, 'Sampling in one cell', and the rule above)")


def sample_next(logits: torch.Tensor, params: SamplingParams, seen_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> int:
    """One token id from one position's logits [V].

    The repetition penalty applies first when seen_ids is given. Temperature 0 (params.greedy)
    is the argmax of the penalised logits and draws no random numbers; otherwise draw one token
    from probs_from_logits(...) with `generator` (None: torch's global one)."""
    raise NotImplementedError(
        "Exercise 3.3: penalty, then argmax if greedy, else torch.multinomial over probs_from_logits "
        "with the generator (roughly 6 lines; see notebooks/01_engine_core, section 5, 'Sampling in one cell')")
