"""Exercise 5: prefix-cache hashing and lookup (nanoserve/engine/block_allocator.py:
default_block_hash, BlockAllocator._prefix_hits).

Oracles: hand-worked prompts made of whole blocks (X, Y, Z, W), whose hits are known without the
code; a hash function that collides on every block (a constant), under which only the exact check
keeps hits right; and random runs against a model: with nanoserve's hash (no collisions at this
size) and a pool too large to evict, a prompt's hits are exactly its longest run of leading full
blocks whose prefix some forward has computed, never the block holding its last token — and,
whatever the hash, a hit's simulated KV is the KV of exactly this prompt's prefix.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
from explain import explained_failure

import nanoserve.engine.block_allocator
from nanoserve.engine.sequence import Sequence

REFERENCE = "nanoserve.engine.block_allocator"
EXERCISE = "block_allocator"
pytestmark = pytest.mark.ex05

BS = 4
X, Y, Z, W = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]  # one block each
EX04 = ("allocate", "append_slot", "free", "fork")
HASH_FNS = {
    "nanoserve's": None,
    # frequent collisions
    "mod 3": lambda parent,
    tokens: nanoserve.engine.block_allocator.default_block_hash(parent, tokens) % 3,
    "constant": lambda parent, tokens: 7,  # every block collides with every other
}


def allocator(impl, num_blocks=16, given=EX04, **kwargs):
    """impl's BlockAllocator with the methods in `given` (exercise 4's by default) taken from
    nanoserve, so that exercise 5 can be done first. The inherited constructor's default hash_fn is
    nanoserve's."""
    ref = nanoserve.engine.block_allocator.BlockAllocator
    cls = type("Allocator", (impl.BlockAllocator,), {name: getattr(ref, name) for name in given})
    return cls(num_blocks, BS, **kwargs)


def compute(alloc, seq) -> None:
    """The engine's forward: every token of `seq` now has KV; mark_computed registers its full
    blocks."""
    seq.num_computed_tokens = len(seq)
    alloc.mark_computed(seq)


def admit(alloc, tokens) -> Sequence:
    seq = Sequence(tokens)
    alloc.allocate(seq)
    compute(alloc, seq)
    return seq


