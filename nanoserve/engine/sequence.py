"""A `Sequence`: one stream of tokens being generated, as the block allocator and the scheduler see
it.

It holds token ids (prompt + generated so far), its block table (which physical KV blocks hold
its keys and values, in order), and how many of its tokens already have KV in the cache.
The scheduler decides how many of the remaining tokens to compute next; the model never
sees a Sequence, only the tensors built from it. Names follow vLLM / nano-vllm.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

_ids = itertools.count()
# a block-table entry whose block was given back: it fell out of every layer's sliding window, or
# an eviction policy dropped it (kv_eviction)
NULL_BLOCK = -1


class SequenceStatus(Enum):
    """Where a sequence is: waiting (queued, or preempted to recompute), running, finished or
    aborted."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Sequence:
    """One stream of tokens: what the scheduler schedules and the block allocator gives blocks to.
    Built by the input processor (or a fork); from then on only the scheduler (and, for the block
    table, the allocator it drives) changes it."""

    token_ids: list[int]
    num_prompt_tokens: int = -1
    seq_id: int = field(default_factory=lambda: next(_ids))
    # leading entries may be NULL_BLOCK (sliding window); any full block's, under kv_eviction
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (cached or computed)
    status: SequenceStatus = SequenceStatus.WAITING
    # scheduling
    request_id: str = ""
    sample_index: int = 0  # which of a request's n samples this is
    priority: int = 0  # lower runs first (vLLM's convention)
    arrival_time: float = 0.0
    # never look up the prefix cache (its prompt logprobs need every position)
    skip_prefix_cache: bool = False
    # the LoRA adapter it runs under (0: the base model); part of its prefix-cache key
    lora_int_id: int = 0
    # KVEvictionConfig (config/kv_eviction.py) of a sequence that evicts K/V; None: keeps all. Its
    # block table may then hold NULL_BLOCK anywhere a full block was evicted, and the model runner
    # hands the attention backends the table without them (the live blocks, in order)
    kv_eviction: object | None = None
    needs_slot: bool = False  # a token was appended whose KV has no slot yet (append_slot pending)
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens: token_ids after the prompt."""
        return self.token_ids[self.num_prompt_tokens:]

    def child(self, sample_index: int) -> Sequence:
        """A new sequence with this one's tokens, request, priority and adapter: sample
        `sample_index` of the request (n > 1 samples fork after the prefill; its blocks are shared
        by `BlockAllocator.fork`)."""
        return Sequence(list(self.token_ids), request_id=self.request_id, sample_index=sample_index,
                        priority=self.priority, arrival_time=self.arrival_time,
                        lora_int_id=self.lora_int_id, kv_eviction=self.kv_eviction)

    def append_token(self, token_id: int) -> None:
        """Add a token (inside nanoserve, only the scheduler calls this; tests and notebooks that
        drive a block allocator by hand play the scheduler)."""
        self.token_ids.append(token_id)

    @property
    def num_evicted_blocks(self) -> int:
        """Blocks an eviction policy dropped: its NULL_BLOCK entries, each a full block (0 for a
        sequence that does not evict; a sliding window's entries are not counted)."""
        if self.kv_eviction is None:
            return 0
        return self.block_table.count(NULL_BLOCK)

    @property
    def sort_key(self) -> tuple:
        """Waiting order: priority, then arrival (FCFS), then creation."""
        return (self.priority, self.arrival_time, self.seq_id)
