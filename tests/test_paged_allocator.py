"""The paged-KV block allocator (nanoserve/engine/block_allocator.py): unit tests, a hypothesis
property test over random operation sequences, and negative controls — mutant allocators the same
checks must reject.

The property test simulates the KV cache alongside the allocator: every slot remembers the token
prefix whose KV was written into it, and a slot of a freshly taken block holds nothing (None) until
a simulated forward writes it. A prefix hit that hands out another prefix's KV (or KV not written
yet), a write into a shared block without copy-on-write, or a lost copy all leave a slot whose
prefix is wrong.

Simulating the engine means following the protocol of nanoserve/engine/block_allocator.py: after
`allocate` and after every `append_token` + `append_slot`, the forward writes the new tokens' KV,
and only then does `mark_computed` register the full blocks among the first `num_computed_tokens`
tokens in the prefix cache (`compute` below).
"""

from __future__ import annotations

import functools
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.engine.block_allocator import BlockAllocator, default_block_hash
from nanoserve.engine.sequence import Sequence
from nanoserve.errors import NanoserveError
from nanoserve.kv import num_blocks_for_budget
from nanoserve.models.config import ModelConfig

BS = 4
X, Y, Z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]  # one block each
HASH_FNS = {
    "python": None,  # the default
    "mod3": lambda parent, tokens: default_block_hash(parent, tokens) % 3,  # frequent collisions
    "constant": lambda parent, tokens: 7,  # every block collides with every other
}


def seq_of(tokens) -> Sequence:
    return Sequence(list(tokens))


def distinct(n: int, start: int = 100) -> list[int]:
    """n tokens that share nothing with X, Y, Z or another call's range."""
    return list(range(start, start + n))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def compute(alloc: BlockAllocator, seq: Sequence, upto: int | None = None) -> None:
    """Simulate the engine's forward: the first `upto` tokens (all by default) now have KV, so their
    full blocks may enter the prefix cache."""
    seq.num_computed_tokens = len(seq) if upto is None else upto
    alloc.mark_computed(seq)


def sealed(alloc: BlockAllocator, seq: Sequence) -> list[bool]:
    """Per block of `seq`: is it in the prefix cache's bookkeeping (hashed)?"""
    return [alloc.blocks[bid].hash is not None for bid in seq.block_table]


# --------------------------------------------------------------------------- mutants (negative
# controls)
class OverAllocates(BlockAllocator):
    def blocks_needed(self, num_tokens):
        return num_tokens // self.block_size + 1  # off by one when num_tokens % block_size == 0


class UnderAllocates(BlockAllocator):
    def blocks_needed(self, num_tokens):
        return num_tokens // self.block_size  # off by one otherwise


class TrustsHash(BlockAllocator):
    def _matches(self, block, tokens, parent, root):
        return True  # no collision check at all


class TokensOnly(BlockAllocator):
    def _matches(self, block, tokens, parent, root):
        return block.token_ids == tokens  # checks the block's tokens but not the prefix before them


class NoCopyOnWrite(BlockAllocator):
    def _copy_on_write(self, table):
        return None


class ReusesLastBlock(BlockAllocator):
    def _max_prefix_hits(self, num_tokens):
        return num_tokens // self.block_size  # may serve the block holding the last prompt token


class EvictsMostRecent(BlockAllocator):
    def _release(self, block):
        super()._release(block)
        if block.block_id in self.evictable:
            self.evictable.move_to_end(block.block_id, last=False)


class ForkWithoutRefs(BlockAllocator):
    def fork(self, parent, child):
        super().fork(parent, child)
        for bid in child.block_table:
            self.blocks[bid].ref_count -= 1


