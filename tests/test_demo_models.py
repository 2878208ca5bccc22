"""The shipped demo models: they load and generate offline from the package alone, and the numbers
on their model cards are recomputed from ../shared (validation loss within 1 %, acceptance within
0.02, demo-sinks' first-key shares within 0.02)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from testdata import shared_path

from nanoserve import LLM, SamplingParams
from nanoserve.models.loader import ASSETS

MAX_BYTES = 25 * 1024 * 1024


def _card(name):
    return json.loads((ASSETS / name / "card.json").read_text())


def test_shipped_models_are_small_and_complete():
    total = 0
    for name in ("demo", "demo-draft", "demo-sinks"):
        files = {p.name for p in (ASSETS / name).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.tiktoken", "README.md",
                "card.json"} <= files
        total += sum(p.stat().st_size for p in (ASSETS / name).iterdir())
    assert total <= MAX_BYTES
    assert _card("demo")["parameters"] >= 10 * _card("demo-draft")["parameters"]


def test_demo_generates_offline_without_shared(tmp_path):
    """A fresh interpreter, cwd far from the repo, no network, no ../shared on any path it is
    told."""
    code = ("from nanoserve import LLM, SamplingParams; llm = LLM('demo'); "
            "print(llm.generate('ROMEO:', SamplingParams(temperature=0, max_tokens=40))[0].text)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_PROXY": "*", "http_proxy": "http://127.0.0.1:9",
           "https_proxy": "http://127.0.0.1:9"}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 20


def test_draft_loads_and_both_share_the_vocabulary():
    target, draft = LLM("demo"), LLM("demo-draft")
    assert target.config.vocab_size == draft.config.vocab_size == 257
    assert draft.config.arch == "llama" and target.config.arch == "gpt2"
    out = draft.generate("JULIET:", SamplingParams(temperature=0.8, max_tokens=30, seed=0))[0]
    assert len(out.token_ids) == 30


@pytest.mark.slow
def test_validation_loss_matches_the_card():
    import sys as _sys

    _sys.path.insert(0, str(ASSETS.parents[1] / "benchmarks"))
    from demo_models import VAL_CONTEXT, VAL_STRIDE, val_text

    from nanoserve.models.loader import load_model
    from nanoserve.tools.evaluate import perplexity

    text = val_text(shared_path("corpora", "tinyshakespeare", "input.txt"))
    model, _, tok = load_model("demo")
    res = perplexity(model, tok, text, context=VAL_CONTEXT, stride=VAL_STRIDE, batch_size=16,
                     progress=False)
    card = _card("demo")["val_loss_nats_per_byte"]
    assert res.nats_per_byte == pytest.approx(card, rel=0.01)
    assert res.nats_per_byte <= 1.60  # the goal


def test_draft_acceptance_matches_the_card():
    import sys as _sys

    _sys.path.insert(0, str(ASSETS.parents[1] / "benchmarks"))
    from demo_models import VAL_CONTEXT, val_text

    from nanoserve.models.loader import load_model
    from nanoserve.tools.evaluate import acceptance_stats

    text = val_text(shared_path("corpora", "tinyshakespeare", "input.txt"))
    target, _, tok = load_model("demo")
    draft, _, _ = load_model("demo-draft")
    acc = acceptance_stats(target, draft, tok.encode(text), context=VAL_CONTEXT, max_windows=32)
    card = _card("demo-draft")["acceptance"]["alpha"]
    for temp in ("1.0", "0"):
        assert acc["alpha"][temp] == pytest.approx(card[temp], abs=0.02)


def test_demo_sinks_card_is_recomputed():
    import sys as _sys

    _sys.path.insert(0, str(ASSETS.parents[1] / "benchmarks"))
    from bench_kv_eviction import sink_shares
    from demo_sinks_model import SINK_WINDOWS, bos_windows, validation_loss

    from nanoserve.models.loader import load_model
    from nanoserve.tools.train import BOS, bos_first_inputs

    model, cfg, _ = load_model("demo-sinks", "float32", "cpu")
    windows = bos_windows(shared_path("corpora", "tinyshakespeare", "input.txt"),
                          cfg.max_position_embeddings)
    card = _card("demo-sinks")
    assert validation_loss(model, windows) == pytest.approx(card["val_loss_nats_per_byte"],
                                                            rel=0.01)
    held = list(bos_first_inputs(windows[:SINK_WINDOWS], BOS))
    shares = torch.tensor(sink_shares(model, held))
    assert torch.allclose(shares, torch.tensor(card["first_key_share"]), atol=0.02)
