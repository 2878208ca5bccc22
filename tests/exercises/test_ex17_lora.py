"""Exercise 17: many LoRA adapters in one batch (nanoserve/lora/batched.py: lora_segmented,
lora_gathered).

The oracle is outside the functions under test: each row computed alone, x·Aₛᵀ·Bₛᵀ with its own
adapter's unpadded A and B (the single-adapter form that tests/test_lora.py proves against PEFT),
zero for a row without one. Adapters of ranks 2, 4 and 8 share slots of rank 8 (their padding must
change nothing), and the two ways must agree with each other. Known-wrong variants at the end: a row
of slot −1 given adapter 0's update (clamped, not masked), B's factor left out of a segment, and
adapters whose slots were shifted.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from explain import expect, expect_close, explained_failure

import nanoserve.lora.batched as reference

REFERENCE = "nanoserve.lora.batched"
EXERCISE = "lora"
pytestmark = pytest.mark.ex17

IN, OUT, S, R = 24, 40, 4, 8


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    ranks = (2, 4, 8, 3)
    adapters = [(torch.randn(r, IN, generator=g), torch.randn(OUT, r, generator=g)) for r in ranks]
    A, B = torch.zeros(S, R, IN), torch.zeros(S, OUT, R)
    for s, (a, b) in enumerate(adapters):  # zero-padded into slots of rank R
        A[s, :a.shape[0]], B[s, :, :a.shape[0]] = a, b
    x = torch.randn(11, IN, generator=g)
    slots = torch.tensor([0, 1, 2, -1, 1, 0, 2, -1, 0, 1, 3])
    want = torch.stack(
        [
            torch.zeros(OUT) if s < 0 else (row @ adapters[s][0].t()) @ adapters[s][1].t()
            for row, s in zip(x, slots.tolist())
        ]
    )  # each row alone
    return x, A, B, slots, want


def check_segmented(impl):
    x, A, B, slots, want = _case()
    got = impl.lora_segmented(x, A, B, slots, [0, 1, 2, 3])
    case = f"lora_segmented(11 rows, slots {slots.tolist()}, adapters of ranks 2, 4, 8, 3)"
    expect_close(got, want, f"{case} against each row alone", atol=1e-4, rtol=1e-4,
                 dims="row, out")
    # nothing present: zeros
    empty = impl.lora_segmented(x, A, B, slots, [])[0]
    expect(torch.equal(empty, torch.zeros(OUT)), f"{case[:-1]}, present=[]): row 0", "zeros",
           f"values up to {float(empty.abs().max()):.3g}")


def check_gathered(impl):
    x, A, B, slots, want = _case(1)
    got = impl.lora_gathered(x, A, B, slots)
    case = f"lora_gathered(11 rows, slots {slots.tolist()}, adapters of ranks 2, 4, 8, 3)"
    expect_close(got, want, f"{case} against each row alone", atol=1e-4, rtol=1e-4,
                 dims="row, out")
    none = got[slots < 0]  # no adapter: exactly zero
    expect(torch.equal(none, torch.zeros(2, OUT)), f"{case}: the rows with slot -1", "zeros",
           f"values up to {float(none.abs().max()):.3g}")


def test_ex17_1_segmented(impl):
    check_segmented(impl)


def test_ex17_2_gathered(impl):
    check_gathered(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _clamped_not_masked(x, A, B, slots):
    s = slots.clamp(min=0)
    return torch.einsum("nor,nr->no", B[s], torch.einsum("nri,ni->nr", A[s], x))


def _without_b(x, A, B, slots, present):
    out = x.new_zeros(x.shape[0], B.shape[1])
    for s in present:
        rows = (slots == s).nonzero().squeeze(1)
        out.index_add_(0, rows, (x[rows] @ A[s].t()) @ torch.ones(R, B.shape[1]))
    return out


def _shifted(x, A, B, slots, present=None):
    return reference.lora_gathered(x, A.roll(1, 0), B.roll(1, 0), slots)


WRONG = {
    "slot −1 clamped to adapter 0, not masked": (SimpleNamespace(lora_gathered=_clamped_not_masked),
                                                 check_gathered),
    "B left out of each segment": (SimpleNamespace(lora_segmented=_without_b), check_segmented),
    "the slots' adapters shifted by one": (SimpleNamespace(lora_segmented=_shifted,
                                                           lora_gathered=_shifted),
                                           check_gathered),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex17_known_wrong_variants_fail_and_say_why(name):
    wrong, check = WRONG[name]
    explained_failure(check, wrong)


def test_ex17_the_two_ways_agree_on_the_reference():
    x, A, B, slots, _ = _case(2)
    torch.testing.assert_close(reference.lora_segmented(x, A, B, slots, [0, 1, 2, 3]),
                               reference.lora_gathered(x, A, B, slots), rtol=1e-4, atol=1e-4)
