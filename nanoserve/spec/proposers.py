"""Proposers: where draft tokens come from.

- `NgramProposer` (prompt lookup decoding): guess that the text repeats itself; no model.
- `DraftModelProposer`: a small model with its own paged KV cache, batched over the engine's rows;
  its chain of drafts stays on the device (no read back between its forwards, nor after them).
- `NgramDraft`: NgramProposer behind the engine's batched proposer interface.

The engine's speculative path (spec_decode.py) asks one of the last two for each step's drafts.
Taught in notebooks/08_*.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass
from typing import Protocol

import torch

from ..engine.block_allocator import BlockAllocator
from ..engine.late_tokens import PLACEHOLDER, LateTokens
from ..engine.model_runner import ModelRunner
from ..engine.sampler import SamplingParams, probs_from_logits_batch
from ..engine.scheduler import advance, extend, fill_in, rollback
from ..engine.sequence import Sequence
from ..engine.structured_output import mask_rows
from ..errors import check, is_int
from .controller import Stopwatch
from .rejection_sampler import check_gamma


class DraftProposer(Protocol):
    """A draft model, per sequence (the engine's proposers in nanoserve/spec_decode.py do the same
    for a batch of rows at once)."""

    def propose(self, token_ids: list[int], k: int,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        """Up to k tokens continuing token_ids: draft_ids (0 ≤ k' ≤ k of them) and q [k', V], row i
        the law x_i was drawn from given token_ids + x_1..x_{i-1}; None when deterministic (greedy).
        An n-gram proposal is the q = None case: (NgramProposer.propose(token_ids, k), None)."""
        ...


@dataclass
class NgramProposer:
    """Prompt lookup decoding: guess that the text repeats itself. Take the sequence's last n
    tokens, find their most recent earlier occurrence, and propose the tokens that followed it.
    Longer matches are tried first (n = max_n down to min_n): they predict better. No model, so q is
    one-hot (`rejection_sample(..., q=None, ...)`). A linear scan, O(len · n) per call."""

    max_n: int = 3
    min_n: int = 1
    num_speculative_tokens: int = 4  # γ: the default k of propose

    def __post_init__(self) -> None:
        check(is_int(self.min_n) and is_int(self.max_n) and 1 <= self.min_n <= self.max_n,
               f"need integers 1 ≤ min_n ≤ max_n, got min_n={self.min_n!r}, max_n={self.max_n!r}")
        check_gamma(self.num_speculative_tokens, "num_speculative_tokens")

    def propose(self, token_ids: abc.Sequence[int], k: int | None = None) -> list[int]:
        """Up to k (default γ) tokens; fewer when the match sits near the end, none without a
        match."""
        k = self.num_speculative_tokens if k is None else k
        check(is_int(k) and k >= 0, f"k={k!r} must be an integer ≥ 0")
        tokens = list(token_ids)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n:]
            # most recent first; the suffix itself excluded
            for start in range(length - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []


class DraftModelProposer:
    """A small model with its own paged KV cache; one draft `Sequence` per target sequence.

    The draft sequences live in the draft's own block pool and are never scheduled: the target's
    step decides when they run. They change only through the scheduler module's functions
    (`extend`, `advance`, `rollback`), as every sequence does."""

    def __init__(self, model, num_blocks: int, block_size: int, attention_backend: str | None):
        self.runner = ModelRunner(model, num_blocks, block_size, attention_backend)
        self.block_allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching=False)
        self.seqs: dict[int, Sequence] = {}  # target seq_id -> draft sequence
        # the last propose's chain: (its Stopwatch, forwards, most new tokens of a row in one)
        self.timing: tuple[Stopwatch | None, int, int] = (None, 0, 0)
        # the last propose's drafts on the device [R, γ]; its placeholders' values
        self.device_drafts: torch.Tensor | None = None
        # target seq_id -> where its draft sequence's placeholders start (filled at _sync)
        self.pending: dict[int, int] = {}

    def propose(self, rows: list[tuple[Sequence, int, SamplingParams, torch.Generator | None]],
                matchers: list | None = None):
        """rows: (target sequence, γ, params, generator) -> per row (draft ids, q [γ, V] or None).
        Each draft step is one batched forward and one batched draw, and the chain stays on the
        device: a draft's token goes into its draft sequence as a PLACEHOLDER, and the next forward
        reads it from the device (`LateTokens`). The drafts are returned as placeholders too, their
        values in `device_drafts` [R, γ] (row i's drafts in row i), for the target's verification
        to read there: the host learns the accepted ones from the verdict (batch_verify.py), and
        the draft sequences take them from the target's tokens at the next `_sync`.
        A row with a grammar's matcher drafts under its mask (q is then the masked law, which is
        what verification needs), walking the matcher along its drafts: that needs each step's
        tokens on the host (one read a step while such a row drafts), and its drafts are returned
        as values. The matcher is rolled back at the end."""
        matchers = matchers or [None] * len(rows)
        walked = [0] * len(rows)  # drafts each matcher consumed
        drafts: list[list[int]] = [[] for _ in rows]  # values, or placeholders
        active = []  # (row index, draft seq)
        for i, (seq, _, _, _) in enumerate(rows):
            d = self._sync(seq)
            if d is not None:
                active.append((i, d))
                self.pending[seq.seq_id] = len(d)  # its placeholders start here
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        gamma = max((r[1] for r in rows), default=0)
        device_drafts = torch.zeros(len(rows), gamma, dtype=torch.long, device=self.runner.device)
        watch = Stopwatch(self.runner.device)
        num_forwards = most_new = 0
        while active:
            num_new = [len(d) - d.num_computed_tokens for _, d in active]
            logits = self.runner.run([d for _, d in active], num_new)  # A, V
            most_new = max(most_new, *num_new)
            for (_, d), n in zip(active, num_new):
                advance(self.block_allocator, d, n)
            logits = mask_rows(logits, [matchers[i] for i, _ in active])  # structured outputs
            tokens = self._draw(logits, [rows[i] for i, _ in active], [qs[i] for i, _ in active])
            where = torch.tensor([i for i, _ in active]).to(tokens.device, non_blocking=True)
            device_drafts[where, num_forwards] = tokens
            num_forwards += 1
            host = None  # the tokens on the host: only a grammar needs them now
            if any(matchers[i] is not None for i, _ in active):
                host = tokens.tolist()
            still = []
            for j, (i, d) in enumerate(active):
                token = PLACEHOLDER if host is None else host[j]
                drafts[i].append(token)
                ok = matchers[i] is None or matchers[i].try_consume_tokens([token]) == 1
                walked[i] += matchers[i] is not None and ok
                wants_more = ok and len(drafts[i]) < rows[i][1]
                if wants_more and extend(self.block_allocator, d, [token])[0]:
                    still.append((i, d))
            index_of = {d.seq_id: (j, len(d) - 1) for j, (_, d) in enumerate(active)}
            self.runner.late_tokens = LateTokens(tokens[:, None], index_of)
            active = still
        watch.stop()
        self.runner.late_tokens = None
        for m, n in zip(matchers, walked):
            if n:
                m.rollback(n)
        self.timing = (watch, num_forwards, most_new)
        self.device_drafts = device_drafts
        return [(drafts[i], torch.stack(qs[i]) if qs[i] else None) for i in range(len(rows))]

    @staticmethod
    def _draw(logits: torch.Tensor, rows: list[tuple],
              qs: list[list[torch.Tensor]]) -> torch.Tensor:
        """One draft token per row of logits [A, V] at its request's settings (greedy: argmax),
        left on the device; the law each sampled token was drawn from goes to its row's list in
        `qs`."""
        tokens = logits.argmax(-1)  # A
        sampled = [j for j, (_, _, params, _) in enumerate(rows) if not params.greedy]
        if sampled:
            q = probs_from_logits_batch(
                logits[sampled],
                *zip(
                    *[(rows[j][2].temperature, rows[j][2].top_k, rows[j][2].top_p) for j in sampled]
                ),
            )  # S, V
            drawn = [torch.multinomial(q[m], 1,
                                       generator=rows[j][3]) for m, j in enumerate(sampled)]
            tokens = tokens.index_put((torch.tensor(sampled, device=logits.device),),
                                      torch.cat(drawn))
            for m, j in enumerate(sampled):
                qs[j].append(q[m])
        return tokens

    def _sync(self, seq: Sequence) -> Sequence | None:
        """Bring the draft sequence to the target's tokens (K/V of all but the last to compute);
        the drafts it kept, placeholders until now, take their values from the target's tokens
        (they are the target's accepted ones)."""
        d = self.seqs.get(seq.seq_id)
        first = self.pending.pop(seq.seq_id, None)
        if d is not None and first is not None:
            fill_in(d, first, seq.token_ids[first:len(d)])
        if d is None:
            d = Sequence(list(seq.token_ids))
            if not self.block_allocator.can_allocate(d):
                return None
            self.block_allocator.allocate(d)
            self.seqs[seq.seq_id] = d
            return d
        missing = seq.token_ids[len(d):]  # the tokens accepted since (rollback left a prefix)
        if extend(self.block_allocator, d, missing)[0] < len(missing):
            self.free(seq)
            return None
        return d

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Keep the draft's first num_valid tokens (those the target accepted)."""
        d = self.seqs.get(seq.seq_id)
        if d is None:
            return
        keep = min(d.num_computed_tokens, num_valid)
        if keep < 1:
            self.free(seq)
            return
        rollback(self.block_allocator, d, keep, keep)

    def free(self, seq: Sequence) -> None:
        self.pending.pop(seq.seq_id, None)
        d = self.seqs.pop(seq.seq_id, None)
        if d is not None:
            self.block_allocator.free(d)


class NgramDraft:
    """Prompt lookup decoding: no second model, q is one-hot."""

    # one lookup gives all γ drafts (spec/controller.py: a step costs v + c, not v + c·γ)
    one_call = True

    def __init__(self, max_n: int, min_n: int):
        self.proposer = NgramProposer(max_n=max_n, min_n=min_n)

    def propose(self, rows, matchers=None):
        """n-gram drafts ignore any grammar: verification rejects the ones outside it."""
        return [(self.proposer.propose(seq.token_ids, gamma), None) for seq, gamma, _, _ in rows]

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        pass
