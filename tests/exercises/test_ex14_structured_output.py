"""Exercise 14: a grammar as a token mask (nanoserve/engine/structured_output.py: apply_bitmask,
mask_verification).

Oracles: a bit-by-bit unpacking written here with Python integers (not torch's shifts), and Python's
`regex` module with partial matching, which decides by itself which bytes may follow a prefix of a
regex — independent of llguidance, which computes the masks the code applies. Known-wrong variants
at the end: the bits of each word read from the most significant end, a sign test instead of a bit
test, masks one position late in verification, and a matcher left advanced after verification.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import regex
import torch
from explain import expect, explained_failure

pytest.importorskip("llguidance")

from nanoserve.engine.structured_output import (  # noqa: E402
    GrammarCompiler,
    StructuredOutputsParams,
    token_bitmask,
)
from nanoserve.tokenizers import byte_level_tokenizer  # noqa: E402

REFERENCE = "nanoserve.engine.structured_output"
EXERCISE = "structured_output"
pytestmark = pytest.mark.ex14

V = 257  # the demo's byte vocabulary + EOS (256)
PATTERN = r"(ab|cd)+[0-9]{2}"


def _bits_by_hand(bitmask: torch.Tensor, vocab: int) -> list[list[bool]]:
    """Bit b of word w, least significant first, with Python integers (two's complement words)."""
    return [
        [bool(((int(row[t // 32]) & 0xFFFFFFFF) >> (t % 32)) & 1) for t in range(vocab)]
        for row in bitmask
    ]


def _allowed_by_regex(prefix: str) -> list[bool]:
    ok = [t < 256 and regex.fullmatch(PATTERN, prefix + chr(t),
                                      partial=True) is not None for t in range(V)]
    ok[256] = regex.fullmatch(PATTERN, prefix) is not None  # EOS once the text is complete
    return ok


def _matcher():
    return GrammarCompiler(byte_level_tokenizer(), V,
                           256).matcher(StructuredOutputsParams(regex=PATTERN))


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def _expect_allowed(got: list[bool], prefix: str, case: str) -> None:
    """The tokens `got` allows are those the regex allows after `prefix`; else the first that
    differs, by character."""
    want = _allowed_by_regex(prefix)
    if got != want:
        token = next(t for t, (a, b) in enumerate(zip(got, want)) if a != b)
        raise AssertionError(f"{case}: token {token} ({chr(token)!r}) after {prefix!r}: expected "
                             f"{'allowed' if want[token] else 'refused'}, got "
                             f"{'allowed' if got[token] else 'refused'}")


def check_apply_bitmask(impl):
    g = torch.Generator().manual_seed(0)
    for vocab in (5, 32, 33, 64, 257):
        W = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31, (3, W), generator=g,
                                dtype=torch.int64).to(torch.int32)
        bitmask[0, 0] = -1  # every bit set, bit 31 included
        bitmask[1, -1] = 1 << 0  # one low bit
        logits = torch.randn(3, vocab, generator=g)
        before = logits.clone()
        out = impl.apply_bitmask(logits, bitmask)
        want = torch.tensor(_bits_by_hand(bitmask, vocab))
        case = f"apply_bitmask(logits [3, {vocab}], random words [3, {W}])"
        banned = out == float("-inf")
        if not torch.equal(banned, ~want):
            row, token = ((banned != ~want).nonzero()[0]).tolist()
            word, bit = divmod(token, 32)
            raise AssertionError(
                f"{case}: row {row}, token {token} (bit {bit} of word {word}, word "
                f"0x{int(bitmask[row, word]) & 0xFFFFFFFF:08x}): expected "
                f"{'allowed' if want[row, token] else '-inf'}, got "
                f"{'-inf' if banned[row, token] else 'allowed'}")
        expect(torch.equal(out[want], logits[want]), f"{case}: the allowed tokens' logits",
               "unchanged", "changed")
        expect(torch.equal(logits, before), f"{case}: the input logits", "left as they were",
               "modified in place")


def check_masks_follow_the_regex(impl):
    matcher, prefix = _matcher(), ""
    for token in [ord(c) for c in "abcdab12"]:
        allowed = impl.apply_bitmask(torch.zeros(1, V), token_bitmask([matcher], V))[0] == 0
        _expect_allowed(allowed.tolist(), prefix, f"the mask after {prefix!r}")
        assert matcher.consume_token(token)
        prefix += chr(token)


def check_verification(impl):
    matcher = _matcher()
    assert matcher.consume_tokens([ord("a"), ord("b")])
    logits = torch.zeros(5, V)
    for drafts, prefixes in [("cd1", ["ab", "abc", "abcd", "abcd1"]),  # all legal
                             # 'x' refused: later rows as at the refusal
                             ("cx1", ["ab", "abc", "abc", "abc"])]:
        out = impl.mask_verification(matcher, [ord(c) for c in drafts], logits[:len(drafts) + 1])
        for j, prefix in enumerate(prefixes):
            _expect_allowed((out[j] == 0).tolist(), prefix,
                            f"mask_verification(after 'ab', drafts {drafts!r}), position {j}")
        # the matcher ends where it began: the next token is judged after "ab"
        after = impl.apply_bitmask(torch.zeros(1, V), token_bitmask([matcher], V))[0] == 0
        _expect_allowed(after.tolist(), "ab", f"the matcher after mask_verification(drafts "
                        f"{drafts!r}): rolled back to where it began")
    assert impl.mask_verification(None, [1, 2], logits[:3]) is logits[:3] or torch.equal(
        impl.mask_verification(None, [1, 2], logits[:3]), logits[:3])


# ----------------------------------------------------------------------------- the tests
def test_ex14_1_apply_bitmask_unpacks_every_bit(impl):
    check_apply_bitmask(impl)


def test_ex14_1_masks_allow_what_the_regex_can_continue_with(impl):
    check_masks_follow_the_regex(impl)


def test_ex14_2_verification_masks_each_draft_position(impl):
    check_verification(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _variant(msb_first=False, sign_test=False, late=False, no_rollback=False):
    def apply_bitmask(logits, bitmask):
        bits = torch.arange(32, dtype=torch.int32)
        if msb_first:  # wrong: bit 0 read as the most significant
            bits = 31 - bits
        words = bitmask[:, :, None]
        # wrong: sign
        allowed = ((words >> bits) & 1).bool() if not sign_test else ((words >> bits) > 0)
        allowed = allowed.flatten(1)[:, :logits.shape[-1]]
        return logits.masked_fill(~allowed, float("-inf"))

    def mask_verification(matcher, draft_ids, logits):
        if matcher is None:
            return logits
        steps, consumed = [], 0
        for j in range(len(draft_ids) + 1):
            # wrong: mask after
            if late and j < len(draft_ids) and matcher.try_consume_tokens([draft_ids[j]]) == 1:
                consumed += 1
                steps.append(token_bitmask([matcher], logits.shape[-1]))
                continue
            steps.append(token_bitmask([matcher], logits.shape[-1]))
            if j == len(draft_ids) or matcher.try_consume_tokens([draft_ids[j]]) != 1:
                break
            consumed += 1
        steps += [steps[-1]] * (len(draft_ids) + 1 - len(steps))
        if not no_rollback:
            matcher.rollback(consumed)
        return apply_bitmask(logits, torch.cat(steps[:len(draft_ids) + 1]))

    return SimpleNamespace(apply_bitmask=apply_bitmask, mask_verification=mask_verification)


WRONG = {
    "bits read from the most significant end": (_variant(msb_first=True), [check_apply_bitmask]),
    "a sign test instead of a bit test": (_variant(sign_test=True), [check_apply_bitmask]),
    "each position masked after its own draft": (_variant(late=True), [check_verification]),
    "the matcher left advanced": (_variant(no_rollback=True), [check_verification]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex14_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex14_the_checks_pass_on_a_right_variant_built_the_same_way():
    right = _variant()
    for check in (check_apply_bitmask, check_masks_follow_the_regex, check_verification):
        check(right)