def chain(hash_fn, tokens) -> list[int]:
    """The chained hash of every full block of `tokens`."""
    hashes, parent = [], None
    for j in range(len(tokens) // BS):
        parent = hash_fn(parent, tuple(tokens[j * BS:(j + 1) * BS]))
        hashes.append(parent)
    return hashes


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_hash_is_a_deterministic_int(impl):
    h = impl.default_block_hash
    for parent in (None, 0, 12345, -(2 ** 62)):
        first, again = h(parent, (1, 2, 3, 4)), h(parent, tuple([1, 2, 3, 4]))
        assert isinstance(first, int) and first == again, (
            f"default_block_hash({parent}, (1, 2, 3, 4)) twice: expected the same int, got "
            f"{first!r} and {again!r}")
    forward, backward = h(None, (1, 2, 3, 4)), h(None, (4, 3, 2, 1))
    assert forward != backward, (
        "default_block_hash(None, (1, 2, 3, 4)) and (None, (4, 3, 2, 1)): expected two hashes "
        f"(token order changes the KV), got {forward} for both")
    blocks = list(itertools.product(range(5), repeat=4))
    for parent in (None, 99):
        distinct = len({h(parent, t) for t in blocks})
        assert distinct == len(blocks), (
            f"default_block_hash({parent}, each of the {len(blocks)} blocks of 4 tokens from "
            f"0..4): expected {len(blocks)} distinct hashes, got {distinct}")


def check_hash_chains(impl):
    """A block's hash covers its prefix: equal tokens after different blocks hash differently."""
    h = impl.default_block_hash
    a, b, c = chain(h, X + Y + Z), chain(h, X + Y + W), chain(h, W + Y + Z)
    assert a[:2] == b[:2] and a[2] != b[2], (
        f"the chained hashes of X·Y·Z and X·Y·W: expected the first two equal and the third "
        f"different, got {a} and {b}")
    assert a[1] != c[1] and a[2] != c[2], (
        f"the chained hashes of X·Y·Z and W·Y·Z: expected Y and Z after W to hash differently from "
        f"Y and Z after X, got {a} and {c}")
    parents = [None, 0, 1, 2, 99, 2 ** 40, *a]
    distinct = len({h(p, tuple(Y)) for p in parents})
    assert distinct == len(parents), (
        f"default_block_hash(parent, Y) for {len(parents)} different parents: expected "
        f"{len(parents)} distinct hashes (the hash depends on the parent), got {distinct}")


def check_hash_in_the_allocator(impl):
    """With your hash (and nanoserve's lookup), Y after X and Y after Z are both cached."""
    alloc = allocator(impl, given=EX04 + ("_prefix_hits",), hash_fn=impl.default_block_hash)
    a, c = admit(alloc, X + Y + [0]), admit(alloc, Z + Y + [0])
    for prompt, owner in [(X + Y + [1], a), (Z + Y + [1], c)]:
        seq = Sequence(prompt)
        alloc.allocate(seq)
        assert seq.num_cached_tokens == 2 * BS and seq.block_table[:2] == owner.block_table[:2], (
            f"allocate({prompt}) with your hash: expected 2 hits (both blocks of sequence "
            f"{owner.seq_id}), got {seq.num_cached_tokens // BS}")
    alloc.check_invariants()


def check_identical_prompt_reuses_blocks(impl):
    alloc = allocator(impl)
    a = Sequence(X + Y + Z + [0])
    alloc.allocate(a)
    early = Sequence(a.token_ids)
    alloc.allocate(early)
    assert early.num_cached_tokens == 0, (
        "nothing is a hit before mark_computed: no KV is written yet"
    )
    alloc.free(early)
    compute(alloc, a)
    b = Sequence(a.token_ids)
    alloc.allocate(b)
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] not in a.block_table
    assert b.num_cached_tokens == b.num_computed_tokens == 3 * BS
    assert [alloc.blocks[bid].ref_count for bid in a.block_table] == [2, 2, 2, 1]
    a_table = list(a.block_table)
    alloc.free(a)
    alloc.free(b)
    c = Sequence(a.token_ids)  # its blocks are free now, but still cached
    alloc.allocate(c)
    assert c.block_table[:3] == a_table[:3] and c.num_cached_tokens == 3 * BS
    alloc.check_invariants()


def check_hits_stop_at_the_first_miss(impl):
    alloc = allocator(impl)
    a = admit(alloc, X + Y + Z + [0])
    b = Sequence(X + Y + W + Z + [0])
    alloc.allocate(b)
    assert b.num_cached_tokens == 2 * BS and b.block_table[:2] == a.block_table[:2], (
        "allocate(X·Y·W·Z) after X·Y·Z is cached: expected 2 hits (X and Y; W misses, and Z after "
        f"X·Y·W is not cached), got {b.num_cached_tokens // BS}")
    # X hits; W misses; Y after X·W is not Y after X, whatever the lookup's parent
    d = Sequence(X + W + Y + [0])
    alloc.allocate(d)
    assert d.num_cached_tokens == BS, (
        "allocate(X·W·Y) after X·Y·Z is cached: expected 1 hit (only X has this prefix), got "
        f"{d.num_cached_tokens // BS}")
    assert d.block_table[0] == a.block_table[0] and not set(d.block_table[1:]) & set(a.block_table)
    alloc.check_invariants()


def check_never_the_last_block(impl):
    """The last prompt token must go through the model (its logits give the first output token)."""
    alloc = allocator(impl)
    a = admit(alloc, X + Y)  # two full blocks, both cached
    for prompt, hits in [(X + Y, 1), (X, 0), (X + Y + [5], 2), (X + [5], 1)]:
        seq = Sequence(prompt)
        alloc.allocate(seq)
        assert seq.num_cached_tokens == hits * BS < len(seq), (
            f"allocate({len(prompt)} tokens) after X·Y is cached (the last token's block is never "
            f"a hit): expected {hits} hits, got {seq.num_cached_tokens // BS}")
        assert seq.block_table[:hits] == a.block_table[:hits]
        alloc.free(seq)
    alloc.check_invariants()


