"""Exercise 3: from logits to a token: temperature, min-p, top-k, top-p, the penalties, greedy.

Your versions of functions in nanoserve/engine/sampler.py, with the same names and signatures.
Taught in notebooks/01_engine_core.ipynb (section 5) and notebooks/00_tour.ipynb (section 3).
Check your work with

    make exercises EX=ex03        # or: .venv/bin/pytest tests/exercises -m ex03 --impl exercises

The pipeline, in the order vLLM applies it:

    logits ─ logit_bias ─ min_tokens ─ repetition / presence / frequency penalties   (process_logits)
           ─ /temperature ─ min-p ─ top-k ─ top-p ─ softmax                           (probs_from_logits)
           ─ draw (seeded)                                                            (sample_next)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

# sample_next's settings: temperature, top_k, top_p, ...
from nanoserve.engine.sampler import SamplingParams


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                      min_p: float = 0.0) -> torch.Tensor:
    """The distribution sampled from: softmax(logits / T) restricted to the min-p, top-k and top-p
    sets.

    logits [..., V] -> probs [..., V] in float32. Tokens outside the kept set get exactly 0.
    In this order: divide by the temperature (> 0; greedy never comes here); min-p (0 = off) drops
    every token whose probability at this temperature is below min_p × the most likely one's; top-k
    keeps every token whose logit is ≥ the k-th largest (ties at the k-th are all kept, as in HF and
    vLLM); softmax; top-p then keeps, going down in probability, each token while the tokens before
    it hold less than top_p (the one that crosses top_p is kept), and renormalises. top_k = 0 or
    ≥ V and top_p = 1 mean off: they must keep every token, whatever float32 rounding does."""
    raise NotImplementedError(
        "Exercise 3.1: the temperature rescales the logits; min-p, top-k and top-p each keep a "
        "subset of the tokens; the softmax over what is kept is the law (roughly 15 lines; see "
        "notebooks/01_engine_core, section 5, 'Sampling in one cell'; more: make hint EX=ex03 "
        "N=2)")


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor,
                             penalty: float) -> torch.Tensor:
    """CTRL's rule: for every token already seen, a positive logit is divided by the penalty and a
    negative one multiplied by it (both make it less likely for penalty > 1). logits [V] or [B, V].

    seen_ids [N] may repeat a token (it is penalised once) and may be empty; every row of a batch
    shares them. Do not modify the input logits in place: the caller still holds them."""
    raise NotImplementedError(
        "Exercise 3.2: a seen token becomes less likely whatever the sign of its logit (roughly 6 "
        "lines; see notebooks/01_engine_core, section 5, 'Beyond top-p', and the rule above; "
        "more: make hint EX=ex03 N=2)")


def apply_penalties(logits: torch.Tensor, output_ids: Sequence[int], presence: float,
                    frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties on one row of logits [V]: every token t generated
    so far loses frequency × count(t) + presence (once, if count(t) > 0). Only `output_ids` count,
    never the prompt. With no output, or both penalties 0, the logits come back unchanged."""
    raise NotImplementedError(
        "Exercise 3.4: count each generated token; frequency is paid per occurrence, presence "
        "once (roughly 5 lines; see notebooks/01_engine_core, section 5, 'Beyond top-p'; more: "
        "make hint EX=ex03 N=2)")


def process_logits(logits: torch.Tensor, params: SamplingParams,
                   seen_ids: torch.Tensor | None = None,
                   output_ids: Sequence[int] = (), stop_ids: Collection[int] = ()) -> torch.Tensor:
    """What happens to one row's logits [V] before the temperature, in this order:
    1. params.logit_bias {token id: bias} is added;
    2. while fewer than params.min_tokens tokens are out (len(output_ids)), every id in stop_ids
       (below V) gets -inf: the request cannot stop yet;
    3. the repetition penalty over seen_ids (prompt + output), when seen_ids is given;
    4. the presence / frequency penalties over output_ids.
    Return new logits; the caller's stay as they were."""
    raise NotImplementedError(
        "Exercise 3.5: the four edits in the order the docstring gives, each on the logits the "
        "one before returned (roughly 10 lines; see notebooks/01_engine_core, section 5, 'Beyond "
        "top-p'; more: make hint EX=ex03 N=2)")


def sample_next(logits: torch.Tensor, params: SamplingParams, seen_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None, output_ids: Sequence[int] = (),
                stop_ids: Collection[int] = ()) -> int:
    """One token id from one position's logits [V] (`output_ids`: the tokens generated so far).

    process_logits applies first. Temperature 0 (params.greedy) is the argmax of the processed
    logits and draws no random numbers; otherwise draw one token from probs_from_logits(...,
    params.min_p) with `generator` (None: torch's global one)."""
    raise NotImplementedError(
        "Exercise 3.3: the processed logits decide; temperature 0 is greedy and draws no random "
        "number; otherwise one draw from 3.1's law with the request's generator (roughly 6 lines; "
        "see notebooks/01_engine_core, section 5, 'Sampling in one cell'; more: make hint "
        "EX=ex03 N=2)")
