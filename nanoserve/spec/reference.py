"""The speculative decoding loop for one sequence, with models given as callables: the algorithm
of rejection_sampler.py end to end (draft γ, verify in one call, accept, roll back), small enough
to read in one sitting and to test against the exact law on toy Markov chains (tests and notebook
08). The engine runs the same steps batched over paged caches (spec_decode.py). Taught in
notebooks/08_*.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..engine.sampler import probs_from_logits
from ..errors import check, is_int
from .rejection_sampler import (
    check_gamma,
    exponential_noise,
    greedy_verify,
    rejection_sample,
    sample_by_noise,
)


@dataclass
class SpeculativeOutput:
    # generated tokens (prompt excluded), max_tokens of them
    token_ids: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)  # per target call: draft tokens accepted
    num_drafted: list[int] = field(default_factory=list)  # per target call: draft tokens proposed

    @property
    def num_target_calls(self) -> int:
        return len(self.num_accepted)

    @property
    def tokens_per_target_call(self) -> float:
        """Tokens emitted per verification, counted before the final cut to max_tokens."""
        return (sum(self.num_accepted) + self.num_target_calls) / max(self.num_target_calls, 1)

    @property
    def acceptance_rate(self) -> float:
        """α̂ = accepted / (accepted + rejected): drafts after a rejection were never tested.
        (vLLM's "draft acceptance rate" divides by all drafted tokens instead, which is lower.)"""
        rejected = sum(a < d for a, d in zip(self.num_accepted, self.num_drafted))
        tested = sum(self.num_accepted) + rejected
        return sum(self.num_accepted) / tested if tested else float("nan")


def speculative_generate(target_step: Callable[[list[int], list[int]], torch.Tensor],
                         draft_step: Callable[[list[int]], torch.Tensor], prompt: Sequence[int],
                         max_tokens: int, gamma: int, temperature: float = 1.0,
                         generator: torch.Generator | None = None, *, top_k: int = 0,
                         top_p: float = 1.0) -> SpeculativeOutput:
    """Speculative decoding of one sequence with models given as callables (toy models, tests).

    `draft_step(tokens)` -> logits [V] for the token after `tokens`; `target_step(tokens, draft)` ->
    logits [len(draft)+1, V], row i for the token after tokens + draft[:i] (one verification call).
    Logits become p and q through `probs_from_logits` with temperature / top_k / top_p; a table of
    probabilities goes in as its log. Temperature 0 drafts by argmax and verifies with
    `greedy_verify`. Generates exactly max_tokens tokens (a last step's surplus is cut off).
    """
    check_gamma(gamma, "gamma")
    check(is_int(max_tokens) and max_tokens >= 1,
          f"max_tokens={max_tokens!r} must be an integer ≥ 1")
    check(temperature == 0 or temperature >= 1e-6,
          f"temperature={temperature!r} must be 0 (greedy) or ≥ 1e-6")
    check(len(prompt) >= 1, "the prompt must hold at least one token")
    greedy = temperature == 0
    seq = list(prompt)  # the accepted tokens: what the target has seen and verified
    draft_state = list(prompt)  # the draft's context (its KV cache, in an engine)
    out = SpeculativeOutput()
    while len(seq) - len(prompt) < max_tokens:
        # 1. Draft: γ sequential calls, each conditioned on the draft's own previous guesses.
        draft, q_rows = [], []
        for _ in range(gamma):
            logits = draft_step(list(draft_state))  # V
            if greedy:
                token = int(logits.argmax())
            else:
                q = probs_from_logits(logits, temperature, top_k, top_p)  # V
                token = int(
                    sample_by_noise(q, exponential_noise(q.shape, generator, q.dtype, q.device))
                )
                q_rows.append(q)
            draft.append(token)
            draft_state.append(token)
        # 2. Verify: one target call scores all γ + 1 positions.
        logits = target_step(list(seq), list(draft))  # γ+1, V
        draft_ids = torch.tensor(draft, dtype=torch.long)  # γ
        if greedy:
            new, accepted = greedy_verify(draft_ids, logits)
        else:
            p = probs_from_logits(logits, temperature, top_k, top_p)  # γ+1, V
            new, accepted = rejection_sample(draft_ids, torch.stack(q_rows), p, generator)
        # 3. Roll back: the draft's state forgets its rejected guesses, then sees the new last
        # token.
        del draft_state[len(seq) + accepted:]
        seq += new
        draft_state.append(new[-1])
        assert draft_state == seq, "rollback left the draft out of step with the target"
        out.num_accepted.append(accepted)
        out.num_drafted.append(gamma)
    out.token_ids = seq[len(prompt):len(prompt) + max_tokens]
    return out
