"""Exercise 6: one step of the continuous scheduler (nanoserve/engine/scheduler.py:
Scheduler.schedule and helpers).

Your versions of parts of nanoserve/engine/scheduler.py, with the same names and signatures.
`Scheduler` below inherits nanoserve's and overrides only the methods you write; the rest is given
and yours to call: the queues (`self.waiting`, sorted by `Sequence.sort_key`; `self.running`, in
admission order), `_enqueue(seq)` (into the waiting queue at its sorted place), `_make_room(seq,
index, out)` (the preemption loop: give a decoding sequence's new token a slot, calling your
`_pick_victim` and `_preempt` while the pool is full), `self.config` and the block allocator
`self.block_allocator`. Taught in notebooks/03_batching.ipynb (sections 2 and 4). Check your work
with

    make exercises EX=ex06        # or: .venv/bin/pytest tests/exercises -m ex06 --impl exercises

Do 6.1-6.3 first: each has its own tests; `schedule` (6.4) uses all three.
"""

from __future__ import annotations

import nanoserve.engine.scheduler
from nanoserve.engine.scheduler import SchedulerOutput  # noqa: F401  (schedule returns one)
from nanoserve.engine.sequence import Sequence, SequenceStatus  # noqa: F401


class Scheduler(nanoserve.engine.scheduler.Scheduler):
    """nanoserve's scheduler with the policy left for you to write."""

    def schedule(self) -> SchedulerOutput:
        """One step: which sequences run in the next forward and how many tokens each computes.

        1. Running sequences first, in admission order, while the token budget
           (`config.max_num_batched_tokens`) lasts. One with `needs_slot` first gets a KV slot for
           its new token through `_make_room(seq, i, out)`; if that preempted `seq` itself, the next
           sequence has moved up to index i. Each then computes `_tokens_to_compute(seq, budget)`
           tokens (a sequence given 0 is left out of this step).
        2. A step that preempted anyone admits nobody: return.
        3. Then waiting sequences from the front of the queue, while budget is left, fewer than
           `config.max_num_seqs` are running, and `bm.can_allocate(seq)`; with chunked prefill off,
           a prompt longer than the budget left waits too. An admitted sequence is allocated, leaves
           `waiting`, becomes RUNNING, joins `running` and computes `_tokens_to_compute` tokens
           now."""
        raise NotImplementedError(
            "Exercise 6.4: two passes under one token budget: the running sequences first, in "
            "admission order, then, unless someone was preempted, admissions from the waiting "
            "queue while the budget, the sequence cap and the pool allow (roughly 28 lines; see "
            "notebooks/03_batching, sections 2 and 4, 'The scheduler step' and 'Preemption: when "
            "the pool runs dry'; more: make hint EX=ex06 N=2)")

    def _tokens_to_compute(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` computes this step: the ones without KV (len(seq) - num_computed_tokens), at
        most `budget` with chunked prefill (the rest next step); without it, all of them or, if they
        do not fit in the budget, none."""
        raise NotImplementedError(
            "Exercise 6.1: every token without K and V yet; chunked prefill takes what the budget "
            "has left, otherwise all or nothing (roughly 4 lines; see notebooks/03_batching, "
            "section 2, 'The scheduler step', chunked prefill; more: make hint EX=ex06 N=2)")

    def _pick_victim(self, index: int) -> Sequence:
        """The lowest-priority, most recently admitted sequence not yet scheduled in this step."""
        raise NotImplementedError(
            "Exercise 6.2: of the sequences not yet scheduled in this step, the one that matters "
            "least: the lowest priority, then the most recently admitted (roughly 2 lines; see "
            "notebooks/03_batching, section 4, 'Preemption: when the pool runs dry'; more: make "
            "hint EX=ex06 N=2)")

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: free every block; the tokens stay, the KV will be
        recomputed."""
        raise NotImplementedError(
            "Exercise 6.3: the sequence keeps its tokens and loses its K and V, and waits again to "
            "be prefilled from the start (roughly 6 lines; see notebooks/03_batching, section 4, "
            "'Preemption: when the pool runs dry'; more: make hint EX=ex06 N=2)")
