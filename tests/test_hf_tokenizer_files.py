"""tiktoken -> HF tokenizer.json (tokenizers/hf_files.py), held to the outside reference: HF
`transformers.AutoTokenizer` loading the written files gives nanoserve's ids on a corpus, for the
demo models' byte tokenizer and for GPT-2's 50k merges; the shipped demo files are what the writer
writes."""

from __future__ import annotations

import json

import pytest
from testdata import shared_path

from nanoserve.models.loader import resolve_model_path
from nanoserve.tokenizers import (
    byte_level_tokenizer,
    gpt2_tokenizer,
    load_tokenizer,
    save_hf_tokenizer,
)
from nanoserve.tokenizers.hf_files import tokenizer_json

transformers = pytest.importorskip("transformers")

PROBE = "Hello, World! it's 2024: 3.14 ünïcödé 日本語 🦙🦙  \t\n\n x\r\n  ;-) \x00\x7f 'S'LL "


def _texts() -> list[str]:
    text = shared_path("corpora", "tinyshakespeare",
                       "input.txt").read_text(encoding="utf-8")[:200_000]
    return text.split("\n\n") + [PROBE, PROBE * 3, " leading", "trailing  ", ""]


def _mismatches(ours, hf, texts) -> int:
    bad = 0
    for t in texts:
        ids = ours.encode(t)
        bad += ids != hf.encode(t, add_special_tokens=False) or hf.decode(ids) != ours.decode(ids)
    return bad


@pytest.mark.shared
def test_gpt2_written_as_tokenizer_json_equals_tiktoken(tmp_path):
    """50k merges derived from ranks: every paragraph of tinyshakespeare tokenizes the same in
    HF."""
    ours = gpt2_tokenizer(shared_path("models", "gpt2-tokenizer"))
    save_hf_tokenizer(ours, tmp_path, 1024)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = _texts()
    assert len(texts) > 1000 and _mismatches(ours, hf, texts) == 0
    assert hf.eos_token == "<|endoftext|>" and hf.encode("<|endoftext|>",
                                                         add_special_tokens=False) == [50256]
    back = load_tokenizer(tmp_path)  # our own reader, the round trip
    assert all(back.encode(t) == ours.encode(t) for t in texts[:200])


@pytest.mark.shared
def test_negative_control_a_reordered_merge_list_is_caught(tmp_path):
    """The comparison above can fail: the same merges in reverse order tokenize differently."""
    ours = gpt2_tokenizer(shared_path("models", "gpt2-tokenizer"))
    spec = tokenizer_json(ours)
    spec["model"]["merges"].reverse()
    spec["model"]["ignore_merges"] = False
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert _mismatches(ours, hf, _texts()[:300]) > 100


@pytest.mark.parametrize("model", ["demo", "demo-draft"])
def test_the_demo_models_ship_an_hf_tokenizer(model, tmp_path):
    """AutoTokenizer on the shipped folder gives the demo's ids; the shipped files are the writer's
    output."""
    folder = resolve_model_path(model)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    ours = byte_level_tokenizer()
    assert _mismatches(ours, hf, [PROBE, "ROMEO:\nWhat light?", "é" * 5]) == 0
    assert hf.eos_token_id == 256 and hf.bos_token is None
    save_hf_tokenizer(ours, tmp_path, json.loads((folder / "config.json").read_text()).get(
        "max_position_embeddings", 128))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_text() == (tmp_path / name).read_text(), (
            f"{model}/{name} is stale"
        )
