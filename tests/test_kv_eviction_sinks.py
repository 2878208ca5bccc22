"""Attention sinks and StreamingLLM's negative control, on the shipped `demo-sinks` model.

`demo-sinks` (tools/train.py --preset demo-sinks) saw BOS first in every training window. The
proofs run through the engine: held-out windows of BOS + 254 bytes of tinyshakespeare are
prefilled one block per step (so every query sees exactly the keys a decode step at its position
would), and the last quarter of each window is scored from its prompt log-probabilities.
- The model has sinks: several heads put a large share of their attention on the first key. The
  demo model, trained on windows that start anywhere, has none: the control that the measurement
  is not an artefact of the measuring.
- Evicting the sinks breaks quality: at the same KV budget, truncation (no sink tokens) scores
  clearly worse than StreamingLLM (the first block kept), and at a budget of 64 tokens StreamingLLM
  is within 1 % of the full cache while truncation is not.
- The training option: windows start with BOS, and without the option they do not.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from testdata import REPO, shared_path

from nanoserve import LLM, SamplingParams
from nanoserve.config.kv_eviction import KVEvictionConfig
from nanoserve.models.loader import load_model
from nanoserve.tokenizers import byte_level_tokenizer
from nanoserve.tools.train import BOS, PRESETS, get_batch, load_bytes

BS = 4
WINDOWS = 8
T = 255  # tokens a window holds: the model's context (256) less the one it would generate
SCORED = 3 * 256 // 4  # the prompt positions from here on are scored (the last quarter)


def held_out_windows() -> list[list[int]]:
    """BOS + 254 held-out bytes, WINDOWS times (the last 10 % of tinyshakespeare)."""
    val = load_bytes(shared_path("corpora", "tinyshakespeare", "input.txt"))[1]
    return [[BOS, *val[i * (T - 1):(i + 1) * (T - 1)].tolist()] for i in range(WINDOWS)]


def first_key_shares(name: str, windows: list[list[int]]) -> torch.Tensor:
    """[layers, heads]: the attention the queries at positions >= 32 put on the first key."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_kv_eviction import sink_shares

    model, _, _ = load_model(name, "float32", "cpu")
    return torch.tensor(sink_shares(model, [torch.tensor(w) for w in windows]))


def scored_perplexity(windows: list[list[int]], eviction: KVEvictionConfig | None) -> float:
    """Perplexity of each window's last quarter, from the engine's prompt log-probabilities."""
    llm = LLM("demo-sinks", dtype="float32", device="cpu", block_size=BS,
              max_num_batched_tokens=BS, attention_backend="torch")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, kv_eviction=eviction)
    engine = llm.engine
    for w in windows:
        engine.add_request(w, params)
    nll, count = 0.0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            chosen = [next(iter(d.values())).logprob for d in out.prompt_logprobs[SCORED:]]
            nll -= sum(chosen)
            count += len(chosen)
    assert count == WINDOWS * (T - SCORED)
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def windows():
    return held_out_windows()


@pytest.fixture(scope="module")
def perplexities(windows):
    def streaming(budget, sinks):
        return KVEvictionConfig("streaming", kv_budget=budget, num_sink_tokens=sinks)

    return {"full": scored_perplexity(windows, None),
            "truncation 16": scored_perplexity(windows, streaming(16, 0)),
            "streaming 16": scored_perplexity(windows, streaming(16, BS)),
            "truncation 64": scored_perplexity(windows, streaming(64, 0)),
            "streaming 64": scored_perplexity(windows, streaming(64, BS))}


def test_demo_sinks_has_sinks_and_the_demo_does_not(windows):
    sinks = first_key_shares("demo-sinks", windows)
    assert (sinks > 0.3).sum() >= 4, sinks
    # the control: the demo reads the same bytes without BOS, as it was trained
    demo = first_key_shares("demo", [w[1:129] for w in windows])
    assert demo.max() < 0.1, demo


def test_evicting_the_sinks_breaks_streaming_llm(perplexities):
    p = perplexities
    assert p["truncation 16"] > 1.02 * p["streaming 16"], p
    assert p["truncation 64"] > 1.01 * p["full"], p
    assert p["streaming 64"] < 1.01 * p["full"], p
    # the budget itself costs quality: a check that the scoring sees the eviction at all
    assert p["streaming 16"] > 1.05 * p["full"], p


def test_training_windows_start_with_bos_only_when_asked():
    data = torch.arange(1000) % 200
    with_bos = get_batch(data, 8, 16, torch.Generator().manual_seed(0), bos=BOS)
    plain = get_batch(data, 8, 16, torch.Generator().manual_seed(0))
    x, y = with_bos
    assert (x[:, 0] == BOS).all() and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal((y[:, 1:] - y[:, :-1]) % 200, torch.ones(8, 15, dtype=y.dtype))
    assert (plain[0][:, 0] != BOS).all() and torch.equal(plain[0][:, 1:], plain[1][:, :-1])
    assert PRESETS["demo-sinks"][1].bos_first and not PRESETS["demo"][1].bos_first


def test_demo_sinks_prompts_start_with_bos():
    llm = LLM("demo-sinks", dtype="float32", device="cpu")
    assert llm.tokenizer.bos_id == BOS and llm.config.adds_bos
    out = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt_token_ids[0] == BOS and out.prompt_token_ids[1:] == list(b"ROMEO:")
    assert byte_level_tokenizer().bos_id is None  # the demo pair's tokenizer has none
