"""The continuous (iteration-level) scheduler: which sequences run in the next forward, and how
many tokens each computes.

Orca (Yu et al. 2022) schedules per iteration instead of per batch: a finished sequence leaves
and a waiting one joins at the very next step, so the batch never idles on its slowest member.
Each `schedule()` call here, in vLLM's manner:

1. **Running sequences first**, oldest first. A decoding sequence computes 1 token, one still in
   prefill computes the rest of its prompt — or, with chunked prefill, as much as the step's
   token budget (`max_num_batched_tokens`) allows, so a long prompt is split across steps and
   shares them with decodes (Agrawal et al. 2023, Sarathi). A decoding sequence first needs a
   slot for its new token; when the pool has no free block, the most recently admitted running
   sequence (lowest priority first) is **preempted**: its blocks are freed and it goes back to
   the waiting queue, to be recomputed later (prompt + what it had generated) — never lost.
2. **Then waiting sequences** in (priority, arrival) order, while the budget, `max_num_seqs` and
   the block pool allow — but not in a step that had to preempt (the pool is under pressure).

The scheduler never touches tensors: it returns sequences, token counts and the copy-on-write
block copies the model runner must apply. Taught in notebooks/03_*.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ..errors import EngineStateError, NanoserveError
from .block_allocator import BlockAllocator
from .sequence import Sequence, SequenceStatus


class QueueFullError(NanoserveError):
    """The waiting queue is at `max_waiting`: the caller should retry later (HTTP 429)."""


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one forward
    max_num_batched_tokens: int = 512  # new tokens in one forward (the token budget)
    enable_chunked_prefill: bool = True
    max_waiting: int | None = None  # None = unbounded

    def validate(self, max_model_len: int) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise NanoserveError(f"{name}={v!r} must be an integer ≥ 1")
        if self.max_waiting is not None and (not isinstance(self.max_waiting, int) or self.max_waiting < 1):
            raise NanoserveError(f"max_waiting={self.max_waiting!r} must be an integer ≥ 1 or None")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise NanoserveError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be ≥ the context length "
                f"{max_model_len} when chunked prefill is off (a whole prompt must fit in one step)")


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new.append(n)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockAllocator, max_model_len: int):
        config.validate(max_model_len)
        self.config, self.bm = config, block_manager
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue management
    def add(self, seq: Sequence) -> None:
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({len(self.waiting)} requests, "
                                 f"max_waiting={self.config.max_waiting}); retry later")
        self._enqueue(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample: it already shares its parent's blocks and joins the batch directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED) -> None:
        """Remove a sequence wherever it is and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = status

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        keys = [s.sort_key for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.sort_key), seq)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.needs_slot and not self._make_room(seq, i, out):
                continue  # seq itself was preempted; running[i] is now the next one
            _check_has_work(seq)
            n = self._tokens_to_compute(seq, budget)
            if n:
                out.add(seq, n)
                budget -= n
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.config.enable_chunked_prefill and len(seq) > budget:
                break  # its whole prompt must fit in one step; wait for a step with more room
            if not self.bm.can_allocate(seq):
                break
            self.bm.allocate(seq)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = self._tokens_to_compute(seq, budget)
            out.add(seq, n)
            budget -= n
        return out

    def _tokens_to_compute(self, seq: Sequence, budget: int) -> int:
        need = len(seq) - seq.num_computed_tokens
        if self.config.enable_chunked_prefill:
            return min(need, budget)
        return need if need <= budget else 0

    def _make_room(self, seq: Sequence, index: int, out: SchedulerOutput) -> bool:
        """Give `seq`'s newest token a KV slot, preempting others if the pool is full.
        Returns False when `seq` itself had to be preempted."""
        while not self.bm.can_append(seq):
            victim = self._pick_victim(index)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        copy = self.bm.append_slot(seq)
        seq.needs_slot = False
        if copy is not None:
            out.copies.append(copy)
        return True

    def _pick_victim(self, index: int) -> Sequence:
        """The lowest-priority, most recently admitted sequence not yet scheduled in this step."""
        candidates = self.running[index:]
        return max(candidates, key=lambda s: (s.priority, self.running.index(s)))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: free every block; the tokens stay, the KV will be recomputed."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.needs_slot = False
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)


def _check_has_work(seq: Sequence) -> None:
    """A running sequence always has a token to compute: its prompt's rest, or the token sampled
    last step (its needs_slot was set). One with none would never be scheduled again and the
    engine would spin forever; that is broken bookkeeping, so stop loudly instead."""
    if seq.num_computed_tokens >= len(seq):
        raise EngineStateError(
            f"sequence {seq.seq_id} of request {seq.request_id!r} is running with all {len(seq)} of its tokens "
            f"computed (num_computed_tokens={seq.num_computed_tokens}) and no new token: no step would ever "
            "schedule it again (a token was sampled without setting needs_slot?)")
