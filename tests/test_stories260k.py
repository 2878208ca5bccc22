"""stories260K, a real trained Llama-2-architecture model (llama2.c format), against outside
oracles: 256 greedy tokens from an independent numpy implementation, and its documented mean NLL."""

from __future__ import annotations

import json

import pytest
import torch
from testdata import shared_path

from nanoserve import LLM, SamplingParams
from nanoserve.models.loader import read_llama2c
from nanoserve.tools.evaluate import perplexity, read_text


@pytest.fixture(scope="module")
def llm():
    return LLM(str(shared_path("models", "stories260K", "stories260K.bin")), dtype="float32",
               device="cpu")


def test_greedy_from_bos_reproduces_golden_tokens(llm):
    golden = json.loads(shared_path("models", "stories260K",
                                    "greedy_golden.json").read_text())["tokens"]
    assert golden[0] == llm.tokenizer.bos_id == 1
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=len(golden) - 1))[0]
    assert [1] + out.token_ids == golden
    assert out.text.startswith("Once upon a time, there was a little girl named Lily.")


def test_mean_nll_matches_documented_value(llm):
    """SOURCES.md: 1.496 nats/token over 20 windows of 255 tokens from the start of the TinyStories
    sample, each window = BOS + 255 tokens (non-overlapping, not aligned to stories)."""
    text = read_text(shared_path("corpora", "tinystories", "tinystories_val_sample.txt"))
    res = perplexity(llm.model, llm.tokenizer, text, context=256, stride=255, max_tokens=20 * 255,
                     progress=False)
    assert res.n_windows == 20 and res.n_tokens == 20 * 255
    assert res.nats_per_token == pytest.approx(1.496, abs=0.002)


def test_interleaved_rope_permutation_is_needed():
    """Negative control: loading llama2.c weights without the q/k row permutation breaks the golden
    run."""
    cfg, tensors = read_llama2c(shared_path("models", "stories260K", "stories260K.bin"))
    from nanoserve.models.loader import build_from_tensors

    model = build_from_tensors(cfg, tensors, torch.float32, torch.device("cpu"))
    golden = json.loads(shared_path("models", "stories260K",
                                    "greedy_golden.json").read_text())["tokens"]
    with torch.no_grad():
        good = model(torch.tensor([golden[:64]]))[0, :-1].argmax(-1).tolist()
        for i in range(cfg.n_layers):  # undo the permutation on every layer
            attn = model.model.layers[i].self_attn
            for proj, heads in ((attn.q_proj, cfg.n_heads), (attn.k_proj, cfg.n_kv_heads)):
                w = proj.weight
                d = w.shape[0] // heads
                proj.weight.copy_(w.view(heads, 2, d // 2, -1).transpose(1, 2).reshape(w.shape))
        bad = model(torch.tensor([golden[:64]]))[0, :-1].argmax(-1).tolist()
    assert good == golden[1:64]
    assert bad != golden[1:64]
