"""Perplexity windows and the acceptance statistic, on small exact cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nanoserve import NanoserveError
from nanoserve.models.loader import load_model
from nanoserve.tools.evaluate import PerplexityResult, perplexity, plan_windows, read_text


@given(st.integers(2, 400), st.integers(2, 64), st.data(), st.booleans())
def test_every_token_scored_exactly_once(n, budget, data, add_bos):
    stride = data.draw(st.integers(1, budget if add_bos else budget - 1))
    scored = []
    for begin, end, first in plan_windows(n, budget, stride, add_bos):
        assert end - begin <= budget and begin <= first <= end
        # a target always has its prediction in the window
        assert first >= begin + (0 if add_bos else 1)
        scored += range(first, end)
    assert scored == list(range(0 if add_bos else 1, n))


def test_perplexity_equals_direct_sum(hf_checkpoints):
    """Non-overlapping windows (no BOS, context 64, stride 63): each window scores its last 63
    tokens from the token before them; the NLL equals a hand-written sum."""
    model, cfg, tok = load_model(hf_checkpoints["gpt2"][0])
    text = "The quick brown fox jumps over the lazy dog. " * 6  # 270 bytes = 270 tokens
    res = perplexity(model, tok, text, context=64, stride=63, batch_size=3, progress=False)
    ids = tok.encode(text)
    total = 0.0
    with torch.no_grad():
        for first in range(1, len(ids), 63):
            end = min(first + 63, len(ids))
            begin = max(0, end - 64)
            logp = model(torch.tensor([ids[begin:end]]))[0].log_softmax(-1)  # T, V
            total -= sum(logp[j - begin - 1, ids[j]].item() for j in range(first, end))
    assert res.n_windows == 5 and res.n_tokens == 269
    assert math.isclose(res.nll_sum, total, rel_tol=1e-5)
    # more overlap gives scored tokens more history, which changes the sum
    overlap = perplexity(model, tok, text, context=64, stride=16, progress=False)
    assert overlap.n_tokens == 269 and not math.isclose(overlap.nll_sum, total, rel_tol=1e-5)


def test_result_units():
    r = PerplexityResult(nll_sum=20.0, n_tokens=10, n_bytes=40, n_windows=1, context=8, stride=8)
    assert r.nats_per_token == 2.0 and r.nats_per_byte == 0.5
    assert r.bits_per_byte == pytest.approx(0.5 / math.log(2)) and r.perplexity == pytest.approx(
        math.e**2
    )


def test_bad_eval_inputs(tmp_path, hf_checkpoints):
    model, cfg, tok = load_model(hf_checkpoints["gpt2"][0])
    with pytest.raises(NanoserveError, match="does not exist"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(NanoserveError, match="is empty"):
        read_text(tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(NanoserveError, match="not UTF-8 \\(invalid byte at offset 3\\)"):
        read_text(tmp_path / "latin1.txt")
    with pytest.raises(NanoserveError, match="context=512 is outside 2..256"):
        perplexity(model, tok, "hello world", context=512, progress=False)
