"""Exercises 4 and 5: the paged-KV block allocator, and prefix-cache hashing and lookup.

Your versions of parts of nanoserve/engine/block_allocator.py, with the same names and signatures.
`BlockAllocator` below inherits nanoserve's and overrides only the methods you write; everything
else is given and yours to call: the free queues (`free_block_ids`, `evictable`), `_plan(seq)`
(prefix hits, fresh blocks needed, blocks available), `_take_free_block()`, `_share(bid)`,
`_release(block)`, `_copy_on_write(table)`, `_require_allocated(seq)`, `blocks_needed(n)`, and the
prefix-cache internals (`mark_computed`, `_seal`, `_block_tokens`, `_matches`, `_max_prefix_hits`).
Taught in notebooks/02_paged_kv_cache.ipynb (sections 2, 4 and 5). Check your work with

    make exercises EX=ex04        # or: .venv/bin/pytest tests/exercises -m ex04 --impl exercises
    make exercises EX=ex05

The two exercises can be done in either order: exercise 4's tests use nanoserve's `_prefix_hits`,
exercise 5's use nanoserve's allocate / append_slot / free / fork. The inherited constructor's
default `hash_fn` is nanoserve's `default_block_hash`; pass `hash_fn=default_block_hash` to use
yours.
"""

from __future__ import annotations

import nanoserve.engine.block_allocator
from nanoserve.engine.sequence import Sequence
from nanoserve.errors import NanoserveError  # noqa: F401  (allocate raises it when the pool is too full)


# ----------------------------------------------------------------------------- exercise 5.1
def default_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of one full block: an int that depends on the block's tokens (in order)
    and on the hash of the block before it (`parent_hash`; None for a sequence's first block), so
    equal hashes mean equal tokens *and* equal prefix, up to collisions. Deterministic: the same
    arguments give the same int."""
    raise NotImplementedError(
        "Exercise 5.1: a block's K and V depend on its tokens and on every token before them, so "
        "its hash chains the parent's hash with its own tokens (roughly 1 line; see "
        "notebooks/02_paged_kv_cache, section 4, 'Prefix caching', why a chained hash; more: "
        "make hint EX=ex05 N=2)")


class BlockAllocator(nanoserve.engine.block_allocator.BlockAllocator):
    """nanoserve's allocator with the methods of exercises 4 and 5 left for you to write."""

    # ------------------------------------------------------------------------- exercise 4
    def allocate(self, seq: Sequence) -> None:
        """Give `seq` a block table for all its tokens, reusing cached prefix blocks.

        The table is the prefix hits followed by fresh blocks, taken in free-queue order. Every hit
        gains a reference (it may be sitting in the evictable queue). Sets num_cached_tokens =
        num_computed_tokens = hits * block_size and counts hits and misses (fresh blocks) in
        `self.stats`. Raises RuntimeError if `seq` already has blocks, and NanoserveError (changing
        nothing) if the fresh blocks needed exceed the blocks available."""
        raise NotImplementedError(
            "Exercise 4.1: the table is the cached prefix blocks, shared, then fresh blocks for "
            "the rest; check that it all fits before changing any state (roughly 12 lines; see "
            "notebooks/02_paged_kv_cache, sections 2 and 4, 'The block allocator, step by step' "
            "and 'Prefix caching'; more: make hint EX=ex04 N=2)")

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make room for the token just appended (position len(seq) - 1), before its KV is written.

        A token that starts a new block gets a fresh block. A token landing in a last block that
        other tables share triggers copy-on-write: this sequence moves to a fresh block and
        `(src, dst)` is returned so the KV cache copies the slots already written; otherwise None.
        Calling it again for the same length changes nothing."""
        raise NotImplementedError(
            "Exercise 4.2: a token that starts a block needs a fresh one; a token that lands in a "
            "block another sequence also holds needs a private copy first (roughly 10 lines; see "
            "notebooks/02_paged_kv_cache, sections 2 and 5, 'The block allocator, step by step' "
            "and 'Parallel samples: fork and copy-on-write'; more: make hint EX=ex04 N=2)")

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, last block first (so LRU evicts tails before shared heads). A
        block whose count drops to 0 stays cached (evictable) if registered. Freeing twice is a
        no-op."""
        raise NotImplementedError(
            "Exercise 4.3: drop this sequence's reference to each of its blocks, the tail first; a "
            "block nobody holds goes back to the pool (roughly 10 lines; see "
            "notebooks/02_paged_kv_cache, sections 2 and 4, 'The block allocator, step by step' "
            "and 'The free queue doubles as an LRU cache'; more: make hint EX=ex04 N=2)")

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (same tokens as `parent`) shares every parent block; copy-on-write splits them
        later."""
        raise NotImplementedError(
            "Exercise 4.4: the child shares every block of its parent; nothing is copied until one "
            "of them writes (roughly 8 lines; see notebooks/02_paged_kv_cache, section 5, "
            "'Parallel samples: fork and copy-on-write'; more: make hint EX=ex04 N=2)")

    # ------------------------------------------------------------------------- exercise 5.2
    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks for the prompt's leading full blocks, stopping at the first miss."""
        raise NotImplementedError(
            "Exercise 5.2: reuse the prompt's leading full blocks the cache holds, stopping at the "
            "first miss, never the block holding the last token, and never on a hash alone "
            "(roughly 10 lines; see notebooks/02_paged_kv_cache, section 4, 'Prefix caching', hits "
            "are checked, not trusted; more: make hint EX=ex05 N=2)")
