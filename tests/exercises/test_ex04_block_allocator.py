"""Exercise 4: the block allocator (nanoserve/engine/block_allocator.py: BlockAllocator.allocate,
append_slot, free, fork).

Oracles: block tables worked out by hand on a fresh pool (its free queue hands out 0, 1, 2, ...),
and a model of what the tables mean, checked after every operation of random runs: a block's
ref count is the number of live tables that list it, a table holds ceil(len / block_size) distinct
blocks, the free count is what no table holds, and the simulated KV cache behind every table
still holds, in every computed slot, the KV of exactly that sequence's prefix (a write into a
shared block, a lost copy-on-write or a wrong prefix hit breaks it).
"""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest
from explain import explained_failure

import nanoserve.engine.block_allocator
from nanoserve.engine.sequence import Sequence
from nanoserve.errors import NanoserveError

REFERENCE = "nanoserve.engine.block_allocator"
EXERCISE = "block_allocator"
pytestmark = pytest.mark.ex04

BS = 4
X, Y = [1, 2, 3, 4], [5, 6, 7, 8]  # one block each


def allocator(impl, num_blocks=8, **kwargs):
    """impl's BlockAllocator, with exercise 5's lookup (`_prefix_hits`) taken from nanoserve so that
    exercise 4 can be done first."""
    lookup = nanoserve.engine.block_allocator.BlockAllocator._prefix_hits
    cls = type("Allocator", (impl.BlockAllocator,), {"_prefix_hits": lookup})
    return cls(num_blocks, BS, **kwargs)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def compute(alloc, seq) -> None:
    """The engine's forward: every token of `seq` now has KV, so its full blocks may become prefix
    hits."""
    seq.num_computed_tokens = len(seq)
    alloc.mark_computed(seq)


def check_tables(alloc, live) -> None:
    """The allocator's bookkeeping agrees with the live block tables."""
    alloc.check_invariants()
    held = Counter(bid for seq in live for bid in seq.block_table)
    for b in alloc.blocks:
        assert b.ref_count == held[b.block_id], (
            f"block {b.block_id}: expected ref_count {held[b.block_id]} (the tables that list it), "
            f"got {b.ref_count}")
    for seq in live:
        assert len(seq.block_table) == ceil_div(len(seq), BS) == len(set(seq.block_table)), (
            f"a sequence of {len(seq)} tokens: expected {ceil_div(len(seq), BS)} distinct blocks, "
            f"got the table {seq.block_table}")
    free = alloc.num_free_blocks()
    assert free == alloc.num_blocks - len(held), (
        f"free blocks: expected {alloc.num_blocks - len(held)} (the pool less the tables' "
        f"{len(held)}), got {free}")


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_allocate_exact_tables(impl):
    """Lengths 1, bs-1, bs, bs+1 on a fresh pool: the blocks come in free-queue order."""
    for n, want in [(1, [0]), (BS - 1, [0]), (BS, [0]), (BS + 1, [0, 1]), (3 * BS, [0, 1, 2])]:
        alloc = allocator(impl)
        seq = Sequence(list(range(100, 100 + n)))
        alloc.allocate(seq)
        assert seq.block_table == want, f"{n} tokens: table {seq.block_table}, expected {want}"
        assert seq.num_cached_tokens == seq.num_computed_tokens == 0
        assert (alloc.stats.hits, alloc.stats.misses) == (0, len(want))
        check_tables(alloc, [seq])
    alloc = allocator(impl)
    a, b, c = Sequence(list(range(9))), Sequence([7]), Sequence(list(range(4)))
    for seq in (a, b, c):
        alloc.allocate(seq)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [3], [4])
    check_tables(alloc, [a, b, c])


def check_allocate_prefix_hits(impl):
    """Hits (found by nanoserve's lookup) lead the table, each gains a reference, and a hit on a
    freed-but-cached block takes it out of the evictable queue."""
    alloc = allocator(impl)
    a = Sequence(X + Y + [0])
    alloc.allocate(a)
    compute(alloc, a)
    b = Sequence(X + Y + [1])
    alloc.allocate(b)
    assert b.block_table == a.block_table[:2] + [3], (
        f"table {b.block_table}: two hits, then the next free block"
    )
    assert b.num_cached_tokens == b.num_computed_tokens == 2 * BS
    assert (alloc.stats.hits, alloc.stats.misses) == (2, 3 + 1)
    check_tables(alloc, [a, b])
    a_table = list(a.block_table)
    alloc.free(a)
    alloc.free(b)
    c = Sequence(X + Y + [2])  # its two hits are free (ref count 0) but still cached
    alloc.allocate(c)
    assert c.block_table[:2] == a_table[:2] and c.num_cached_tokens == 2 * BS
    check_tables(alloc, [c])
    assert alloc.num_free_blocks() == 8 - 3