class SealsAtAllocate(BlockAllocator):
    """The old protocol: full blocks registered when allocated or filled, before their KV is
    written."""

    def allocate(self, seq):
        super().allocate(seq)
        for i in range(len(seq) // self.block_size):
            self._seal(seq, i)

    def append_slot(self, seq):
        cow = super().append_slot(seq)
        if len(seq) % self.block_size == 0:
            self._seal(seq, len(seq.block_table) - 1)
        return cow


class IgnoresComputedCount(BlockAllocator):
    def mark_computed(self, seq):
        for i in range(len(seq) // self.block_size):  # every full block, computed or not
            self._seal(seq, i)


class NeverCaches(BlockAllocator):
    def mark_computed(self, seq):
        pass


# --------------------------------------------------------------------------- construction and sizes
@pytest.mark.parametrize("num_blocks, block_size, match", [
    (0, 16, r"num_blocks=0 .*>= 1"),
    (-3, 16, r"num_blocks=-3"),
    (4.0, 16, r"num_blocks=4.0"),
    (4, 0, r"block_size=0 .*power of two"),
    (4, 12, r"block_size=12 .*power of two"),
    (4, -16, r"block_size=-16"),
    (4, 16.0, r"block_size=16.0"),
])
def test_bad_construction_args(num_blocks, block_size, match):
    with pytest.raises(NanoserveError, match=match):
        BlockAllocator(num_blocks, block_size)


def test_names_and_sizes():
    alloc = BlockAllocator(10, 8)
    assert (alloc.num_blocks, alloc.block_size, alloc.num_free_blocks(), alloc.usage()) == (
        10, 8, 10, 0.0,
    )
    assert [alloc.blocks_needed(n) for n in (0, 1, 7, 8, 9, 16, 17)] == [0, 1, 1, 1, 2, 2, 3]
    with pytest.raises(NanoserveError, match="num_tokens=-1"):
        alloc.blocks_needed(-1)


def test_num_blocks_for_budget():
    cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=64, n_layers=2, n_heads=4,
                      n_kv_heads=2,
                      intermediate_size=128, max_position_embeddings=64)
    # K and V, layers, block_size, kv heads, head_dim, fp16 bytes = 4096
    per_block = 2 * 2 * 16 * 2 * 16 * 2
    assert num_blocks_for_budget(cfg, 10 * per_block + 5, 16, torch.float16) == 10
    assert num_blocks_for_budget(cfg, 10 * per_block, 16, torch.float32) == 5
    # exactly one 64-token sequence
    assert num_blocks_for_budget(cfg, 4 * per_block, 16, torch.float16) == 4
    with pytest.raises(NanoserveError,
                       match=r"12288 bytes .*needs 4 blocks of 4096 bytes = 16384 bytes"):
        num_blocks_for_budget(cfg, 3 * per_block, 16, torch.float16)
    with pytest.raises(NanoserveError, match="itemsize"):
        num_blocks_for_budget(cfg, 10 * per_block, 16, "float16")
    with pytest.raises(NanoserveError, match="block_size=10"):
        num_blocks_for_budget(cfg, 10 * per_block, 10, torch.float16)


# --------------------------------------------------------------------------- allocate / append /
# free
def check_allocate_and_free(cls, n):
    alloc = cls(8, BS)
    seq = seq_of(distinct(n))
    assert alloc.can_allocate(seq)
    alloc.allocate(seq)
    table = seq.block_table
    assert len(table) == ceil_div(n, BS) == len(set(table)), f"{len(table)} blocks for {n} tokens"
    assert alloc.num_free_blocks() == 8 - len(table)
    assert alloc.slot_mapping(seq, 0, n) == [table[i // BS] * BS + i % BS for i in range(n)]
    assert seq.num_cached_tokens == seq.num_computed_tokens == 0
    alloc.check_invariants()
    compute(alloc, seq)
    assert sealed(alloc, seq) == [i < n // BS for i in range(len(table))], (
        "exactly the full blocks are cached"
    )
    alloc.free(seq)
    assert (
        seq.block_table == [] and alloc.num_free_blocks() == 8 and len(alloc.evictable) == n // BS
    )
    assert all(b.ref_count == 0 for b in alloc.blocks)
    alloc.free(seq)  # freeing twice is a no-op
    alloc.check_invariants()


@pytest.mark.parametrize("n", [1, BS - 1, BS, BS + 1, 3 * BS])
def test_allocate_and_free_lengths(n):
    check_allocate_and_free(BlockAllocator, n)


@pytest.mark.parametrize("start", [1, BS - 1, BS, BS + 1])
def test_append_across_block_boundaries(start):
    alloc = BlockAllocator(8, BS)
    seq = seq_of(distinct(start))
    alloc.allocate(seq)
    compute(alloc, seq)
    while len(seq) < 3 * BS + 2:
        starts_block = len(seq) % BS == 0
        before = list(seq.block_table)
        seq.append_token(7)
        assert alloc.can_append(seq)
        assert alloc.append_slot(seq) is None
        assert sealed(alloc,
                      seq) == [i < (len(seq) - 1) // BS for i in range(len(seq.block_table))], \
            "a block filled by append_slot is cached only once its last token is computed"
        compute(alloc, seq)
        assert sealed(alloc, seq) == [i < len(seq) // BS for i in range(len(seq.block_table))]
        assert seq.block_table[:len(before)] == before
        assert len(seq.block_table) == len(before) + starts_block == ceil_div(len(seq), BS)
        assert alloc.slot_mapping(seq, len(seq) - 1,
                                  len(seq)) == [seq.block_table[-1] * BS + (len(seq) - 1) % BS]
        # idempotent
        assert alloc.append_slot(seq) is None and len(seq.block_table) == ceil_div(len(seq), BS)
        alloc.check_invariants()


def test_can_append_is_exact_and_append_slot_misuse():
    alloc = BlockAllocator(2, BS)
    seq = seq_of(distinct(BS + 1))
    with pytest.raises(RuntimeError, match="no blocks"):
        alloc.can_append(seq)
    alloc.allocate(seq)  # both blocks used, the second one partial
    # up to and including the token that fills the last block: no block needed
    while len(seq) < 2 * BS:
        seq.append_token(1)
        assert alloc.can_append(seq) and alloc.append_slot(seq) is None
    seq.append_token(1)
    assert not alloc.can_append(seq)  # this token starts a third block; none is free
    with pytest.raises(RuntimeError, match="all 2 KV blocks are in use"):
        alloc.append_slot(seq)
    assert len(seq.block_table) == 2  # a failed append_slot changes nothing
    seq.token_ids.append(1)
    with pytest.raises(RuntimeError, match=r"one new token at a time: .* 10 tokens .* covers 8"):
        alloc.append_slot(seq)
    shared = BlockAllocator(2, BS)
    parent = seq_of(distinct(BS + 1))
    shared.allocate(parent)
    child = seq_of(parent.token_ids)
    shared.fork(parent, child)
    child.append_token(1)
    # lands in the shared partial block: copy-on-write needs a block
    assert not shared.can_append(child)
    with pytest.raises(IndexError, match=r"\[0, 9\)"):
        alloc.slot_mapping(seq, 0, 9)


def check_fork_and_copy_on_write(cls):
    """COW happens exactly for the shared partial last block and returns (src, dst)."""
    alloc = cls(8, BS)
    parent = seq_of(distinct(BS + 2))
    alloc.allocate(parent)
    compute(alloc, parent)  # the engine prefills once, then forks
    child = seq_of(parent.token_ids)
    alloc.fork(parent, child)
    assert child.num_computed_tokens == len(child)
    full, partial = parent.block_table
    assert (
        child.block_table == [full, partial]
        and alloc.blocks[full].ref_count == alloc.blocks[partial].ref_count == 2
    )
    child.append_token(1)
    assert alloc.can_append(child)
    cow = alloc.append_slot(child)
    assert cow is not None, "a write into a shared block must copy it first"
    assert cow == (partial, child.block_table[1]) and cow[1] not in (full, partial)
    # full blocks stay shared
    assert child.block_table[0] == full and alloc.blocks[full].ref_count == 2
    assert alloc.blocks[partial].ref_count == alloc.blocks[cow[1]].ref_count == 1
    compute(alloc, child)
    parent.append_token(2)
    assert alloc.append_slot(parent) is None  # the parent now owns its last block alone
    compute(alloc, parent)
    alloc.check_invariants()
    # A full shared last block: the next token starts a new block, so nothing is copied.
    a = seq_of(distinct(2 * BS, 200))
    alloc.allocate(a)
    compute(alloc, a)
    b = seq_of(a.token_ids)
    alloc.fork(a, b)
    for s in (a, b):
        s.append_token(3)
        assert alloc.append_slot(s) is None
        compute(alloc, s)
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]
    for s in (parent, child, a, b):
        alloc.free(s)
    assert alloc.num_free_blocks() == 8 and all(blk.ref_count == 0 for blk in alloc.blocks)
    alloc.check_invariants()


def test_fork_and_copy_on_write():
    check_fork_and_copy_on_write(BlockAllocator)


def test_fork_misuse():
    alloc = BlockAllocator(4, BS)
    parent, other = seq_of(X), seq_of(Y)
    with pytest.raises(RuntimeError, match="no blocks"):
        alloc.fork(parent, other)
    alloc.allocate(parent)
    with pytest.raises(RuntimeError, match="parent's tokens"):
        alloc.fork(parent, other)


# --------------------------------------------------------------------------- prefix caching
def check_prefix_hits(cls):
    alloc = cls(16, BS)
    a = seq_of(X + Y + Z + [0])
    alloc.allocate(a)
    compute(alloc, a)
    b = seq_of(a.token_ids)  # identical prompt while `a` still runs (its prompt computed)
    alloc.allocate(b)
    assert b.num_cached_tokens == b.num_computed_tokens == 3 * BS
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert [alloc.blocks[i].ref_count for i in a.block_table] == [2, 2, 2, 1]
    compute(alloc, b)
    c = seq_of(X + Y + [0, 0, 0, 0, 0])  # shares the first two blocks only
    alloc.allocate(c)
    assert c.num_cached_tokens == 2 * BS and c.block_table[:2] == a.block_table[:2]
    compute(alloc, c)
    # chained hashes: equal later blocks behind a different first block miss
    d = seq_of(Z + Y + Z + [0])
    alloc.allocate(d)
    assert d.num_cached_tokens == 0 and not set(d.block_table) & set(a.block_table)
    compute(alloc, d)
    # misses: a 4, b 1, c 2, d 4
    assert (alloc.stats.hits, alloc.stats.misses) == (5, 4 + 1 + 2 + 4)
    assert alloc.stats.hit_rate == pytest.approx(5 / 16)
    a_table = a.block_table
    for s in (a, b, c, d):
        alloc.free(s)
    e = seq_of(a.token_ids[:3 * BS] + [5])  # hits blocks that are free but still cached
    free_before = alloc.num_free_blocks()
    alloc.allocate(e)
    assert e.num_cached_tokens == 3 * BS and e.block_table[:3] == a_table[:3]
    assert alloc.num_free_blocks() == free_before - 4
    alloc.check_invariants()


def test_prefix_hits():
    check_prefix_hits(BlockAllocator)


def test_prefix_caching_off():
    alloc = BlockAllocator(8, BS, enable_prefix_caching=False)
    a, b = seq_of(X + Y + [0]), seq_of(X + Y + [0])
    alloc.allocate(a)
    compute(alloc, a)
    alloc.allocate(b)
    compute(alloc, b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    assert alloc.hash_to_block == {} and all(blk.hash is None for blk in alloc.blocks)
    alloc.check_invariants()


def check_last_token_is_computed(cls):
    """A prompt that is entirely cached still leaves its last block (and so its last token) to
    compute."""
    alloc = cls(8, BS)
    a = seq_of(X + Y)
    alloc.allocate(a)
    compute(alloc, a)
    assert sealed(alloc, a) == [True, True]
    b = seq_of(X + Y)
    alloc.allocate(b)
    assert b.num_cached_tokens == BS < len(b)
    c = seq_of(X)
    alloc.allocate(c)
    assert c.num_cached_tokens == 0 and c.block_table[0] != a.block_table[0]


def test_full_prompt_hit_leaves_a_token_to_compute():
    check_last_token_is_computed(BlockAllocator)


def check_collisions_are_harmless(cls):
    """With a hash_fn that returns a constant, every lookup collides: only exact matches may hit."""
    alloc = cls(16, BS, hash_fn=HASH_FNS["constant"])
    a = seq_of(X + Y + [0])
    alloc.allocate(a)
    compute(alloc, a)
    b = seq_of(Y + X + [0])  # same hash as a's first block, different tokens
    alloc.allocate(b)
    assert b.num_cached_tokens == 0 and not set(b.block_table) & set(a.block_table)
    compute(alloc, b)
    c = seq_of(X + X + [0])  # block 1 has a's block 0's tokens but not its prefix (position 0 vs 1)
    alloc.allocate(c)
    assert c.num_cached_tokens == BS and c.block_table[0] == a.block_table[0]
    assert len(set(c.block_table)) == 3
    compute(alloc, c)
    # block 0 hits; block 1's hash is taken by block 0, so it is a miss, not a wrong hit
    d = seq_of(X + Y + [0])
    alloc.allocate(d)
    assert d.num_cached_tokens == BS and d.block_table[1] != a.block_table[0]
    for s in (a, b, c, d):
        for i in range(s.num_cached_tokens // BS):
            assert alloc.blocks[s.block_table[i]].token_ids == tuple(
                s.token_ids[i * BS : (i + 1) * BS]
            )
    alloc.check_invariants()


def test_hash_collisions_never_reuse_a_different_block():
    check_collisions_are_harmless(BlockAllocator)


def check_lru_eviction(cls):
    alloc = cls(5, BS)
    a = seq_of(X + Y + [0])
    alloc.allocate(a)
    assert a.block_table == [0, 1, 2]
    compute(alloc, a)
    y_hash = alloc.blocks[1].hash
    # tail first: 2 (partial, uncached), then 1, then 0 (cached, evictable in that order)
    alloc.free(a)
    assert list(alloc.free_block_ids) == [3, 4, 2] and list(alloc.evictable) == [1, 0]
    b = seq_of(distinct(4 * BS))
    alloc.allocate(b)
    assert b.block_table == [3, 4, 2,
                             1], "uncached blocks first, then the least recently freed cached block"
    compute(alloc, b)
    assert y_hash not in alloc.hash_to_block and alloc.blocks[0].hash in alloc.hash_to_block
    alloc.free(b)
    assert list(alloc.evictable) == [0, 1, 2, 4, 3]
    # a's first block survived eviction; b's tail (block 1, freed first) goes next
    c = seq_of(X + [0])
    alloc.allocate(c)
    assert c.num_cached_tokens == BS and c.block_table == [0, 1]
    alloc.check_invariants()


def test_lru_eviction_order():
    check_lru_eviction(BlockAllocator)


def test_can_allocate_counts_prefix_hits_exactly():
    alloc = BlockAllocator(4, BS)
    a = seq_of(X + Y + [0])
    alloc.allocate(a)  # 3 of 4 blocks in use
    compute(alloc, a)
    b = seq_of(X + Y + [1])  # needs 3 blocks, but two are hits: one new block is enough
    assert alloc.can_allocate(b)
    alloc.allocate(b)
    assert alloc.num_free_blocks() == 0 and b.num_cached_tokens == 2 * BS
    compute(alloc, b)
    alloc.free(a)
    alloc.free(b)
    alloc.allocate(seq_of(distinct(BS + 1)))  # 2 blocks: uncached first, then evicts
    e = seq_of(X + Y + [2])  # both of its hits are evictable, so they count against what is free
    assert alloc.num_free_blocks() == 2 and not alloc.can_allocate(e)
    alloc.check_invariants()


def test_pool_too_small_errors_name_the_numbers():
    alloc = BlockAllocator(4, BS)
    alloc.allocate(seq_of(distinct(3 * BS)))
    b = seq_of(distinct(2 * BS, 300))
    assert not alloc.can_allocate(b)
    with pytest.raises(NanoserveError, match=r"8 tokens need 2 new blocks .* only 1 of 4 are free"):
        alloc.allocate(b)
    # a refused allocation changes nothing
    assert b.block_table == [] and alloc.num_free_blocks() == 1
    alloc.check_invariants()
    too_long = seq_of(distinct(4 * BS + 1, 300))
    for call in (alloc.can_allocate, alloc.allocate):
        with pytest.raises(NanoserveError,
                           match=r"17 tokens, needing 5 blocks of 4, .* 4 blocks in total; "
                                                 r"allowed: 1 to 16 tokens"):
            call(too_long)
    with pytest.raises(NanoserveError, match="has 0 tokens"):
        alloc.allocate(seq_of([]))


def test_reset_prefix_cache():
    alloc = BlockAllocator(4, BS)
    a = seq_of(X + Y + [0])
    alloc.allocate(a)
    compute(alloc, a)
    assert not alloc.reset_prefix_cache()  # blocks in use
    alloc.free(a)
    assert len(alloc.evictable) == 2 and alloc.reset_prefix_cache()
    b = seq_of(a.token_ids)
    alloc.allocate(b)
    assert b.num_cached_tokens == 0 and alloc.num_free_blocks() == 1
    alloc.check_invariants()


# --------------------------------------------------------------------------- only computed blocks
# are cached
def check_uncomputed_blocks_are_not_hits(cls):
    """A block enters the prefix cache only after `mark_computed`: until then no other sequence may
    hit it."""
    alloc = cls(16, BS)
    a = seq_of(X + Y + Z + [0])
    alloc.allocate(a)  # allocated, KV not yet written
    assert sealed(alloc, a) == [False] * 4 and alloc.hash_to_block == {}
    b = seq_of(a.token_ids)
    assert alloc.can_allocate(b)
    alloc.allocate(b)
    assert b.num_cached_tokens == 0 and not set(b.block_table) & set(a.block_table), (
        "hit a block with no KV"
    )
    compute(alloc, a)
    c = seq_of(a.token_ids)
    alloc.allocate(c)
    assert c.num_cached_tokens == 3 * BS and c.block_table[:3] == a.block_table[:3]
    # b computed the same blocks: a's registration is kept, b's blocks are unregistered twins
    compute(alloc, b)
    assert [
        alloc.hash_to_block[alloc.blocks[bid].hash] for bid in b.block_table[:3]
    ] == a.block_table[:3]
    # Decode: a block filled by append_slot is a hit only after the forward that writes its last
    # token.
    d = seq_of(distinct(BS - 1))
    alloc.allocate(d)
    compute(alloc, d)
    d.append_token(0)
    alloc.append_slot(d)
    for computed in (False, True):
        if computed:
            compute(alloc, d)
        e = seq_of(d.token_ids + [1])
        alloc.allocate(e)
        assert e.num_cached_tokens == (BS if computed else 0)
        alloc.free(e)
    for s in (a, b, c, d):
        alloc.free(s)
    alloc.check_invariants()


def test_uncomputed_blocks_are_not_hits():
    check_uncomputed_blocks_are_not_hits(BlockAllocator)


def check_free_before_compute_caches_nothing(cls):
    """A sequence aborted or preempted before its forward leaves nothing cached; once computed, it
    does."""
    alloc = cls(8, BS)
    prompt = X + Y + [0]
    a = seq_of(prompt)
    alloc.allocate(a)
    alloc.free(a)  # aborted / preempted mid-prefill
    assert (
        alloc.hash_to_block == {} and not alloc.evictable
        and all(blk.hash is None for blk in alloc.blocks)
    )
    assert list(alloc.free_block_ids)[-3:] == [2, 1, 0], "its blocks went back as plain free blocks"
    b = seq_of(prompt)
    alloc.allocate(b)
    assert b.num_cached_tokens == 0, "a later identical prompt must miss"
    compute(alloc, b)
    b_table = b.block_table
    alloc.free(b)
    assert list(alloc.evictable) == b_table[1::-1]
    c = seq_of(prompt)
    alloc.allocate(c)
    assert c.num_cached_tokens == 2 * BS and c.block_table[:2] == b_table[:2], (
        "after compute + free it hits"
    )
    assert (alloc.stats.hits, alloc.stats.misses) == (2, 3 + 3 + 1)
    alloc.check_invariants()


def test_free_before_compute_caches_nothing():
    check_free_before_compute_caches_nothing(BlockAllocator)


def check_partial_mark_computed(cls):
    """Chunked prefill: mark_computed registers exactly the full blocks below
    num_computed_tokens."""
    alloc = cls(16, BS)
    a = seq_of(X + Y + Z + [0])  # 13 tokens: 3 full blocks and a partial one
    alloc.allocate(a)
    for upto, full in [(0, 0), (BS - 1, 0), (BS, 1), (BS, 1), (2 * BS - 1, 1), (2 * BS + 1, 2)]:
        compute(alloc, a, upto)  # (BS, 1) twice: calling it again changes nothing
        assert sealed(alloc, a) == [i < full for i in range(4)], f"{upto} computed tokens"
        probe = seq_of(a.token_ids)
        assert alloc.can_allocate(probe)
        alloc.allocate(probe)
        assert (
            probe.num_cached_tokens == full * BS
            and probe.block_table[:full] == a.block_table[:full]
        )
        alloc.free(probe)
        alloc.check_invariants()
    alloc.free(a)  # preempted after 9 of 13 tokens: its 2 computed blocks stay cached, nothing else
    assert len(alloc.evictable) == 2
    alloc.allocate(a)  # rescheduled: resumes after the cached blocks
    assert a.num_computed_tokens == 2 * BS and sealed(alloc, a) == [True, True, False, False]
    compute(alloc, a)
    assert sealed(alloc, a) == [True, True, True, False]
    alloc.check_invariants()


def test_partial_mark_computed():
    check_partial_mark_computed(BlockAllocator)


def test_check_invariants_catches_corruption():
    def corrupted(how):
        alloc = BlockAllocator(4, BS)
        seq = seq_of(X + Y + [0])
        alloc.allocate(seq)
        compute(alloc, seq)
        how(alloc)
        return alloc

    corruptions = {
        "queued as free twice": lambda a: a.free_block_ids.append(3),
        "ref_count 1: expected it out of the free queues, got it in":
            lambda a: a.free_block_ids.append(0),
        "ref_count 0: expected it in the free queues, got it out of":
            lambda a: setattr(a.blocks[2], "ref_count", 0),
        "points to block": lambda a: a.hash_to_block.__setitem__(a.blocks[0].hash, 1),
        "disagree": lambda a: setattr(a.blocks[0], "token_ids", (1, 2)),
    }
    BlockAllocator(4, BS).check_invariants()
    for message, how in corruptions.items():
        with pytest.raises(AssertionError, match=message):
            corrupted(how).check_invariants()


# --------------------------------------------------------------------------- property test
class Harness:
    """Drives an allocator the way an engine does and simulates its KV cache (slot -> prefix; None:
    nothing written since the block was taken). Prompts may be computed in chunks, and a sequence
    may be freed (aborted, preempted) before all of it is computed."""

    MAX_LIVE = 8

    def __init__(self, alloc: BlockAllocator):
        self.alloc, self.bs = alloc, alloc.block_size
        self.live: list[Sequence] = []
        self.kv: dict[int, tuple[int, ...] | None] = {}
        self.counts: Counter[str] = Counter()

    def apply(self, op: tuple) -> None:
        kind, *args = op
        self.counts["ops"] += 1
        # the next new block would evict a cached one:
        self.counts["evict_possible"] += not self.alloc.free_block_ids and bool(
            self.alloc.evictable
        )
        if kind == "add":
            self.add(list(args[0]), args[1])
        elif not self.live:
            return
        elif kind == "extend":  # a prefix of a running sequence plus a new tail: prefix hits
            src = self.live[args[0] % len(self.live)]
            self.add(src.token_ids[:args[1] % len(src) + 1] + list(args[2]), args[3])
        elif kind == "compute":  # one more chunk of a prompt's prefill
            self.compute(self.live[args[0] % len(self.live)], args[1])
        elif kind == "append":
            self.append(self.live[args[0] % len(self.live)], args[1])
        elif kind == "fork" and len(self.live) < self.MAX_LIVE:
            parent = self.live[args[0] % len(self.live)]
            self.compute(parent)  # the engine forks after the prompt's prefill
            child = seq_of(parent.token_ids)
            self.alloc.fork(parent, child)
            self.live.append(child)
            self.counts["fork"] += 1
        elif kind == "free":
            seq = self.live.pop(args[0] % len(self.live))
            self.counts["free_mid_prefill"] += seq.num_computed_tokens < len(seq)
            self.alloc.free(seq)
        self.check()

    def add(self, tokens: list[int], chunk: int | None) -> None:
        seq = seq_of(tokens)
        if len(tokens) > self.alloc.num_blocks * self.bs:
            with pytest.raises(NanoserveError, match="in total"):
                self.alloc.can_allocate(seq)
            self.counts["too_long"] += 1
            return
        if len(self.live) >= self.MAX_LIVE or not self.alloc.can_allocate(seq):
            if len(self.live) < self.MAX_LIVE:
                with pytest.raises(NanoserveError, match="call can_allocate"):
                    self.alloc.allocate(seq)
                self.counts["refused"] += 1
            return
        self.alloc.allocate(seq)
        self.check_table(seq)
        cached = seq.num_cached_tokens
        assert cached % self.bs == 0 and cached < len(seq), f"{cached} cached tokens of {len(seq)}"
        assert seq.num_computed_tokens == cached, (
            "num_computed_tokens != num_cached_tokens after allocate"
        )
        for pos, slot in enumerate(self.alloc.slot_mapping(seq, 0, cached)):
            assert self.kv.get(slot) == tuple(tokens[: pos + 1]), (
                "a prefix hit gives KV of another prefix"
            )
        for bid in seq.block_table[cached // self.bs:]:
            self.taken(bid)
        self.live.append(seq)
        self.counts["hit_blocks"] += cached // self.bs
        self.compute(seq, chunk)

    def taken(self, bid: int) -> None:
        """A block just taken from the free queues holds no KV of its new owner yet."""
        for off in range(self.bs):
            self.kv[bid * self.bs + off] = None

    def compute(self, seq: Sequence, chunk: int | None = None) -> None:
        """A forward over the next `chunk` uncomputed tokens (all of them by default): write their
        KV, then tell the allocator, as the engine does."""
        start = seq.num_computed_tokens
        end = len(seq) if chunk is None else min(len(seq), start + chunk)
        for pos, slot in enumerate(self.alloc.slot_mapping(seq, start, end), start):
            self.kv[slot] = tuple(seq.token_ids[:pos + 1])
        seq.num_computed_tokens = end
        self.alloc.mark_computed(seq)
        self.counts["chunked"] += end < len(seq)

    def append(self, seq: Sequence, token: int) -> None:
        self.compute(seq)  # the engine decodes only after the whole prompt is computed
        seq.append_token(token)
        # then append_slot must fail, and change nothing when it does
        if not self.alloc.can_append(seq):
            with pytest.raises(RuntimeError, match="in use"):
                self.alloc.append_slot(seq)
            seq.token_ids.pop()  # the engine would preempt; here the token is dropped
            self.counts["append_refused"] += 1
            return
        n_blocks = len(seq.block_table)
        cow = self.alloc.append_slot(seq)
        if len(seq.block_table) > n_blocks:
            self.taken(seq.block_table[-1])
        if cow is not None:  # what PagedKVCache.copy_block does
            src, dst = cow
            for off in range(self.bs):
                self.kv[dst * self.bs + off] = self.kv.get(src * self.bs + off)
            self.counts["cow"] += 1
        self.compute(seq)

    def check_table(self, seq: Sequence) -> None:
        table, bs = seq.block_table, self.bs
        assert len(table) == ceil_div(len(seq), bs), "len(block_table) != ceil(len / block_size)"
        assert len(table) * bs - len(seq) <= bs - 1, "more than block_size - 1 wasted slots"
        assert len(set(table)) == len(table), "a block appears twice in one block table"

    def check(self) -> None:
        alloc, bs = self.alloc, self.bs
        alloc.check_invariants()
        holders: Counter[int] = Counter()
        for seq in self.live:
            table, tokens = seq.block_table, seq.token_ids
            self.check_table(seq)
            holders.update(table)
            for pos, slot in enumerate(alloc.slot_mapping(seq, 0, seq.num_computed_tokens)):
                assert self.kv.get(slot) == tuple(tokens[: pos + 1]), (
                    "a slot holds the KV of another prefix"
                )
            for i, bid in enumerate(table):
                block = alloc.blocks[bid]
                if block.hash is not None:
                    assert block.token_ids == tuple(tokens[i * bs : (i + 1) * bs]), (
                        "a cached block's tokens differ"
                    )
        for block in alloc.blocks:
            assert block.ref_count == holders[block.block_id], (
                "ref_count != number of live block tables holding it"
            )
            # in the prefix cache's bookkeeping: its KV must be there, for its tokens
            if block.hash is not None:
                for off in range(bs):
                    written = self.kv.get(block.block_id * bs + off)
                    assert (
                        written is not None and len(written) % bs == (off + 1) % bs
                        and written[-(off + 1) :] == block.token_ids[: off + 1]
                    ), "a cached block's KV is not written"

    def finish(self) -> None:
        while self.live:
            self.alloc.free(self.live.pop())
        self.check()
        assert all(b.ref_count == 0 for b in self.alloc.blocks)
        assert self.alloc.num_free_blocks() == self.alloc.num_blocks


def make_alloc(cls, block_size: int, num_blocks: int, hash_name: str,
               caching: bool = True) -> BlockAllocator:
    return cls(num_blocks, block_size, enable_prefix_caching=caching, hash_fn=HASH_FNS[hash_name])


tokens_st = st.integers(0, 2)  # a tiny vocabulary, so prefixes and whole blocks repeat
index_st = st.integers(0, 15)
# how much of a new prompt the first forward computes
chunk_st = st.one_of(st.none(), st.integers(0, 8))
op_st = st.one_of(
    st.tuples(st.just("add"), st.lists(tokens_st, min_size=1, max_size=14), chunk_st),
    st.tuples(st.just("extend"), index_st, st.integers(0, 31), st.lists(tokens_st, max_size=5), chunk_st),
    st.tuples(st.just("compute"), index_st, st.integers(1, 8)),
    st.tuples(st.just("append"), index_st, tokens_st),
    st.tuples(st.just("append"), index_st, tokens_st),
    st.tuples(st.just("fork"), index_st),
    st.tuples(st.just("free"), index_st),
)
MIN_OPS, EXAMPLES = 100, 100  # >= 10,000 random operations in total


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.large_base_example])
@given(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 32),
       hash_name=st.sampled_from(sorted(HASH_FNS)),
       caching=st.sampled_from([True, True, True, False]),
       ops=st.lists(op_st, min_size=MIN_OPS, max_size=MIN_OPS + 30))
def test_allocator_properties(block_size, num_blocks, hash_name, caching, ops):
    harness = Harness(make_alloc(BlockAllocator, block_size, num_blocks, hash_name, caching))
    for op in ops:
        harness.apply(op)
    harness.finish()


def random_ops(rng: random.Random, n: int) -> list[tuple]:
    """The same operation mix as op_st, for fixed-seed runs (negative controls, coverage)."""
    toks = lambda k: [rng.randrange(3) for _ in range(k)]
    chunk = lambda: rng.choice([None, rng.randrange(9)])
    kinds = ["add", "extend", "compute", "append", "append", "fork", "free"]
    table = {
        "add": lambda: ("add", toks(rng.randint(1, 14)), chunk()),
        "extend": lambda: (
            "extend",
            rng.randrange(16),
            rng.randrange(32),
            toks(rng.randrange(6)),
            chunk(),
        ),
        "compute": lambda: ("compute", rng.randrange(16), rng.randint(1, 8)),
        "append": lambda: ("append", rng.randrange(16), rng.randrange(3)),
        "fork": lambda: ("fork", rng.randrange(16)),
        "free": lambda: ("free", rng.randrange(16)),
    }
    return [table[rng.choice(kinds)]() for _ in range(n)]


def run_random(cls, block_size: int, num_blocks: int, hash_name: str, seeds=range(4),
               n_ops: int = 300) -> Counter:
    counts: Counter[str] = Counter()
    for seed in seeds:
        harness = Harness(make_alloc(cls, block_size, num_blocks, hash_name))
        for op in random_ops(random.Random(seed), n_ops):
            harness.apply(op)
        harness.finish()
        counts += harness.counts
    return counts


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 32),
       hash_name=st.sampled_from(sorted(HASH_FNS)), seed=st.integers(0, 2**32 - 1))
def test_allocator_properties_seeded(block_size, num_blocks, hash_name, seed):
    """The same properties on independent random op sequences: hypothesis mutates its op lists
    from one example to the next, so this run adds variety where the one above adds shrinking."""
    harness = Harness(make_alloc(BlockAllocator, block_size, num_blocks, hash_name))
    for op in random_ops(random.Random(seed), MIN_OPS + 20):
        harness.apply(op)
    harness.finish()


def test_property_harness_reaches_every_path():
    """The random operations really exercise hits, copy-on-write, eviction, refusals, chunked
    prefill and sequences freed before all their tokens are computed."""
    counts = (run_random(BlockAllocator, 2, 12, "python") + run_random(BlockAllocator, 4, 6, "mod3")
              # a 12-token pool: prompts too long for it
              + run_random(BlockAllocator, 1, 12, "constant"))
    for path in ("hit_blocks", "cow", "fork", "refused", "append_refused", "too_long",
                 "evict_possible", "chunked",
                 "free_mid_prefill"):
        assert counts[path] > 0, f"random ops never reached {path}: {counts}"


# --------------------------------------------------------------------------- negative controls
@pytest.mark.parametrize("mutant, hash_name, match", [
    # or append_slot finds the table too long
    (OverAllocates, "python", "ceil|one new token at a time"),
    (UnderAllocates, "python", "ceil"),
    (TrustsHash, "constant", "another prefix|appears twice"),
    (TokensOnly, "constant", "another prefix|appears twice"),
    (NoCopyOnWrite, "python", "another prefix|cached block's tokens differ"),
    (ReusesLastBlock, "python", "cached tokens of"),
    (ForkWithoutRefs, "python", "ref_count"),
    (SealsAtAllocate, "python", "KV is not written|another prefix"),
    (IgnoresComputedCount, "python", "KV is not written|another prefix"),
])
def test_property_checks_reject_mutants(mutant, hash_name, match):
    run_random(BlockAllocator, 2, 12, hash_name)  # the same operations pass on the real allocator
    with pytest.raises((AssertionError, RuntimeError), match=match):
        run_random(mutant, 2, 12, hash_name)


@pytest.mark.parametrize("check, mutant", [
    (check_fork_and_copy_on_write, NoCopyOnWrite),
    (functools.partial(check_allocate_and_free, n=BS), OverAllocates),
    (functools.partial(check_allocate_and_free, n=BS + 1), UnderAllocates),
    (check_last_token_is_computed, ReusesLastBlock),
    (check_collisions_are_harmless, TrustsHash),
    (check_collisions_are_harmless, TokensOnly),
    (check_lru_eviction, EvictsMostRecent),
    (check_prefix_hits, NeverCaches),
    (check_uncomputed_blocks_are_not_hits, SealsAtAllocate),
    (check_free_before_compute_caches_nothing, SealsAtAllocate),
    (check_partial_mark_computed, SealsAtAllocate),
    (check_partial_mark_computed, IgnoresComputedCount),
])
def test_unit_checks_reject_mutants(check, mutant):
    with pytest.raises(AssertionError):
        check(mutant)
