"""SentencePiece-style tokenizer.json files (Llama-2, Mistral): "▁" for spaces, BPE by merge rank,
byte fallback.

The outside reference is HF's `tokenizers` library itself: it trains three such tokenizers offline
on Shakespeare — Llama-2's layout (a Prepend("▁") + Replace(" ", "▁") normalizer, no pre-tokenizer)
and the newer Metaspace pre-tokenizer with split off and on — and nanoserve must give its token ids
on held-out text with accents, CJK, an emoji (byte fallback), tabs and runs of spaces, and decode
them to its text. Negative
control: each layout's rule for a leading space swapped for the other's gives other ids."""

from __future__ import annotations

import pytest
from testdata import shared_path

from nanoserve.tokenizers import load_tokenizer
from nanoserve.tokenizers.base import TokenizerError
from nanoserve.tokenizers.sentencepiece import MergesTokenizer

tokenizers = pytest.importorskip("tokenizers")
STYLES = ["llama2", "metaspace", "metaspace-split"]


def _train(style: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if style == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        split = style.endswith("split")
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=split)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=split)
    text = shared_path("corpora", "tinyshakespeare", "input.txt").read_text()[:60_000]
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator([line for line in text.split("\n") if line],
                            trainers.BpeTrainer(vocab_size=700, special_tokens=specials,
                                                show_progress=False))
    return tok


def _held_out() -> list[str]:
    text = shared_path("corpora", "tinyshakespeare", "input.txt").read_text()[-4000:]
    return [line for line in text.split("\n") if line] + [
        " naïve café — 東京 🤖  double  spaces\tand tabs",
        "GONZALO: Zounds!",
        "  leading spaces",
        "x",
    ]


@pytest.fixture(scope="module", params=STYLES)
def pair(request, tmp_path_factory):
    hf = _train(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save(str(path / "tokenizer.json"))
    return request.param, hf, load_tokenizer(path)


def test_ids_equal_hf_tokenizers(pair):
    style, hf, ours = pair
    assert isinstance(ours, MergesTokenizer) and ours.byte_fallback
    lines = _held_out()
    assert [ours.encode(line) for line in lines] == [hf.encode(line).ids for line in lines]
    # byte fallback did happen
    assert any(ours.pieces[i].startswith("<0x") for i in ours.encode("東京 🤖"))


def test_decode_gives_the_text_back(pair):
    style, hf, ours = pair
    for line in _held_out():
        ids = ours.encode(line)
        # HF's decoder for this layout (the byte pieces are special here: keep them)
        if style == "llama2":
            assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == (line if style == "llama2" else line.removeprefix(" "))


def test_negative_controls(pair):
    style, hf, ours = pair
    lines = _held_out()
    wrong = MergesTokenizer.__new__(MergesTokenizer)
    wrong.__dict__.update(ours.__dict__)
    # Metaspace's rule on Llama-2's layout (a leading space loses its "▁"), or SentencePiece's rule
    # on Metaspace ("▁" put before a leading space too)
    wrong.prefix_if_missing = style == "llama2"
    assert [wrong.encode(line) for line in lines] != [hf.encode(line).ids for line in lines]


def test_unsupported_normalizers_are_refused_by_name(tmp_path):
    import json

    hf = _train("llama2")
    hf.save(str(tmp_path / "tokenizer.json"))
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["normalizer"]["normalizers"].insert(0, {"type": "NFKC"})
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError,
                       match="normalizer .* is not supported with a SentencePiece-style"):
        load_tokenizer(tmp_path)
