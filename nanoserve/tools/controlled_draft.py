"""A controlled-acceptance proposer, for benchmarks: speculative decoding at an acceptance rate you
choose, with no trained draft model.

What speculation gains depends on α, the chance the target accepts a draft token, and on what a
draft costs (spec/controller.py). A benchmark of the machinery itself (verification, acceptance,
the KV rollback, the engine's steps) needs α held fixed on a model of GPU size, where no trained
target/draft pair exists offline. So:

    continuations = record_continuations(llm, prompts, max_tokens)   # a first, plain greedy run
    use_controlled_draft(llm, continuations, alpha=0.8)              # then speculate at α = 0.8

`ControlledDraft` drafts the target's own greedy continuation, recorded in the first run, and
corrupts each drafted token with probability 1 − α (replaced by another token of the vocabulary,
uniformly). At temperature 0 the target accepts a draft exactly when it equals its argmax, so each
checked draft is accepted with probability α, independently: what SpecStats.alpha estimates. The
corruption is drawn from a generator seeded by (seed, prompt, position), so a run gives the same
drafts whatever the batch or the scheduling. α = 0 is a useless draft (every draft rejected), the
case where speculation must cost little. Drafting itself costs nothing here beyond the host's
lookup; `draft_seconds` adds a fixed wait per drafting call to stand for a draft forward.

Only for greedy requests of the recorded prompts (any other prompt gets no drafts: a plain step).
The engine must be built with speculation on and no draft model (speculative="ngram"); its
proposer is replaced. Sampled requests would accept drafts with the target's probability of them,
not α: not what this measures.
"""

from __future__ import annotations

import random
import time


class ControlledDraft:
    """The proposer (spec/proposers.py's batched interface): the recorded continuation, each token
    kept with probability α."""

    one_call = True  # one lookup gives all γ drafts (spec/controller.py's cost model)

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], alpha: float,
                 vocab_size: int, seed: int = 0, draft_seconds: float = 0.0):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha={alpha!r} must be in [0, 1]")
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size!r}: a corrupted token needs another one")
        if draft_seconds < 0:
            raise ValueError(f"draft_seconds={draft_seconds!r} must be ≥ 0")
        self.continuations = continuations
        self.alpha = alpha
        self.vocab_size = vocab_size
        self.seed = seed
        self.draft_seconds = draft_seconds
        self.diverged = 0  # drafting calls that found a sequence off its recording (none drafted)

    def propose(self, rows, matchers=None):
        """(draft ids, None) for each (sequence, γ, ...) row: deterministic drafts, q one-hot."""
        if self.draft_seconds:
            time.sleep(self.draft_seconds)
        return [(self.draft(seq, gamma), None) for seq, gamma, _, _ in rows]

    def draft(self, seq, gamma: int) -> list[int]:
        """Up to γ tokens: the recorded continuation from the sequence's next position, each one
        corrupted with probability 1 − α. None past the recording, for an unknown prompt, or once
        the sequence left its recording (counted in `diverged`)."""
        prompt = tuple(seq.token_ids[:seq.num_prompt_tokens])
        future = self.continuations.get(prompt)
        if future is None:
            return []
        done = len(seq.token_ids) - seq.num_prompt_tokens
        if seq.token_ids[seq.num_prompt_tokens:] != future[:done]:
            # the target chose otherwise than in the recording (a near tie decided differently
            # by another kernel): drafting from the recording would only be rejected
            self.diverged += 1
            return []
        rng = random.Random(f"{self.seed}/{hash(prompt)}/{done}")
        drafts = []
        for token in future[done:done + gamma]:
            if rng.random() >= self.alpha:  # corrupted: any other token
                token = (token + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size
            drafts.append(token)
        return drafts

    def rollback(self, seq, num_valid: int) -> None:
        pass

    def free(self, seq) -> None:
        pass


def record_continuations(llm, prompts: list[list[int]],
                         max_tokens: int) -> dict[tuple[int, ...], list[int]]:
    """{prompt ids: the target's greedy continuation} from a plain run of `llm` (EOS ignored), one
    prompt at a time, as the benchmarks then decode them (a batch could break a near tie in the
    argmax otherwise)."""
    from ..engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    recorded = {}
    for p in prompts:
        out = llm.generate([list(p)], params, use_tqdm=False)[0]
        recorded[tuple(p)] = list(out.outputs[0].token_ids)
    return recorded


def use_controlled_draft(llm, continuations, alpha: float, seed: int = 0,
                         draft_seconds: float = 0.0) -> ControlledDraft:
    """Replace the proposer of `llm`'s engine (built with speculative="ngram": speculation on, no
    model) by a ControlledDraft at `alpha`; returns it."""
    spec = llm.engine.spec
    if spec is None or spec.config.method != "ngram":
        raise ValueError("use_controlled_draft needs an engine built with speculative='ngram' "
                         "(speculation on, no draft model to replace)")
    draft = ControlledDraft(continuations, alpha, llm.engine.config.vocab_size, seed,
                            draft_seconds)
    spec.proposer = draft
    return draft
