"""The paged-KV block allocator: which physical block holds which tokens, who shares it, what stays
cached.

The KV pool (nanoserve/kv/cache.py) is `num_blocks` blocks of `block_size` token slots. This file
decides which blocks each `Sequence` gets; it never touches a tensor. Ideas from PagedAttention
(Kwon et al. 2023) and vLLM's block manager, named as in vLLM / nano-vllm. Taught in notebooks/02_*.

**Ref counts.** A block is *owned* (ref_count > 0: that many block tables list it) or *free*
(ref_count 0). Prefix hits and `fork` (SamplingParams(n>1)) make tables share blocks. **Prefix
caching**: a prompt reuses its longest cached prefix's blocks (block.py: the hash) unless it is
`skip_prefix_cache`.

**Free queue and LRU.** Free blocks wait in `free_block_ids` (nothing cached, FIFO) or `evictable`
(still in the hash table, least recently freed first). New blocks come from the first queue; only
when it is empty is a cached block evicted (its hash dropped). `free` walks a table backwards so a
sequence's tail is evicted before the shared-prefix blocks at its head.

**Protocol.** `can_allocate` → `allocate` (a prompt); per generated token, once the scheduler has
appended it (`Scheduler.postprocess`), `can_append` → `append_slot` (may return a copy-on-write
pair for the KV cache to copy); `mark_computed` after each forward (full blocks whose KV now
exists become cache hits); `fork` for parallel samples; `free` when a sequence ends or is preempted;
`free_out_of_window` after each step of a sliding-window model (leading entries become NULL_BLOCK);
`evict` for a sequence under a KV eviction policy (any full block's entry becomes NULL_BLOCK: the
policy is engine/kv_eviction.py). A sequence that has evicted publishes no more prefix blocks: the
K/V of a block it computes afterwards saw fewer keys than a full-cache sequence's would.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque

from ..config import check_block_size
from ..errors import EngineStateError, NanoserveError
from . import block as _block
from .block import Block, HashFn, PrefixCacheStats, default_block_hash, prefix_root, slots
from .sequence import NULL_BLOCK, Sequence


class BlockAllocator:
    """Ref-counted blocks, a two-queue free list, and a hash table of cached full blocks."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 hash_fn: HashFn | None = None, sliding_window: int | None = None):
        check_block_size(block_size)
        if type(num_blocks) is not int or num_blocks < 1:
            raise NanoserveError(f"num_blocks={num_blocks!r} is not allowed; it must be an integer "
                                 ">= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        # every layer's look-back (ModelConfig.kv_window); None: all
        self.sliding_window = sliding_window
        self.hash_fn: HashFn = hash_fn or default_block_hash
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # ref 0, nothing cached; FIFO
        # ref 0, registered; least recently freed first
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[int, int] = {}
        self.stats = PrefixCacheStats()
        self._prefix_ids = itertools.count()

    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0: never used, freed, or cached but evictable."""
        return len(self.free_block_ids) + len(self.evictable)

    def usage(self) -> float:
        """Fraction of blocks some sequence holds (ref_count > 0)."""
        return 1.0 - self.num_free_blocks() / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ⌈num_tokens / block_size⌉."""
        if num_tokens < 0:
            raise NanoserveError(f"num_tokens={num_tokens} is not allowed; it must be >= 0")
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prompts
    def can_allocate(self, seq: Sequence) -> bool:
        """Exactly whether `allocate(seq)` would succeed now, prefix hits included. Raises like
        `allocate` for a sequence that could never fit, so a scheduler cannot wait on it forever."""
        _, needed, available = self._plan(seq)
        return needed <= available

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` a block table for all its tokens, reusing cached prefix blocks.

        At most (len - 1) // block_size blocks are hits, so the block holding the last token is
        always computed (a zero-length query is not allowed downstream). Sets num_cached_tokens =
        num_computed_tokens = hits * block_size. New blocks enter the prefix cache only once their
        KV exists (`mark_computed`), so a hit can never read a block another sequence has yet to
        write — not with chunked prefill, and not after an abort or preemption mid-prefill."""
        if seq.block_table:
            raise EngineStateError(f"sequence {seq.seq_id} already has blocks {seq.block_table}; "
                                   "free it first")
        hits, needed, available = self._plan(seq)
        if needed > available:
            raise NanoserveError(
                f"cannot allocate sequence {seq.seq_id}: its {len(seq)} tokens need {needed} new "
                f"blocks ({len(hits)} more are prefix-cache hits) but only {available} of "
                f"{self.num_blocks} are free or evictable; call can_allocate() first and wait for "
                "blocks to be freed")
        for bid in hits:
            self._share(bid)
        seq.block_table = hits + [self._take_free_block() for _ in range(needed)]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.stats.hits += len(hits)
        self.stats.misses += needed

    # ------------------------------------------------------------------ decoding
    def can_append(self, seq: Sequence) -> bool:
        """Whether `append_slot(seq)` will find the block it may need, asked once the token is in:
        a block is needed when the new token starts one or lands in a shared last block
        (copy-on-write)."""
        table = self._require_allocated(seq)
        last_block_full = len(table) * self.block_size < len(seq)
        needs_block = last_block_full or self.blocks[table[-1]].ref_count > 1
        return self.num_free_blocks() >= int(needs_block)

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make room for the token just appended (position len(seq) - 1), before its KV is written.

        A token that starts a new block gets a fresh block. A token landing in a last block that
        other tables share triggers copy-on-write: this sequence moves to a fresh block and `(src,
        dst)` is returned so the KV cache copies the slots already written; otherwise None.
        Idempotent."""
        table = self._require_allocated(seq)
        n, bs = len(seq), self.block_size
        if len(table) * bs == n - 1:
            table.append(self._take_free_block())
            return None
        if len(table) == self.blocks_needed(n):
            return self._copy_on_write(table)
        raise EngineStateError("append_slot makes room for one new token at a time: sequence "
                               f"{seq.seq_id} has {n} tokens but its block table covers "
                               f"{len(table) * bs}")

    def mark_computed(self, seq: Sequence) -> None:
        """Register `seq`'s full blocks whose KV is now written (its first num_computed_tokens) in
        the prefix cache, keeping an existing registration of the same hash. After every forward."""
        if not self.enable_prefix_caching or seq.num_evicted_blocks:
            return  # (after an eviction, later blocks' K/V differ from a full cache's)
        table, n = seq.block_table, min(seq.num_computed_tokens, len(seq)) // self.block_size
        # sealed (or given-back) blocks form a leading run: walk back to its end, not from block 0
        first = n
        while first > 0 and table[first - 1] != NULL_BLOCK:
            if self.blocks[table[first - 1]].hash is not None:
                break
            first -= 1
        for i in range(first, n):
            self._seal(seq, i)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (same tokens as `parent`) shares every parent block; copy-on-write splits them
        later."""
        self._require_allocated(parent)
        if child.block_table or child.token_ids != parent.token_ids:
            raise EngineStateError("fork needs a child with no blocks and the parent's tokens; "
                                   f"sequence {child.seq_id} has {len(child.block_table)} blocks "
                                   f"and {len(child)} tokens")
        for bid in (b for b in parent.block_table if b != NULL_BLOCK):
            self._share(bid)
        child.block_table = list(parent.block_table)
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_computed_tokens = parent.num_computed_tokens

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks the first `num_tokens` tokens need; free the rest, last first.
        Speculation's rollback (the scheduler's `rollback` shortens `seq` first): rejected tokens'
        slots in a kept block are overwritten later; a dropped block is never a registered prefix
        block (only full computed ones are)."""
        table = self._require_allocated(seq)
        keep = self.blocks_needed(num_tokens)
        if keep < 1 or num_tokens < seq.num_computed_tokens:
            raise EngineStateError(f"truncate({num_tokens}) would drop computed tokens or every "
                                   f"block of sequence {seq.seq_id} ({seq.num_computed_tokens} "
                                   "computed); free() it instead")
        for bid in reversed(table[keep:]):
            self._unref(bid)
        del table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, last first (LRU evicts tails before shared heads). A block whose
        count drops to 0 stays cached (evictable) if registered. Freeing twice is a no-op."""
        for bid in reversed(seq.block_table):
            if bid == NULL_BLOCK:
                continue  # given back already: by a sliding window, or evicted
            if self.blocks[bid].ref_count <= 0:
                raise EngineStateError(f"block {bid} of sequence {seq.seq_id} is already free "
                                       "(double free?)")
            self._unref(bid)
        seq.block_table = []
        seq.num_cached_tokens = seq.num_computed_tokens = 0

    def free_out_of_window(self, seq: Sequence) -> int:
        """Sliding window w in every layer: give back the blocks no query sees again (entry ->
        NULL_BLOCK); how many. Queries come at positions ≥ num_computed_tokens and see keys > p − w.
        Call it once the step's tokens are final (Scheduler.postprocess: after speculation's
        rollback moved them back)."""
        if self.sliding_window is None:
            return 0
        table = seq.block_table
        oldest_seen = seq.num_computed_tokens - self.sliding_window + 1  # the first key still seen
        i = oldest_seen // self.block_size - 1  # the newest block wholly before it
        freed = 0
        # newest dead block first, back to the last one freed
        while i >= 0 and table[i] != NULL_BLOCK:
            self._unref(table[i])
            table[i] = NULL_BLOCK
            freed += 1
            i -= 1
        return freed

    def evict(self, seq: Sequence, indices: list[int]) -> int:
        """Give back the full, computed blocks at `indices` of seq's table (entry -> NULL_BLOCK), as
        an eviction policy chose them; how many were still held. Refuses the block being filled and
        any block not yet computed: its K/V would be missing, not dropped."""
        table = self._require_allocated(seq)
        full = min(seq.num_computed_tokens, len(seq)) // self.block_size
        freed = 0
        for i in sorted(indices, reverse=True):  # newest first, as `free` gives blocks back
            if not 0 <= i < full:
                raise EngineStateError(f"cannot evict block {i} of sequence {seq.seq_id}: only "
                                       f"its {full} full, computed blocks (0..{full - 1}) may go")
            if table[i] != NULL_BLOCK:
                self._unref(table[i])
                table[i] = NULL_BLOCK
                freed += 1
        return freed

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Physical slot `block_id * block_size + offset` of tokens start .. end-1."""
        covered = min(len(seq), len(seq.block_table) * self.block_size)
        if not 0 <= start <= end <= covered:
            raise IndexError(f"token range [{start}, {end}) is outside sequence {seq.seq_id}'s "
                             f"{covered} tokens with blocks; allowed: 0 <= start <= end <= "
                             f"{covered}")
        return slots(seq.block_table, start, end, self.block_size)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only when no block is in use (as vLLM); returns whether it
        did."""
        if self.num_free_blocks() != self.num_blocks:
            return False
        for bid in self.evictable:
            self.blocks[bid].clear()
        self.free_block_ids.extend(self.evictable)
        self.evictable.clear()
        self.hash_to_block.clear()
        return True

    # raise AssertionError if the bookkeeping is inconsistent (block.py)
    check_invariants = _block.check_invariants

    # ------------------------------------------------------------------ internals
    def _check_fits(self, seq: Sequence) -> None:
        n, capacity = len(seq), self.num_blocks * self.block_size
        if not 1 <= n <= capacity:
            raise NanoserveError(
                f"sequence {seq.seq_id} has {n} tokens, needing {self.blocks_needed(n)} blocks of "
                f"{self.block_size}, but the KV pool has {self.num_blocks} blocks in total; "
                f"allowed: 1 to {capacity} tokens")

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _matches(self, block: Block, tokens: tuple[int, ...], parent: Block | None,
                 root: int | None = None) -> bool:
        """The exact check behind every hit: same tokens, same prefix before them (for block 0: same
        root)."""
        parent_id = parent.prefix_id if parent else root
        return block.token_ids == tokens and block.parent_prefix_id == parent_id

    def _max_prefix_hits(self, num_tokens: int) -> int:
        """Full blocks before the one holding the last token: that token must be computed."""
        return (num_tokens - 1) // self.block_size

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks for the prompt's leading full blocks, stopping at the first miss."""
        hits, parent, root = [], None, prefix_root(seq)
        lookup = self.enable_prefix_caching and not seq.skip_prefix_cache
        for i in range(self._max_prefix_hits(len(seq)) if lookup else 0):
            tokens = self._block_tokens(seq, i)
            bid = self.hash_to_block.get(self.hash_fn(parent.hash if parent else root, tokens))
            if bid is None or not self._matches(self.blocks[bid], tokens, parent, root):
                break
            hits.append(bid)
            parent = self.blocks[bid]
        return hits

    def _plan(self, seq: Sequence) -> tuple[list[int], int, int]:
        """(prefix hits, fresh blocks needed, blocks available for them): an evictable hit is not
        available."""
        self._check_fits(seq)
        hits = self._prefix_hits(seq)
        idle_hits = sum(self.blocks[bid].ref_count == 0 for bid in hits)
        return hits, self.blocks_needed(len(seq)) - len(hits), self.num_free_blocks() - idle_hits

    def _seal(self, seq: Sequence, i: int) -> None:
        """Hash full block i and register it, unless registered, or its parent is unhashed (a
        window's: not cached)."""
        block = self.blocks[seq.block_table[i]]
        parent = None  # block i − 1, when there is one and it is still held
        if i > 0 and seq.block_table[i - 1] != NULL_BLOCK:
            parent = self.blocks[seq.block_table[i - 1]]
        parent_unhashed = i > 0 and (parent is None or parent.hash is None)
        if not self.enable_prefix_caching or block.hash is not None or parent_unhashed:
            return
        tokens, root = self._block_tokens(seq, i), prefix_root(seq)
        h = self.hash_fn(parent.hash if parent else root, tokens)
        owner = self.blocks[self.hash_to_block.setdefault(h, block.block_id)]
        twin = owner is not block and self._matches(owner, tokens, parent, root)
        block.hash, block.token_ids = h, tokens
        block.parent_prefix_id = parent.prefix_id if parent else root
        block.prefix_id = owner.prefix_id if twin else next(self._prefix_ids)

    def _take_free_block(self) -> int:
        """An uncached free block if any, else evict the least recently freed cached one."""
        if self.free_block_ids:
            bid = self.free_block_ids.popleft()
        elif self.evictable:
            bid, _ = self.evictable.popitem(last=False)
            del self.hash_to_block[self.blocks[bid].hash]
            self.blocks[bid].clear()
        else:
            raise EngineStateError(f"all {self.num_blocks} KV blocks are in use; check "
                                   "can_allocate/can_append first")
        self.blocks[bid].ref_count = 1
        return bid

    def _share(self, bid: int) -> None:
        if self.blocks[bid].ref_count == 0:
            del self.evictable[bid]
        self.blocks[bid].ref_count += 1

    def _unref(self, bid: int) -> None:
        """One table fewer lists block `bid`; at 0 it is free (`_release`)."""
        self.blocks[bid].ref_count -= 1
        if self.blocks[bid].ref_count == 0:
            self._release(self.blocks[bid])

    def _release(self, block: Block) -> None:
        """ref_count just reached 0: keep it cached if it is (or can become) the registered
        block."""
        registered = None
        if block.hash is not None:
            registered = self.hash_to_block.setdefault(block.hash, block.block_id)
        if registered == block.block_id:
            self.evictable[block.block_id] = None  # most recently freed at the end
        else:
            block.clear()
            self.free_block_ids.append(block.block_id)

    def _copy_on_write(self, table: list[int]) -> tuple[int, int] | None:
        src = table[-1]
        if self.blocks[src].ref_count <= 1:
            return None
        dst = self._take_free_block()
        self.blocks[src].ref_count -= 1  # still >= 1: the other tables keep it
        table[-1] = dst
        return src, dst

    def _require_allocated(self, seq: Sequence) -> list[int]:
        if not seq.block_table:
            raise EngineStateError(f"sequence {seq.seq_id} has no blocks; allocate (or fork) it "
                                   "first")
        return seq.block_table

