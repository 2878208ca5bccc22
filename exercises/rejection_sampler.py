"""Exercise 12: the rejection sampler of speculative decoding, which keeps the target's distribution
exactly.

Your versions of residual_distribution and rejection_sample from
nanoserve/spec/rejection_sampler.py, with the same names and signatures. Taught in
notebooks/08_speculative_decoding.ipynb, section 1. Check your work with

    make exercises EX=ex12        # or: .venv/bin/pytest tests/exercises -m ex12 --impl exercises

Names from Leviathan et al. 2023: p the target's next-token distribution, q the draft's, γ the
number of draft tokens, V the vocabulary. Draw x ~ q, keep it with probability min(1, p(x)/q(x)),
on rejection draw from the residual; then the emitted token is distributed exactly as p.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401  (F.one_hot, for q=None)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p − q, 0)): what to sample after a rejection. p, q [..., V] -> [..., V].

    In exact arithmetic a rejection needs p(x) < q(x) for the drafted x, hence mass where p > q too,
    so the residual is never empty when it is used. With rounded probabilities p ≤ q can hold
    everywhere (say p = q·(1 − 1e-7)); there we return p itself, the law the residual stands in
    for. That changes the output law by at most the rejection probability, itself rounding-sized.
    """
    raise NotImplementedError(
        "Exercise 12.1: the mass where the target exceeds the draft, normalised; the target itself "
        "where there is none (roughly 3 lines; see notebooks/08_speculative_decoding, section 1, "
        "'The rejection sampler'; more: make hint EX=ex12 N=2)")


def rejection_sample(draft_ids: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Verify one sequence's draft: (tokens to emit, number of draft tokens accepted).

    draft_ids [γ] long, q [γ, V] (None: a deterministic proposal, q one-hot at each draft token),
    p [γ+1, V]. Keeps x_i with probability min(1, p_i(x_i)/q_i(x_i)); the first rejected one is
    replaced by a draw from the residual and ends the step; if all are kept a bonus token comes
    from p[γ]. Returns 1..γ+1 tokens. γ = 0 (a proposer found nothing) is an ordinary decode step.

    The tokens are Python ints, and the accepted drafts come first: tokens[:n] == draft_ids[:n].
    Draw every random number from `generator` (None: torch's global one), so that the same seed
    gives the same tokens. Each drafted x has q(x) > 0 (it was drawn from q).
    """
    raise NotImplementedError(
        "Exercise 12.2: keep each draft with probability p/q at its token, capped at one; the "
        "first rejection emits a token from the residual and ends the step; if all survive, a "
        "bonus token from the target (roughly 15 lines; see notebooks/08_speculative_decoding, "
        "section 1, 'The rejection sampler'; more: make hint EX=ex12 N=2)")
