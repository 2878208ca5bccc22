"""The tokenizer of a GGUF file (tokenizers/gguf_vocab.py) held to transformers' tokenizer built
from the same file (`AutoTokenizer.from_pretrained(..., gguf_file=...)`): GPT-2's 50k merges
stored as llama.cpp stores a byte-level vocabulary, cut with GPT-2's and Llama-3's split regexes,
on every paragraph of a slice of tinyshakespeare and a probe of odd text. Negative control: the
same file read with the other split regex disagrees on some of them."""

from __future__ import annotations

import json

import pytest
from gguf_writer import close_gguf
from testdata import shared_path

from nanoserve.errors import NanoserveError
from nanoserve.models import gguf_file
from nanoserve.tokenizers import gguf_vocab
from nanoserve.tokenizers.gguf_vocab import gguf_tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

PROBE = "Hello, World! it's 2024: 3.14159 ünïcödé 日本語 🦙  \t\n\n x\r\n  ;-) I'LL 'S 12345678"


def _write_gpt2_vocab(path, pre: str):
    folder = shared_path("models", "gpt2-tokenizer")
    vocab = json.loads((folder / "encoder.json").read_text(encoding="utf-8"))
    lines = (folder / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [line for line in lines[1:] if line]
    tokens = sorted(vocab, key=vocab.get)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    types = [1] * len(tokens)  # normal, but <|endoftext|>: control
    types[vocab["<|endoftext|>"]] = 3
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab["<|endoftext|>"])
    close_gguf(writer)
    return path


def _texts() -> list[str]:
    text = shared_path("corpora", "tinyshakespeare", "input.txt").read_text(encoding="utf-8")
    return text[:60_000].split("\n\n") + [PROBE, PROBE * 2, " leading", "trailing  "]


def _ours(path):
    return gguf_tokenizer(gguf_file.read_metadata(gguf.GGUFReader(path)))


@pytest.mark.shared
@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe"])
def test_byte_level_vocabulary_equals_transformers(pre, tmp_path):
    path = _write_gpt2_vocab(tmp_path / "vocab.gguf", pre)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = _ours(path)
    texts = _texts()
    bad = [t for t in texts if ours.encode(t) != hf.encode(t, add_special_tokens=False)]
    assert len(texts) > 300 and not bad, bad[:1]
    assert ours.eos_id == hf.eos_token_id == 50256
    assert ours.decode(ours.encode(PROBE)) == PROBE


@pytest.mark.shared
def test_negative_control_the_other_split_differs(tmp_path, monkeypatch):
    path = _write_gpt2_vocab(tmp_path / "vocab.gguf", "llama-bpe")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    monkeypatch.setitem(gguf_vocab.PRE_TOKENIZERS, "llama-bpe", gguf_vocab.PRE_TOKENIZERS["gpt-2"])
    ours = _ours(path)
    assert sum(ours.encode(t) != hf.encode(t, add_special_tokens=False) for t in _texts()) > 5


def test_unknown_pre_tokenizer_is_refused_by_name():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-coder",
            "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(NanoserveError, match="deepseek-coder"):
        gguf_tokenizer(meta)
    with pytest.raises(NanoserveError, match="allowed: gpt2, llama"):
        gguf_tokenizer({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})


@pytest.mark.shared
def test_sentencepiece_vocabulary(tmp_path):
    """Llama-2's SentencePiece pieces, scores and types stored as llama.cpp stores them: the GGUF
    tokenizer encodes as our tokenizer.model reader does (which tests/test_tokenizer.py holds to
    llama.cpp's own vectors), and as transformers' GGUF tokenizer does except where a text starts
    with a space: there transformers drops the dummy prefix's second "▁" and SentencePiece (and
    llama.cpp) keep it."""
    from nanoserve.tokenizers import load_tokenizer

    spm = load_tokenizer(shared_path("models", "llama2-tokenizer", "tokenizer.model"))
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(spm.pieces)
    writer.add_token_scores(spm.scores)
    writer.add_token_types(spm.types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    close_gguf(writer)
    ours = _ours(path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = _texts()
    assert all(ours.encode(t, bos=True) == spm.encode(t, bos=True) for t in texts)
    differ = [t for t in texts if ours.encode(t) != hf.encode(t, add_special_tokens=False)]
    assert differ == [t for t in texts if t.startswith(" ")] == [" leading"]