def check_collisions_are_harmless(impl):
    """hash_fn returns 7 for every block: a lookup finds a candidate, the exact check decides."""
    alloc = allocator(impl, hash_fn=HASH_FNS["constant"])
    a = admit(alloc, X + Y + [0])  # X registered under 7; Y collides and is not registered
    for prompt, hits in [(Y + X + [0], 0),  # same hash as X, other tokens
                         (X + X + [0], 1),  # block 1 has X's tokens, but not X's prefix
                         # block 1's hash is taken by X: a miss, never a wrong hit
                         (X + Y + [0], 1)]:
        seq = Sequence(prompt)
        alloc.allocate(seq)
        assert seq.num_cached_tokens == hits * BS, (
            f"allocate({prompt}) with a hash that returns 7 for every block: expected {hits} hits "
            f"(the exact check decides), got {seq.num_cached_tokens // BS}")
        assert seq.block_table[:hits] == a.block_table[:hits] and not set(
            seq.block_table[hits:]
        ) & set(a.block_table)
        compute(alloc, seq)
    alloc.check_invariants()


def check_random_prompts(impl, hash_name, seeds=range(8)):
    """Random prompts from four blocks, computed in chunks, decoded and freed, against the model of
    the module docstring (exact hit counts with nanoserve's hash, at most those with a colliding
    one)."""
    for seed in seeds:
        _random_run(impl, hash_name, seed)


