"""explain.py, the exercise tests' comparisons: their messages name the case, the expected and the
actual values in a few lines, NaNs counted; and the rule that checks a message explains itself
rejects the messages a bare assert or torch.testing gives (the negative controls)."""

from __future__ import annotations

import pytest
import torch
from explain import expect_close, expect_equal, explanation_problems, own_lines


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(AssertionError) as failure:
        fn(*args, **kwargs)
    return str(failure.value)


def test_a_short_vector_is_shown_whole():
    message = _message(expect_close, torch.tensor([0.0, 0.4, 0.0, 0.3]),
                       torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]), "top_p=0.65", atol=1e-6)
    assert message.splitlines() == ["top_p=0.65:", "  expected [0, 0.571429, 0, 0.428571]",
                                    "  got      [0, 0.4, 0, 0.3]",
                                    "  2 of 4 values off by more than 1e-06"]
    assert explanation_problems(message) == []


def test_a_big_tensor_shows_its_worst_element_and_counts_its_nans():
    want = torch.zeros(2, 7, 4, 8)
    got = want.clone()
    got[1, 3, 2, 5] = 0.5
    got[0, 6] = float("nan")  # a row that softmaxed over nothing but -inf
    message = _message(expect_close, got, want, "a prefill", atol=1e-5, dims="b, t, h, d")
    assert "got NaN in 32 of 448 values (first at [b, t, h, d] = [0, 6, 0, 0])" in message
    assert "worst at [b, t, h, d] = [0, 6, 0, 0]: expected 0, got nan" in message
    assert "33 of 448 values off" in message
    assert "nan, nan" not in message and len(message.splitlines()) == 4
    assert expect_close(want, want.clone(), "equal", atol=0) is None


def test_rows_and_shapes():
    got = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    want = torch.tensor([[1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    message = _message(expect_equal, got, want, "a mask", rows=("query", "queries"), dims="t")
    assert message.splitlines() == ["a mask: 2 of 2 queries differ; the first, query [t] = [0]:",
                                    "  expected 100", "  got      110"]
    assert "expected shape (2, 3), got (3, 2)" in _message(expect_equal, got.t(), want, "a mask")
    assert "expected dtype torch.bool, got torch.int64" in _message(expect_equal, got.long(), want,
                                                                    "a mask")


def test_negative_controls_messages_that_do_not_explain():
    bare = ""
    with pytest.raises(AssertionError) as testing:
        torch.testing.assert_close(torch.zeros(3), torch.ones(3))
    dumped = f"expected {torch.full((20,), float('nan'))}, got {torch.zeros(20)}"
    assert "no message at all" in explanation_problems(bare)
    assert explanation_problems(str(testing.value)) == ["no 'expected'", "no 'got'"]
    assert explanation_problems(dumped) == ["a tensor printed whole"]


def test_pytests_introspection_is_not_the_messages_own_text():
    """Under CI=true pytest appends a full diff to `assert cond, msg`; the message's own lines are
    judged, and a tensor anywhere still fails."""
    message = ("fork: expected (2, 2), got (1, 1)\nassert (1, 1) == (2, 2)\n  \n  At index 0 diff"
               + "\n  +     1," * 14)
    assert own_lines(message) == ["fork: expected (2, 2), got (1, 1)"]
    assert explanation_problems(message) == []
    dumped = "x: expected 0, got 1\nassert tensor([1., 1.]) == tensor([0., 0.])"
    assert explanation_problems(dumped) == ["a tensor printed whole"]
