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
block copies the model runner must apply.

**It owns every sequence's state.** Besides `schedule()`, the only writes to a `Sequence` after
it is built are the methods below the line "after the forward" (`advance`, `postprocess`,
`fill_in`, `fork`, `finish`, and speculation's `extend` / `rollback`), and the block allocator's
own writes to block tables — which the scheduler drives. The model runner only reads sequences; the
engine, speculation and the batchers call these methods (tests/test_ownership.py checks it).
Taught in notebooks/03_*.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ..config import SchedulerConfig
from ..errors import EngineStateError, NanoserveError
from .block_allocator import BlockAllocator
from .sequence import Sequence, SequenceStatus


class QueueFullError(NanoserveError):
    """The waiting queue is at `max_waiting`: the caller should retry later (HTTP 429)."""


@dataclass
class SchedulerOutput:
    """One step's decision: which sequences run, how many tokens each computes, what to copy."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        """Schedule `n` new tokens of `seq`."""
        self.seqs.append(seq)
        self.num_new.append(n)

    @property
    def num_tokens(self) -> int:
        """New tokens in the step (what the token budget counts)."""
        return sum(self.num_new)


def _sort_key(seq: Sequence) -> tuple:
    return seq.sort_key


class Scheduler:
    """Continuous batching's scheduler (Orca, vLLM): `schedule()` picks the next forward's sequences
    and token counts; the methods after it apply the forward's results to the sequences."""

    def __init__(self, config: SchedulerConfig, block_allocator: BlockAllocator, max_model_len: int,
                 max_loras: int | None = None):
        config.validate(max_model_len)
        self.config = config
        self.block_allocator = block_allocator
        self.max_loras = max_loras  # distinct LoRA adapters among the running sequences; None: any
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        # called with each sequence that leaves for good (speculation drops its state)
        self.on_finish: list = []
        # called with each sequence preempted (speculation drops its draft cache)
        self.on_preempt: list = []
        # seq_id -> block indices a KV eviction policy chose during this step's forward
        # (engine/kv_eviction.py); given back once the step's tokens are computed (`advance`)
        self.pending_evictions: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ queue management
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (QueueFullError at max_waiting)."""
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({len(self.waiting)} requests, "
                                 f"max_waiting={self.config.max_waiting}); retry later")
        self._enqueue(seq)


    def has_unfinished(self) -> bool:
        """Whether any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def _enqueue(self, seq: Sequence) -> None:
        """Insert in sort_key order: a binary search (O(log n) comparisons), then one list insert,
        which lands at the end for a new request of the usual priority (arrival times only grow)."""
        seq.status = SequenceStatus.WAITING
        bisect.insort_right(self.waiting, seq, key=_sort_key)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """The next forward: running sequences first (a new token's slot, preempting if the pool is
        full), then waiting ones while the token budget, max_num_seqs and the pool allow."""
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
        adapters = set()  # the LoRA adapters running sequences hold slots for
        if self.max_loras:
            adapters = {s.lora_int_id for s in self.running} - {0}
        j = 0
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[j]
            if seq.lora_int_id not in adapters | {0} and len(adapters) == self.max_loras:
                # its adapter needs a slot that running sequences hold: later; the next may go now
                j += 1
                continue
            if not self.config.enable_chunked_prefill and len(seq) > budget:
                break  # its whole prompt must fit in one step; wait for a step with more room
            if not self.block_allocator.can_allocate(seq):
                break
            self.block_allocator.allocate(seq)
            self.waiting.pop(j)
            adapters |= {seq.lora_int_id} - {0}
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
        while not self.block_allocator.can_append(seq):
            victim = self._pick_victim(index)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        copy = self.block_allocator.append_slot(seq)
        seq.needs_slot = False
        if copy is not None:
            out.copies.append(copy)
        return True

    def _pick_victim(self, index: int) -> Sequence:
        """The lowest-priority, most recently admitted sequence not yet scheduled in this step."""
        candidates = self.running[index:]
        return max(candidates, key=lambda s: (s.priority, self.running.index(s)))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: free every block; the tokens stay, the KV will be
        recomputed."""
        self.running.remove(seq)
        self.block_allocator.free(seq)
        self.pending_evictions.pop(seq.seq_id, None)
        seq.needs_slot = False
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)
        for callback in self.on_preempt:
            callback(seq)


    # ------------------------------------------------------------------ after the forward
    def advance(self, seq: Sequence, num_tokens: int) -> None:
        """`num_tokens` more of seq's tokens have K/V now (the forward computed them); then the
        blocks an eviction policy chose for it this step go back to the pool."""
        advance(self.block_allocator, seq, num_tokens)
        indices = self.pending_evictions.pop(seq.seq_id, None)
        if indices:
            self.block_allocator.evict(seq, indices)

    def plan_eviction(self, seq: Sequence, indices: list[int]) -> None:
        """A KV eviction policy (engine/kv_eviction.py) chose seq's blocks at `indices`, during the
        forward: they are evicted at this step's `advance`, after the prefix cache saw the step."""
        self.pending_evictions[seq.seq_id] = list(indices)

    def postprocess(self, seq: Sequence, new_tokens: list[int], finished: bool) -> None:
        """Append the tokens sampled for `seq` (or emitted by a speculative step: its accepted
        drafts, whose K/V exist, then blocks they fill join the prefix cache); a finished sequence
        leaves the batch and frees its blocks, else its last token waits for a slot (the next
        schedule)."""
        seq.token_ids.extend(new_tokens)
        self.block_allocator.mark_computed(seq)
        if finished:
            self.finish(seq)
        else:
            # a sliding-window model: blocks no query sees again
            self.block_allocator.free_out_of_window(seq)
            seq.needs_slot = True

    def fill_in(self, seq: Sequence, position: int, token: int) -> None:
        """Async scheduling (engine/async_step.py): the token sampled for position `position`,
        which `postprocess` held with a placeholder while it was still on the device, is known.
        Its K/V may already exist (the next step computed it from the device's copy), so it must
        be in place before the prefix cache seals that block (the next `advance`)."""
        fill_in(seq, position, [token])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A parallel sample (SamplingParams.n): `child` shares parent's blocks and joins the
        batch."""
        self.block_allocator.fork(parent, child)
        self.add_running(child)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks (a fork) joins the running batch directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED) -> None:
        """Remove a sequence wherever it is and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_allocator.free(seq)
        self.pending_evictions.pop(seq.seq_id, None)
        seq.status = status
        for callback in self.on_finish:
            callback(seq)

    # speculation: drafts join a sequence for one verification forward, the rejected ones leave
    def extend(self, seq: Sequence, tokens: list[int]) -> tuple[int, list[tuple[int, int]]]:
        """Append draft tokens, each with a KV slot; see `extend`."""
        return extend(self.block_allocator, seq, tokens)

    def rollback(self, seq: Sequence, num_tokens: int, num_computed: int) -> None:
        """Keep seq's first `num_tokens` tokens, with K/V valid for the first `num_computed`
        positions."""
        rollback(self.block_allocator, seq, num_tokens, num_computed)


# The mechanics shared with the draft model's shadow sequences (spec/proposers.py), which live in
# their own block pool and are never scheduled: the same writes, so in this file too.
def advance(block_allocator: BlockAllocator, seq: Sequence, num_tokens: int) -> None:
    """num_computed_tokens += num_tokens, and full blocks whose K/V now exist join the prefix
    cache."""
    seq.num_computed_tokens += num_tokens
    block_allocator.mark_computed(seq)


def extend(block_allocator: BlockAllocator, seq: Sequence,
           tokens: list[int]) -> tuple[int, list[tuple[int, int]]]:
    """Append `tokens`, each with a KV slot, stopping early when the pool is full. Returns how many
    were appended and the copy-on-write (src, dst) block copies the KV cache must apply."""
    copies = []
    for i, token in enumerate(tokens):
        seq.token_ids.append(token)
        if not block_allocator.can_append(seq):
            seq.token_ids.pop()
            return i, copies
        copy = block_allocator.append_slot(seq)
        if copy is not None:
            copies.append(copy)
    return len(tokens), copies


def fill_in(seq: Sequence, position: int, tokens: list[int]) -> None:
    """Tokens held as placeholders while their ids were on the device (async scheduling, a draft
    model's chain) put in place, from `position` on."""
    seq.token_ids[position:position + len(tokens)] = tokens


def rollback(block_allocator: BlockAllocator, seq: Sequence, num_tokens: int,
             num_computed: int) -> None:
    """Speculation's rollback: keep the first `num_tokens` tokens; K/V is valid for the first
    `num_computed` positions (the verified prefix; it may run past num_tokens when the caller
    re-appends the accepted tokens right after, through `postprocess`). Blocks past num_computed go
    back to the pool before the prefix cache sees them, so no block holding a rejected token's K/V
    is ever cached."""
    del seq.token_ids[num_tokens:]
    seq.num_computed_tokens = num_computed
    block_allocator.truncate(seq, num_computed)


def ride_along(seq: Sequence) -> None:
    """Static batching (tools/batching.py) keeps a finished row in its batch until the batch ends:
    each step recomputes the row's last computed position — the work HF generate spends on
    padding rows. Nothing new is computed for it."""
    seq.num_computed_tokens = len(seq) - 2

def _check_has_work(seq: Sequence) -> None:
    """A running sequence always has a token to compute: its prompt's rest, or the token sampled
    last step (its needs_slot was set). One with none would never be scheduled again and the
    engine would spin forever; that is broken bookkeeping, so stop loudly instead."""
    if seq.num_computed_tokens >= len(seq):
        raise EngineStateError(
            f"sequence {seq.seq_id} of request {seq.request_id!r} is running with all {len(seq)} "
            f"of its tokens computed (num_computed_tokens={seq.num_computed_tokens}) and no new "
            "token: no step would ever schedule it again (a token was sampled without setting "
            "needs_slot?)")