def check_append_across_block_boundaries(impl):
    """From 3 tokens to 2 * bs + 2: a new block exactly when the new token starts one."""
    alloc = allocator(impl)
    seq = Sequence([1, 2, 3])
    alloc.allocate(seq)
    compute(alloc, seq)
    next_free = 1
    while len(seq) < 2 * BS + 2:
        before = list(seq.block_table)
        seq.append_token(9)
        assert alloc.can_append(seq)
        assert alloc.append_slot(seq) is None, "no block is shared: nothing to copy"
        starts_block = (len(seq) - 1) % BS == 0
        want = before + [next_free] if starts_block else before
        assert seq.block_table == want, (
            f"append_slot after token {len(seq)} (blocks of {BS}): expected the table {want}, got "
            f"{seq.block_table}")
        next_free += starts_block
        assert alloc.append_slot(seq) is None and seq.block_table == want, (
            "a second call must change nothing"
        )
        compute(alloc, seq)
        check_tables(alloc, [seq])


def check_free(impl):
    """free returns every block, last block first; shared blocks lose one reference per table."""
    alloc = allocator(impl, enable_prefix_caching=False)
    a = Sequence(list(range(9)))
    alloc.allocate(a)
    alloc.free(a)
    assert list(alloc.free_block_ids) == [3, 4, 5, 6, 7, 2, 1, 0], "blocks go back last block first"
    assert a.block_table == [] and a.num_cached_tokens == a.num_computed_tokens == 0
    alloc.free(a)  # freeing twice is a no-op
    check_tables(alloc, [])
    alloc = allocator(impl)
    a, b, c = Sequence(X + Y + [0]), Sequence(X + Y + [1]), Sequence(X + [2])
    for seq in (a, b, c):  # b hits a's two blocks, c a's first: block 0 is listed three times
        alloc.allocate(seq)
        compute(alloc, seq)
    assert alloc.blocks[a.block_table[0]].ref_count == 3
    live = [a, b, c]
    for seq in (b, a, c):
        alloc.free(seq)
        live.remove(seq)
        check_tables(alloc, live)
    assert alloc.num_free_blocks() == alloc.num_blocks and all(
        blk.ref_count == 0 for blk in alloc.blocks
    )
    assert list(alloc.evictable) == [1, 0], (
        "a's cached blocks X (0) and Y (1) are evictable, tail freed first"
    )


def check_fork_and_copy_on_write(impl):
    """fork shares every block; the first write into the shared partial block copies it."""
    alloc = allocator(impl)
    parent = Sequence(list(range(100, 100 + BS + 2)))  # a full block and a half-full one
    alloc.allocate(parent)
    compute(alloc, parent)  # the engine prefills once, then forks
    child = Sequence(parent.token_ids)
    alloc.fork(parent, child)
    full, partial = parent.block_table
    assert child.block_table == [full, partial] and child.block_table is not parent.block_table
    assert child.num_computed_tokens == parent.num_computed_tokens == len(parent)
    counts = (alloc.blocks[full].ref_count, alloc.blocks[partial].ref_count)
    assert counts == (2, 2), (
        f"fork: the parent's two blocks' ref_counts: expected (2, 2), one per table, got {counts}")
    check_tables(alloc, [parent, child])
    child.append_token(1)
    assert alloc.can_append(child)
    cow = alloc.append_slot(child)
    assert cow == (partial, 2), (
        f"append_slot(child) into the shared last block after a fork: expected the copy "
        f"(src={partial}, dst=the next free block 2), got {cow}")
    assert child.block_table == [full, 2] and parent.block_table == [full, partial]
    check_tables(alloc, [parent, child])
    parent.append_token(2)
    assert alloc.append_slot(parent) is None, "the parent now holds its last block alone: no copy"
    check_tables(alloc, [parent, child])
    for seq in (parent, child):
        alloc.free(seq)
    check_tables(alloc, [])
    assert alloc.num_free_blocks() == alloc.num_blocks


