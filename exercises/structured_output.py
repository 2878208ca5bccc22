"""Exercise 14: a grammar as a token mask — applying it in the sampler, and per draft position in
verification.

Your versions of apply_bitmask and mask_verification from nanoserve/engine/structured_output.py,
with the same names and signatures. A grammar engine (llguidance) gives, for the next token, a
*bitmask*: int32 words [R, W] with W = ceil(V / 32), bit b of word w (counting from the least
significant) saying whether token 32·w + b may come next. `token_bitmask(matchers, V)` (imported
below) computes it for a list of matchers. Taught in notebooks/11_structured_outputs.ipynb, section
2. Check your work with

    make exercises EX=ex14        # or: .venv/bin/pytest tests/exercises -m ex14 --impl exercises
"""

from __future__ import annotations

import torch

from nanoserve.engine.structured_output import token_bitmask  # noqa: F401  (for mask_verification)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with every token whose bit is 0 at -inf (a new tensor; the input stays as it
    was). bitmask [R, W] int32; bits past V (the last word's padding) are ignored. Note that bit 31
    makes a word negative: shift and mask, do not compare words."""
    raise NotImplementedError(
        "Exercise 14.1: the bits say which tokens may come next, 32 to a word, lowest bit first; "
        "the others become impossible (roughly 4 lines; see notebooks/11_structured_outputs, "
        "section 2, 'A grammar as a token mask'; more: make hint EX=ex14 N=2)")


def mask_verification(matcher, draft_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Speculative verification under a grammar: logits [γ+1, V] of one row, position j limited to
    the grammar's tokens after drafts 0..j−1 (position 0: the matcher's state now). Consume the
    drafts one at a time with matcher.try_consume_tokens([d]) (returns 1 if accepted, 0 if the
    grammar refuses d); once one is refused, the positions after it get the refused position's mask
    (they are never used). Return the masked logits and leave the matcher where it began:
    matcher.rollback(number consumed). With matcher None, return logits unchanged."""
    raise NotImplementedError(
        "Exercise 14.2: each position masked by the grammar's state after the drafts before it, "
        "the matcher put back where it began (roughly 11 lines; see "
        "notebooks/11_structured_outputs, section 2, 'Drafts under a grammar'; more: make hint "
        "EX=ex14 N=2)")
