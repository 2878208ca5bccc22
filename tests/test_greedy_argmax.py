"""`greedy_argmax` (engine/sampler.py) against torch.argmax and torch.amax, its reference: the same
index for every row, ties and NaN included, and the engine's greedy sampler with it (NaN rows still
flagged)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.engine.sampler import SamplingParams, greedy_argmax, sample_batch


def _rows(V: int, seed: int) -> torch.Tensor:
    """Rows with what breaks a chunked argmax: ties across chunks, the maximum at either end or on a
    chunk boundary, a row all −inf, a row with NaN, plain noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, V, generator=g)
    # many ties of the maximum, in every chunk
    x[0] = torch.randint(0, 3, (V,), generator=g).float()
    x[1, -1] = 50.0  # at the very end (in the shorter last chunk)
    x[2, 0] = 50.0
    x[3, min(511, V - 2)], x[3, min(512, V - 1)] = 50.0, 50.0  # on a chunk boundary, tied
    x[4] = float("-inf")
    x[5, min(700, V - 1)] = float("nan")
    x[6, 3], x[6, V - 2] = float("inf"), float("inf")
    x[7] = 0.0
    return x


@pytest.mark.parametrize("V", [50257, 2048, 1500, 1024, 300])
@pytest.mark.parametrize("chunk", [512, 256])
def test_greedy_argmax_equals_torch_argmax(V, chunk):
    for seed in range(3):
        x = _rows(V, seed)
        idx, maxima = greedy_argmax(x, chunk)
        assert torch.equal(idx, x.argmax(-1))
        torch.testing.assert_close(maxima, x.amax(-1), equal_nan=True, atol=0, rtol=0)


def test_the_ties_tell_first_from_last():
    """Control: on these rows, taking the *last* maximum (a chunked argmax that scans its chunks
    from the end, say) gives other indices than torch.argmax, so the test above would see a wrong
    tie rule."""
    x = _rows(50257, 0)
    last = x.shape[1] - 1 - x.flip(-1).argmax(-1)
    assert not torch.equal(last, x.argmax(-1))
    assert (last != x.argmax(-1))[[0, 3, 6, 7]].all()


def test_greedy_sampler_uses_it_and_still_flags_nan():
    x = _rows(50257, 1)
    params = [SamplingParams(temperature=0)] * len(x)
    tokens, nan = sample_batch(x, params, [None] * len(x), [None] * len(x))
    assert tokens == x.argmax(-1).tolist()
    assert nan == [i == 5 for i in range(len(x))]
    # half greedy, half sampled: the greedy rows through the same path, a subset
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, seed=i) for i in range(len(x))]
    x[5] = 0.0
    tokens, nan = sample_batch(x, params, [None] * len(x), [None] * len(x))
    assert [t for i, t in enumerate(tokens) if i % 2] == x.argmax(-1)[1::2].tolist() and not any(
        nan
    )