def check_random_operations(impl, seed, num_ops=120):
    """Random allocate / compute / append / fork / free (prefix caching on, prompts built from a few
    shared blocks, a pool small enough to run dry) against the model of the module docstring."""
    rng = random.Random(seed)
    alloc = allocator(impl, num_blocks=12)
    live: list[Sequence] = []
    # slot -> the prefix whose KV it holds (None: nothing yet)
    kv: dict[int, tuple[int, ...] | None] = {}

    def slots(seq, start, end):
        return [seq.block_table[i // BS] * BS + i % BS for i in range(start, end)]

    def forward(seq):  # writes only into blocks this table holds alone: shared blocks are read-only
        for pos, slot in enumerate(slots(seq, seq.num_computed_tokens, len(seq)),
                                   seq.num_computed_tokens):
            assert alloc.blocks[slot // BS].ref_count == 1, (
                f"seed {seed}: a write into block {slot // BS}: expected a block this table holds "
                f"alone (ref_count 1), got ref_count {alloc.blocks[slot // BS].ref_count}")
            kv[slot] = tuple(seq.token_ids[:pos + 1])
        compute(alloc, seq)

    for _ in range(num_ops):
        op = rng.choice(["add", "add", "append", "append", "append", "fork", "free"])
        if op == "add" and len(live) < 8:
            seq = Sequence([t for _ in range(rng.randint(0, 3)) for t in rng.choice([X, Y])]
                           + [rng.randrange(20, 30) for _ in range(rng.randint(1, 6))])
            if alloc.can_allocate(seq):
                before = {bid: alloc.blocks[bid].ref_count for bid in range(alloc.num_blocks)}
                alloc.allocate(seq)
                for bid in seq.block_table[seq.num_cached_tokens // BS:]:
                    assert before[bid] == 0, f"seed {seed}: block {bid} handed out while in use"
                    kv.update({bid * BS + off: None for off in range(BS)})
                live.append(seq)
                forward(seq)
        elif op == "append" and live:
            seq = rng.choice(live)
            seq.append_token(rng.randrange(20, 30))
            if not alloc.can_append(seq):  # the engine would preempt: here the sequence goes
                alloc.free(seq)
                live.remove(seq)
            else:
                n = len(seq.block_table)
                cow = alloc.append_slot(seq)
                if len(seq.block_table) > n:
                    kv.update({seq.block_table[-1] * BS + off: None for off in range(BS)})
                if cow is not None:  # what the KV cache's copy_block does
                    src, dst = cow
                    kv.update({dst * BS + off: kv.get(src * BS + off) for off in range(BS)})
                forward(seq)
        elif op == "fork" and live and len(live) < 8:
            parent = rng.choice(live)  # fully computed, as the engine forks after the prefill
            child = Sequence(parent.token_ids)
            alloc.fork(parent, child)
            live.append(child)
        elif op == "free" and live:
            seq = live.pop(rng.randrange(len(live)))
            alloc.free(seq)
            assert seq.block_table == [], f"seed {seed}: free left blocks in the table"
        check_tables(alloc, live)
        for seq in live:
            for pos, slot in enumerate(slots(seq, 0, seq.num_computed_tokens)):
                assert kv.get(slot) == tuple(seq.token_ids[:pos + 1]), \
                    f"seed {seed}: sequence {seq.seq_id}'s token {pos} reads KV of another prefix"
    for seq in live:
        alloc.free(seq)
    check_tables(alloc, [])
    assert alloc.num_free_blocks() == alloc.num_blocks, f"seed {seed}: blocks leaked"


def check_random_runs(impl):
    for seed in range(12):
        check_random_operations(impl, seed)


# ----------------------------------------------------------------------------- the tests
def test_ex04_1_allocate_gives_exact_block_tables(impl):
    check_allocate_exact_tables(impl)


def test_ex04_1_allocate_reuses_prefix_hits(impl):
    check_allocate_prefix_hits(impl)


def test_ex04_1_allocate_refuses_when_the_pool_is_too_full_and_changes_nothing(impl):
    alloc = allocator(impl, num_blocks=4)
    a = Sequence(list(range(3 * BS)))
    alloc.allocate(a)
    b = Sequence(list(range(100, 100 + 2 * BS)))  # needs 2 blocks, 1 is free
    assert not alloc.can_allocate(b)
    with pytest.raises(NanoserveError):
        alloc.allocate(b)
    assert b.block_table == [] and alloc.num_free_blocks() == 1 and alloc.stats.misses == 3
    with pytest.raises(RuntimeError):
        alloc.allocate(a)  # already has blocks
    check_tables(alloc, [a])


def test_ex04_2_append_slot_across_block_boundaries(impl):
    check_append_across_block_boundaries(impl)


def test_ex04_3_free_returns_every_block(impl):
    check_free(impl)


def test_ex04_4_fork_shares_blocks_and_copy_on_write_splits_them(impl):
    check_fork_and_copy_on_write(impl)


def test_ex04_random_operations_against_a_model(impl):
    check_random_runs(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _allocate(share):
    def allocate(self, seq):
        hits, needed, available = self._plan(seq)
        if needed > available:
            raise NanoserveError(f"{needed} blocks needed, {available} available")
        for bid in hits:
            share(self, bid)
        seq.block_table = hits + [self._take_free_block() for _ in range(needed)]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size
        self.stats.hits += len(hits)
        self.stats.misses += needed
    return allocate


def _append_slot(starts_block):
    def append_slot(self, seq):
        table = seq.block_table
        if starts_block(len(table) * self.block_size, len(seq)):
            table.append(self._take_free_block())
            return None
        return self._copy_on_write(table)
    return append_slot


def _never_copies(self, seq):  # wrong: writes into a last block that other tables still read
    table = seq.block_table
    if len(table) * self.block_size == len(seq) - 1:
        table.append(self._take_free_block())
    return None


def _free(shared_too):
    def free(self, seq):
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            if shared_too or block.ref_count == 1:
                block.ref_count -= 1
                if block.ref_count == 0:
                    self._release(block)
        seq.block_table = []
        seq.num_cached_tokens = seq.num_computed_tokens = 0
    return free


def _fork(references):
    def fork(self, parent, child):
        for bid in parent.block_table:
            self.blocks[bid].ref_count += references
        child.block_table = list(parent.block_table)
        child.num_cached_tokens = parent.num_cached_tokens
        child.num_computed_tokens = parent.num_computed_tokens
    return fork


RIGHT = {"allocate": _allocate(nanoserve.engine.block_allocator.BlockAllocator._share),
         "append_slot": _append_slot(lambda covered, n: covered == n - 1),
         "free": _free(shared_too=True), "fork": _fork(references=1)}


def _variant(**wrong):
    """nanoserve's allocator with the four methods above, right unless overridden."""
    base = nanoserve.engine.block_allocator.BlockAllocator
    return SimpleNamespace(BlockAllocator=type("Variant", (base,), {**RIGHT, **wrong}))


def _share_by_hand(self, bid):  # wrong: a hit sitting in the evictable queue stays there
    self.blocks[bid].ref_count += 1


WRONG = {
    "hits shared by hand (left in the evictable "
    "queue)": (_variant(allocate=_allocate(_share_by_hand)),
                                                         [check_allocate_prefix_hits,
                                                          check_random_runs]),
    "new block when the token fills one (off by one)": (
        _variant(append_slot=_append_slot(lambda covered, n: covered == n)),
        [check_append_across_block_boundaries, check_random_runs]),
    "append_slot never copies on write": (_variant(append_slot=_never_copies),
                                          [check_fork_and_copy_on_write, check_random_runs]),
    "free forgets to decrement shared blocks": (_variant(free=_free(shared_too=False)),
                                                [check_free, check_fork_and_copy_on_write,
                                                 check_random_runs]),
    "fork without ref-count increments": (_variant(fork=_fork(references=0)),
                                          [check_fork_and_copy_on_write, check_random_runs]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex04_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex04_the_checks_pass_on_a_right_variant_built_the_same_way():
    """The mutants differ from this one in exactly one place, so their failures are that place's."""
    right = _variant()
    for check in (check_allocate_exact_tables, check_allocate_prefix_hits,
                  check_append_across_block_boundaries,
                  check_free, check_fork_and_copy_on_write, check_random_runs):
        check(right)