def _random_run(impl, hash_name, seed, num_ops=80):
    rng, exact = random.Random(seed), HASH_FNS[hash_name] is None
    alloc = allocator(impl, num_blocks=512, hash_fn=HASH_FNS[hash_name])
    live: list[Sequence] = []
    kv: dict[int, tuple[int, ...] | None] = {}  # slot -> the prefix whose KV it holds
    # prefixes, ending at a block boundary, some forward computed
    computed: set[tuple[int, ...]] = set()

    def forward(seq, upto):
        for pos, slot in enumerate(alloc.slot_mapping(seq, seq.num_computed_tokens, upto),
                                   seq.num_computed_tokens):
            kv[slot] = tuple(seq.token_ids[:pos + 1])
        seq.num_computed_tokens = upto
        alloc.mark_computed(seq)
        computed.update(tuple(seq.token_ids[:(i + 1) * BS]) for i in range(upto // BS))

    for _ in range(num_ops):
        op = rng.choice(["add", "add", "compute", "append", "free"])
        if op == "add" and len(live) < 6:
            tokens = [t for _ in range(rng.randint(0, 4)) for t in rng.choice([X, Y, Z, W])]
            tokens += rng.choice([X, Y])[:rng.randint(0 if tokens else 1, 3)]
            seq = Sequence(tokens)
            alloc.allocate(seq)
            want = 0
            while want < (len(seq) - 1) // BS and tuple(tokens[:(want + 1) * BS]) in computed:
                want += 1
            got = seq.num_cached_tokens // BS
            msg = f"seed {seed}, {hash_name} hash, prompt {tokens}"
            bound = "" if exact else "at most "
            assert got == want if exact else got <= want, (
                f"{msg}: expected {bound}{want} hits (its cached prefix blocks), got {got}")
            for pos, slot in enumerate(alloc.slot_mapping(seq, 0, seq.num_cached_tokens)):
                assert kv.get(slot) == tuple(tokens[: pos + 1]), (
                    f"{msg}: slot {slot} of a hit: expected the KV of the prefix "
                    f"{tokens[: pos + 1]}, got that of {kv.get(slot)}")
            for bid in seq.block_table[got:]:
                kv.update({bid * BS + off: None for off in range(BS)})
            live.append(seq)
        elif op == "compute" and live:  # a chunk of a prefill
            seq = rng.choice(live)
            forward(seq, min(len(seq), seq.num_computed_tokens + rng.randint(1, 6)))
        elif op == "append" and live:  # a decode step, after the whole prompt
            seq = rng.choice(live)
            forward(seq, len(seq))
            seq.append_token(rng.choice(X + Y))
            alloc.append_slot(seq)
            if len(seq) % BS == 1:  # the token started a fresh block
                kv.update({seq.block_table[-1] * BS + off: None for off in range(BS)})
            forward(seq, len(seq))
        elif op == "free" and live:
            alloc.free(live.pop(rng.randrange(len(live))))
    assert alloc.free_block_ids, "the pool was meant to be large enough never to evict"
    alloc.check_invariants()


def check_random_runs(impl):
    for name in HASH_FNS:
        check_random_prompts(impl, name)


# ----------------------------------------------------------------------------- the tests
def test_ex05_1_block_hash_is_a_deterministic_int_that_sees_every_token(impl):
    check_hash_is_a_deterministic_int(impl)


def test_ex05_1_block_hash_chains_through_the_parent(impl):
    check_hash_chains(impl)


def test_ex05_1_equal_blocks_after_different_prefixes_are_both_cached(impl):
    check_hash_in_the_allocator(impl)


def test_ex05_2_an_identical_prompt_reuses_the_blocks_after_mark_computed(impl):
    check_identical_prompt_reuses_blocks(impl)


def test_ex05_2_hits_stop_at_the_first_miss(impl):
    check_hits_stop_at_the_first_miss(impl)


def test_ex05_2_never_the_block_holding_the_last_token(impl):
    check_never_the_last_block(impl)


def test_ex05_2_a_colliding_hash_gives_no_wrong_hit(impl):
    check_collisions_are_harmless(impl)


@pytest.mark.parametrize("hash_name", list(HASH_FNS))
def test_ex05_2_random_prompts_hit_exactly_what_is_cached(impl, hash_name):
    check_random_prompts(impl, hash_name)


# ----------------------------------------------------------------------------- known-wrong variants
def _hash(key):
    def default_block_hash(parent_hash, token_ids):
        return hash(key(parent_hash, token_ids))
    return default_block_hash


def _lookup(max_hits=lambda self, n: (n - 1) // self.block_size, at_miss="stop", exact=True):
    def _prefix_hits(self, seq):
        hits, parent = [], None
        for i in range(max_hits(self, len(seq)) if self.enable_prefix_caching else 0):
            tokens = self._block_tokens(seq, i)
            bid = self.hash_to_block.get(self.hash_fn(parent.hash if parent else None, tokens))
            if bid is None or (exact and not self._matches(self.blocks[bid], tokens, parent)):
                if at_miss == "stop":
                    break
                continue
            hits.append(bid)
            parent = self.blocks[bid]
        return hits
    return _prefix_hits


RIGHT_KEY = lambda parent, tokens: (tokens,) if parent is None else (parent, tokens)
RIGHT_LOOKUP = _lookup()


def _variant(key=RIGHT_KEY, lookup=RIGHT_LOOKUP):
    cls = type("Variant", (nanoserve.engine.block_allocator.BlockAllocator,),
               {"_prefix_hits": lookup})
    return SimpleNamespace(default_block_hash=_hash(key), BlockAllocator=cls)


HASH_CHECKS = [check_hash_is_a_deterministic_int, check_hash_chains, check_hash_in_the_allocator]
LOOKUP_CHECKS = [check_identical_prompt_reuses_blocks, check_hits_stop_at_the_first_miss,
                 check_never_the_last_block,
                 check_collisions_are_harmless, check_random_runs]
WRONG = {
    "hash ignoring the parent": (_variant(key=lambda parent, tokens: tokens),
                                 [check_hash_chains, check_hash_in_the_allocator]),
    "hash blind to token order": (_variant(key=lambda parent,
                                           tokens: (parent, tuple(sorted(tokens)))),
                                  [check_hash_is_a_deterministic_int]),
    "lookup not stopping at the first miss": (_variant(lookup=_lookup(at_miss="skip")),
                                              [check_hits_stop_at_the_first_miss,
                                               check_random_runs]),
    "lookup that can return the last "
    "block": (_variant(lookup=_lookup(max_hits=lambda self, n: n // self.block_size)),
                                              [check_never_the_last_block, check_random_runs]),
    "lookup trusting the hash (no exact check)": (_variant(lookup=_lookup(exact=False)),
                                                  [check_collisions_are_harmless,
                                                   check_random_runs]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex05_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex05_the_checks_pass_on_a_right_variant_built_the_same_way():
    """The mutants differ from this one in exactly one place, so their failures are that place's."""
    right = _variant()
    for check in HASH_CHECKS + LOOKUP_CHECKS:
        check(right)
