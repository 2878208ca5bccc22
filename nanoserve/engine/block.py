"""One physical KV block as the block allocator sees it, and the hash that names a full block.

**Prefix caching.** A full block is identified by a chained hash: block i's hash is
`hash_fn(hash of block i-1, tokens of block i)`, so equal hashes mean equal tokens *and* an equal
prefix — unless the hash collides. Two exact checks make collisions harmless before a hit is
used: the cached block's tokens must equal the prompt's, and its parent's `prefix_id` must equal
the prefix_id of the block matched just before. A `prefix_id` names one exact token prefix (two
blocks share one only when their tokens and their parents' prefix_ids are equal), so a hit's KV is
always the KV of exactly this prefix, whatever `hash_fn` returns (the tests use a constant one).
Under a LoRA adapter the same tokens have other KV: block 0 of such a sequence hangs from a *root*
of its adapter's (`prefix_root`) instead of None, in its hash and in the exact check alike.
Taught in notebooks/02_*.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

HashFn = Callable[[int | None, tuple[int, ...]], int]


def default_block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Python's tuple hash: fast, and for ints deterministic across processes (PYTHONHASHSEED only
    salts str/bytes). The first block hashes a 1-tuple rather than `(None, ...)` because
    `hash(None)` varies between processes before Python 3.12. Collisions cost hits, never
    correctness."""
    return hash((token_ids,) if parent_hash is None else (parent_hash, token_ids))


def prefix_root(seq) -> int | None:
    """What block 0 of a sequence hangs from: None under the base model, −id under LoRA adapter id
    (a value no block's prefix_id takes: those count from 0)."""
    if seq.lora_int_id == 0:
        return None
    return -seq.lora_int_id


@dataclass(slots=True)
class Block:
    """One physical KV block. `hash`, `token_ids` and the prefix ids are set when the block fills
    (prefix caching on) and cleared when it is reused for other tokens. A full block may carry a
    hash without owning that hash-table entry: a duplicate of, or a collision with, a block that
    was registered first; `hash_to_block[block.hash] == block.block_id` says it is registered."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    prefix_id: int | None = None  # names the exact prefix tokens[0 : end of this block]
    parent_prefix_id: int | None = None  # prefix_id of the block before it (None for the first)

    def clear(self) -> None:
        """Forget the block's cached identity: it matches no prefix now."""
        self.hash = None
        self.token_ids = ()
        self.prefix_id = None
        self.parent_prefix_id = None


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted in blocks by `allocate`: every prompt block is either a hit or a miss."""

    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 before any prompt block was counted."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The physical slot of tokens start .. end−1 of a sequence with this block table: token i lives
    in block block_table[i // block_size] at offset i % block_size (the one formula everyone
    uses)."""
    return [block_table[i // block_size] * block_size + i % block_size for i in range(start, end)]


def check_invariants(alloc) -> None:
    """Raise AssertionError if a BlockAllocator's bookkeeping is inconsistent. Which tables hold
    which blocks is the caller's knowledge; tests check ref counts against live tables
    themselves."""
    free = [*alloc.free_block_ids, *alloc.evictable]
    _expect(len(set(free)) == len(free), f"a block is queued as free twice: {sorted(free)}")
    free_set = set(free)
    for b in alloc.blocks:
        _expect(b.ref_count >= 0, f"block {b.block_id} has ref_count {b.ref_count}")
        _expect((b.ref_count == 0) == (b.block_id in free_set),
                f"block {b.block_id} with ref_count {b.ref_count}: expected it "
                f"{'in' if b.ref_count == 0 else 'out of'} the free queues, got it "
                f"{'in' if b.block_id in free_set else 'out of'} them")
        cached = b.hash is not None
        _expect(cached == (b.prefix_id is not None) == (len(b.token_ids) == alloc.block_size),
                f"block {b.block_id}: hash, prefix_id and token_ids disagree on whether it is full "
                "and hashed")
    for bid in alloc.free_block_ids:
        _expect(alloc.blocks[bid].hash is None, f"uncached free block {bid} still has a hash")
    for bid in alloc.evictable:
        _expect(alloc.hash_to_block.get(alloc.blocks[bid].hash) == bid,
                f"evictable block {bid} is not registered")
    for h, bid in alloc.hash_to_block.items():
        _expect(alloc.blocks[bid].hash == h,
                f"hash table entry {h} points to block {bid} whose hash differs")
    _expect(alloc.enable_prefix_caching or not alloc.hash_to_block,
            "prefix caching is off but blocks are cached")


def _expect(condition: bool, message: str) -> None:
    """An assert that `python -O` cannot strip."""
    if not condition:
        raise AssertionError(message)
