"""Exercise 23: which KV blocks StreamingLLM and SnapKV keep (nanoserve/engine/kv_eviction.py:
streaming_kept_blocks, snapkv_kept_blocks).

Oracles: blocks listed by hand from the definitions for small cases (a partial last block, a full
one, a window that reaches the sinks, fewer tokens than the sinks), and a brute-force check over
every length up to 80 tokens that the kept set is the sinks ∪ the last W full blocks ∪ the partial
one. SnapKV: hand-made scores where the best blocks are not the newest, ties, and a budget taken by
the forced blocks. Known-wrong variants (sinks dropped, the window counted in tokens, the block
being filled counted as full, the recent blocks kept instead of the best-scored) must fail.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from explain import expect, explained_failure

REFERENCE = "nanoserve.engine.kv_eviction"
EXERCISE = "kv_eviction"
pytestmark = pytest.mark.ex23


def _by_definition(n, bs, sinks, window):
    full = n // bs
    kept = set(range(min(sinks, full))) | set(range(max(full - window, 0), full))
    if n % bs:
        kept.add(full)
    return sorted(kept)


def check_streaming_by_hand(impl):
    cases = [  # (tokens, block size, sinks, window) -> blocks
        ((30, 4, 1, 3), [0, 4, 5, 6, 7]), ((32, 4, 1, 3), [0, 5, 6, 7]),
        ((17, 4, 1, 3), [0, 1, 2, 3, 4]), ((3, 4, 2, 3), [0]), ((40, 8, 2, 1), [0, 1, 4]),
        ((41, 8, 0, 2), [3, 4, 5]),
    ]
    for args, want in cases:
        got = impl.streaming_kept_blocks(*args)
        expect(list(got) == want, f"streaming_kept_blocks{args}", want, got)


def check_streaming_every_length(impl):
    for bs in (1, 4, 8):
        for n in range(0, 81):
            for sinks, window in ((0, 2), (1, 3), (2, 1)):
                got = list(impl.streaming_kept_blocks(n, bs, sinks, window))
                want = _by_definition(n, bs, sinks, window)
                expect(got == want, f"streaming_kept_blocks({n}, {bs}, {sinks}, {window})",
                       want, got)


def check_snapkv_by_hand(impl):
    # 10 tokens of block 4 → blocks 0, 1 full, 2 partial; a longer one: 26 tokens, 6 full blocks
    scores = [5.0, 0.1, 9.0, 0.2, 3.0, 0.0, 0.0]
    cases = [  # (scores, prompt, bs, sinks, budget, window) -> blocks
        ((scores, 26, 4, 1, 4, 4), [0, 2, 4, 5, 6]),  # forced 0, 5, 6; room 4 − 2 = 2 → 2, 4
        ((scores, 26, 4, 0, 3, 4), [0, 2, 5, 6]),  # room 3 − 1: the best two of 0..4
        (([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0], 26, 4, 0, 3, 4), [0, 1, 5, 6]),  # ties: earlier
        ((scores, 26, 4, 1, 1, 8), [0, 4, 5, 6]),  # the forced blocks exceed the budget
        ((scores[:3], 10, 4, 1, 2, 2), [0, 1, 2]),
    ]
    for args, want in cases:
        got = impl.snapkv_kept_blocks(*args)
        expect(list(got) == want, f"snapkv_kept_blocks{args[1:]} with scores {args[0]}", want,
               got)


def test_ex23_1_streaming_by_hand(impl):
    check_streaming_by_hand(impl)


def test_ex23_1_streaming_every_length(impl):
    check_streaming_every_length(impl)


def test_ex23_2_snapkv_by_hand(impl):
    check_snapkv_by_hand(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _streaming(drop_sinks=False, window_in_tokens=False, partial_is_full=False):
    def streaming_kept_blocks(n, bs, sinks, window):
        full = -(-n // bs) if partial_is_full else n // bs
        if window_in_tokens:  # wrong: the blocks that overlap the last `window` TOKENS
            first = max(n - window, 0) // bs
            kept = set(range(first, -(-n // bs)))
        else:
            kept = set(range(max(full - window, 0), full))
            if n % bs and not partial_is_full:
                kept.add(full)
        if not drop_sinks:
            kept |= set(range(min(sinks, -(-n // bs))))
        return sorted(kept)

    return SimpleNamespace(streaming_kept_blocks=streaming_kept_blocks)


def _snapkv_recent():
    def snapkv_kept_blocks(scores, n, bs, sinks, budget, window):
        full = n // bs
        forced = set(range(min(sinks, full))) | set(range(max(n - window, 0) // bs, -(-n // bs)))
        others = [i for i in range(full) if i not in forced]
        room = max(budget - sum(i < full for i in forced), 0)
        return sorted(forced | set(others[len(others) - room:] if room else []))

    return SimpleNamespace(snapkv_kept_blocks=snapkv_kept_blocks)


STREAMING_CHECKS = [check_streaming_by_hand, check_streaming_every_length]
WRONG = {
    "the sink blocks dropped": (_streaming(drop_sinks=True), STREAMING_CHECKS),
    "the window counted in tokens, not full blocks": (_streaming(window_in_tokens=True),
                                                      STREAMING_CHECKS),
    "the block being filled counted as a full block": (_streaming(partial_is_full=True),
                                                       STREAMING_CHECKS),
    "SnapKV keeping the newest blocks, not the best-scored": (_snapkv_recent(),
                                                              [check_snapkv_by_hand]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex23_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex23_the_checks_pass_on_a_right_variant_built_the_same_way():
    right = _streaming()
    for check in STREAMING_CHECKS:
        check(right)
