"""Tests for nanoserve.tokenizers, held to references nanoserve did not write.

* llama.cpp's tokenizer vectors (46 inputs each) for GPT-2 and Llama-2 (both tokenizer.model and
  llama2.c's tokenizer.bin), and stories260K's greedy golden tokens/text for tok512.bin.
* The HF ``tokenizers`` library on byte-level BPE tokenizer.json files built here, offline: tiny
  trained vocabularies under each supported pre-tokenizer layout, and GPT-2's real vocabulary.
* tiktoken's own GPT-2 loader for the ranks we build from encoder.json + vocab.bpe.

Negative controls show the checks can fail: a SentencePiece BPE that breaks ties rightmost or merges
the lowest score first misses llama.cpp vectors, and a tokenizer.json whose ids are out of merge
order (which tiktoken would encode differently) is rejected.
"""

from __future__ import annotations

import base64
import json
import random
import struct
import threading
from pathlib import Path

import pytest
import tiktoken
import tiktoken.load
from testdata import shared_path
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from nanoserve.tokenizers import (
    SentencePieceTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    TokenizerError,
    byte_level_tokenizer,
    gpt2_tokenizer,
    load_tokenizer,
    save_tiktoken,
)
from nanoserve.tokenizers import bpe as tk

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
UNICODE_TEXTS = [
    "Hello, world! 🦙🦙 llamas",
    "naïve café über Straße — ½ 東京 日本語 한국어 русский",
    "emoji: 👍🏽 👨‍👩‍👧 🇫🇷, combining: e\u0301, zero-width: a\u200bb",
    "  leading and trailing spaces  \n\ttabs\t\tand\r\nnewlines\n\n\n",
    "numbers 1234567890 3.14159 -42 1e-5",
    "",
]


def llama_cpp_vectors(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's (input, expected ids) pairs: inputs end with a separator line, ids are one line
    each."""
    folder = shared_path("models", "tokenizer-tests")
    inputs = (
        (folder / f"ggml-vocab-{name}.gguf.inp")
        .read_bytes()
        .decode("utf-8")
        .split("\n__ggml_vocab_test__\n")
    )
    lines = (folder / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").split("\n")
    assert inputs[-1] == "" and lines[-1] == ""  # both files end with a terminator, not a 47th case
    inputs, lines = inputs[:-1], lines[:-1]
    assert len(inputs) == len(lines) == 46
    return [(text, [int(x) for x in line.split()]) for text, line in zip(inputs, lines)]


def mismatches(tokenizer: Tokenizer,
               vectors: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    return [(text,
             tokenizer.encode(text)) for text, ids in vectors if tokenizer.encode(text) != ids]


# ---------------------------------------------------------------------------------------------------------
# fixtures: every tokenizer kind
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2() -> TiktokenTokenizer:
    return gpt2_tokenizer(shared_path("models", "gpt2-tokenizer"))


@pytest.fixture(scope="module", params=["tokenizer.model", "tokenizer.bin"])
def llama2(request: pytest.FixtureRequest) -> SentencePieceTokenizer:
    return load_tokenizer(shared_path("models", "llama2-tokenizer", request.param))


@pytest.fixture(scope="module")
def tok512() -> SentencePieceTokenizer:
    return load_tokenizer(shared_path("models", "stories260K", "tok512.bin"))


def _pseudo_corpus(n: int = 1000, seed: int = 0) -> list[str]:
    """Sentences of made-up words (Latin, accented, CJK, emoji, numbers, contractions) to train tiny
    BPEs."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "ön", "çe", "東", "京", "🦙", "the", "and", "ing"]
    extras = ["don't", "I'll", "WE'RE", "3.14", "2024", "12345", "—", "!!", "...", "\n", "  ", "\t"]
    words = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(400)
    ] + extras
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) for _ in range(n)]


def _sample_texts(seed: int = 1) -> list[str]:
    """Strings to compare encoders on: random mixes of letters, digits, whitespace runs, unicode,
    emoji."""
    rng = random.Random(seed)
    pool = list("abcdeXYZ   \t\n\r0123456789'.,!?-_<|>") + [
        "é", "ü", "東", "🦙", "👍🏽", "\u0301", "ﬁ", "½", "\u00a0", "\u3000", "'s", "'LL",
        "<|endoftext|>",
    ]  # fmt: skip
    random_texts = [
        "".join(rng.choice(pool) for _ in range(rng.randint(0, 40))) for _ in range(250)
    ]
    return random_texts + _pseudo_corpus(60, seed=seed) + UNICODE_TEXTS


SAMPLES = _sample_texts()


def _train_hf(pre_tokenizer, normalizer=None, vocab_size: int = 1000) -> HFTokenizer:
    """A tiny byte-level BPE trained by the HF tokenizers library (ids: specials, 256 bytes,
    merges)."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        hf.normalizer = normalizer
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(_pseudo_corpus(), trainer)
    return hf


def _llama3_pre_tokenizer():
    split = pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


HF_LAYOUTS = {
    "gpt2-bytelevel": lambda: (pre_tokenizers.ByteLevel(add_prefix_space=False), None),
    "llama3-split": lambda: (_llama3_pre_tokenizer(), None),
    "smollm-digits": lambda: (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                 pre_tokenizers.ByteLevel()]),
        None,
    ),
    "qwen2-nfc": lambda: (_llama3_pre_tokenizer(), normalizers.NFC()),
    "add-prefix-space": lambda: (pre_tokenizers.ByteLevel(add_prefix_space=True), None),
}


def _save(hf: HFTokenizer, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    return directory


def _hf_gpt2(pre_tokenizer) -> HFTokenizer:
    """GPT-2's real vocabulary as a HF tokenizer, built from the local encoder.json + vocab.bpe."""
    folder = shared_path("models", "gpt2-tokenizer")
    vocab = json.loads((folder / "encoder.json").read_text(encoding="utf-8"))
    merges = [
        tuple(line.split(" "))
        for line in (folder / "vocab.bpe").read_text("utf-8").split("\n")[1:]
        if line
    ]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizer
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>"])
    return hf


def _hf_ids(hf: HFTokenizer, text: str) -> list[int]:
    """HF's ids for `text` with special-token text read as ordinary text (nanoserve's rule)."""
    hf.encode_special_tokens = True
    return hf.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def trained_hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[HFTokenizer, TiktokenTokenizer]:
    pre_tokenizer, _ = HF_LAYOUTS["gpt2-bytelevel"]()
    hf = _train_hf(pre_tokenizer)
    return hf, load_tokenizer(_save(hf, tmp_path_factory.mktemp("hf")))


# ---------------------------------------------------------------------------------------------------------
# outside references: llama.cpp vectors, stories260K golden, tiktoken's GPT-2 loader
# ---------------------------------------------------------------------------------------------------------


def test_gpt2_matches_llama_cpp_vectors(gpt2: TiktokenTokenizer) -> None:
    vectors = llama_cpp_vectors("gpt-2")
    assert mismatches(gpt2, vectors) == []
    assert gpt2.encode("Hello world") == [15496, 995]
    assert (gpt2.vocab_size, gpt2.bos_id, gpt2.eos_id) == (50257, 50256, 50256)


def test_llama2_matches_llama_cpp_vectors(llama2: SentencePieceTokenizer) -> None:
    assert mismatches(llama2, llama_cpp_vectors("llama-spm")) == []
    assert (llama2.vocab_size, llama2.bos_id, llama2.eos_id) == (32000, 1, 2)
    assert llama2.encode("Hello", bos=True) == [1, 15043]


def test_gpt2_decode_inverts_encode_on_vectors(gpt2: TiktokenTokenizer) -> None:
    for text, ids in llama_cpp_vectors("gpt-2"):  # byte-level BPE is lossless
        assert gpt2.decode(ids) == text


def test_llama2_decode_inverts_encode_on_vectors(llama2: SentencePieceTokenizer) -> None:
    # sp.decode(sp.encode(x)) can differ from x in its leading space: encode puts one "▁" in front
    # (the dummy prefix) and decode drops one leading space. With Llama-2's identity normalizer that
    # restores x exactly, also for inputs that start with spaces, so all 46 must round-trip. (A
    # model that removes extra whitespace would lose spaces; none is among the references.)
    for text, ids in llama_cpp_vectors("llama-spm"):
        assert llama2.decode(ids) == text


def test_model_and_bin_files_give_the_same_tokenizer() -> None:
    model = load_tokenizer(shared_path("models", "llama2-tokenizer", "tokenizer.model"))
    binary = load_tokenizer(shared_path("models", "llama2-tokenizer", "tokenizer.bin"))
    assert model.pieces[3:] == binary.pieces[3:] and model.scores == binary.scores
    text = shared_path("corpora", "tinystories",
                       "tinystories_val_sample.txt").read_text("utf-8")[:3000]
    assert model.encode(text) == binary.encode(text)


class RightmostTies(SentencePieceTokenizer):
    """Mutant: among equal scores, merge the rightmost pair first."""

    def _pair_priority(self, rank: float, position: int) -> tuple[float, int]:
        return (rank, -position)


class LowestScoreFirst(SentencePieceTokenizer):
    """Mutant: merge the lowest-scoring pair first."""

    def _pair_priority(self, rank: float, position: int) -> tuple[float, int]:
        return (-rank, position)  # rank = −score


@pytest.mark.parametrize("mutant", [RightmostTies, LowestScoreFirst])
def test_wrong_merge_order_fails_llama_cpp_vectors(mutant: type,
                                                   llama2: SentencePieceTokenizer) -> None:
    wrong = mutant.__new__(mutant)
    wrong.__dict__.update(llama2.__dict__)
    assert mismatches(wrong, llama_cpp_vectors("llama-spm"))


def test_tok512_reproduces_stories260k_golden(tok512: SentencePieceTokenizer) -> None:
    golden = json.loads(shared_path("models", "stories260K",
                                    "greedy_golden.json").read_text("utf-8"))
    assert tok512.decode(golden["tokens"]) == golden["text"]
    # The model's greedy output is also the canonical tokenization of its text (256 tokens incl.
    # BOS).
    assert tok512.encode(golden["text"], bos=True) == golden["tokens"]


def test_tok512_once_upon_a_time(tok512: SentencePieceTokenizer) -> None:
    ids = tok512.encode("Once upon a time")
    assert [tok512.pieces[i] for i in ids] == ["▁Once", "▁upon", "▁a", "▁time"]
    assert tok512.decode(ids) == "Once upon a time"
    assert tok512.vocab_size == 512 and tok512.byte_fallback


def test_tok512_round_trips_tinystories(tok512: SentencePieceTokenizer) -> None:
    text = shared_path("corpora", "tinystories", "tinystories_val_sample.txt").read_text("utf-8")
    for sentence in text[:4000].split(". "):
        assert tok512.decode(tok512.encode(sentence)) == sentence


def test_gpt2_ranks_match_tiktoken_loader(gpt2: TiktokenTokenizer,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken caches local files by path otherwise
    folder = shared_path("models", "gpt2-tokenizer")
    reference = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        str(folder / "vocab.bpe"), str(folder / "encoder.json")
    )
    assert gpt2.encoding._mergeable_ranks == reference


# ---------------------------------------------------------------------------------------------------------
# HF tokenizer.json -> tiktoken, compared with the tokenizers library
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(HF_LAYOUTS))
def test_trained_tokenizer_json_matches_hf(layout: str, tmp_path: Path) -> None:
    pre_tokenizer, normalizer = HF_LAYOUTS[layout]()
    hf = _train_hf(pre_tokenizer, normalizer)
    ours = load_tokenizer(_save(hf, tmp_path))
    assert isinstance(ours, TiktokenTokenizer) and ours.vocab_size == hf.get_vocab_size()
    assert len(hf.get_vocab()) > 650  # training made 400+ merges: not a trivial vocabulary
    for text in SAMPLES:
        assert ours.encode(text) == _hf_ids(hf, text), text
    assert ours.eos_id == ours.bos_id == hf.token_to_id("<|endoftext|>")


@pytest.mark.parametrize("pre_tokenizer", ["gpt2", "llama3"])
def test_gpt2_tokenizer_json_matches_hf(pre_tokenizer: str, tmp_path: Path,
                                        gpt2: TiktokenTokenizer) -> None:
    layout = (
        pre_tokenizers.ByteLevel(add_prefix_space=False)
        if pre_tokenizer == "gpt2"
        else _llama3_pre_tokenizer()
    )
    hf = _hf_gpt2(layout)
    ours = load_tokenizer(_save(hf, tmp_path))
    for text in SAMPLES + [text for text, _ in llama_cpp_vectors("gpt-2")]:
        assert ours.encode(text) == _hf_ids(hf, text), text
        if pre_tokenizer == "gpt2":
            assert ours.encode(text) == gpt2.encode(text)
    assert (ours.vocab_size, ours.bos_id, ours.eos_id) == (50257, 50256, 50256)


def test_special_token_text_is_ordinary_text(trained_hf, gpt2: TiktokenTokenizer) -> None:
    hf, ours = trained_hf
    for text in ["<|endoftext|>", "a<|endoftext|>b <pad>"]:
        assert ours.encode(text) == _hf_ids(hf, text)
        assert ours.eos_id not in ours.encode(text)
        # HF's default: special-token text becomes the special token
        hf.encode_special_tokens = False
        assert hf.token_to_id("<|endoftext|>") in hf.encode(text, add_special_tokens=False).ids
    assert gpt2.encode("<|endoftext|>") == gpt2.encoding.encode_ordinary("<|endoftext|>")
    assert 50256 not in gpt2.encode("<|endoftext|>")
    assert gpt2.decode([50256]) == "<|endoftext|>"


def test_string_merges_format_loads_the_same(trained_hf, tmp_path: Path) -> None:
    hf, ours = trained_hf
    spec = json.loads(hf.to_str())
    # pre-0.20 layout
    spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    other = load_tokenizer(tmp_path / "tokenizer.json")
    assert all(other.encode(text) == ours.encode(text) for text in SAMPLES[:50])


def test_tokenizer_config_sets_bos_and_eos(trained_hf, tmp_path: Path) -> None:
    hf, _ = trained_hf
    _save(hf, tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"bos_token": {"content": "<pad>"}, "eos_token": "<|endoftext|>"}))
    tokenizer = load_tokenizer(tmp_path)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (hf.token_to_id("<pad>"),
                                                    hf.token_to_id("<|endoftext|>"))
    config.write_text(json.dumps({"bos_token": None, "eos_token": "<pad>"}))
    tokenizer = load_tokenizer(tmp_path)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (None, hf.token_to_id("<pad>"))
    with pytest.raises(TokenizerError, match="no BOS token"):
        tokenizer.encode("x", bos=True)
    config.write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(TokenizerError, match="<\\|im_end\\|>"):
        load_tokenizer(tmp_path)


def _competing_merges(merges: list[list[str]]) -> tuple[int, str]:
    """First k where merges k, k+1 overlap (a b, b c) and are independent, and a text where both
    apply."""
    for k in range(len(merges) - 1):
        (a, b), (c, d) = merges[k], merges[k + 1]
        if a + b in (c, d):
            continue
        joined = a + b + d if b == c else c + a + b if d == a else None
        text = tk.token_bytes(joined, "test").decode("utf-8", errors="replace") if joined else ""
        if text.isalpha():  # one piece for the pre-tokenizer, so only the merge order decides
            return k, text
    raise AssertionError("no competing merges in the trained vocabulary")


def test_ids_out_of_merge_order_are_rejected(trained_hf, tmp_path: Path) -> None:
    hf, _ = trained_hf
    spec = json.loads(hf.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    k, text = _competing_merges(merges)
    made = ["".join(merges[k]), "".join(merges[k + 1])]
    # HF still works: merges decide order
    vocab[made[0]], vocab[made[1]] = vocab[made[1]], vocab[made[0]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(TokenizerError, match=f"merge #{k + 1} .*breaks merge order"):
        load_tokenizer(tmp_path)
    # The check matters: tiktoken run on those ranks anyway merges in the other order than HF does.
    swapped = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ranks = {tk.token_bytes(token, "test"): i for token, i in vocab.items() if i > 1}
    encoding = tiktoken.Encoding("swapped", pat_str=tk.GPT2_PATTERN, mergeable_ranks=ranks,
                                 special_tokens={})
    assert encoding.encode_ordinary(text) != _hf_ids(swapped, text)


def _add_unmade_token(spec: dict) -> None:
    spec["model"]["vocab"]["ĠxyzÃ¶"] = len(spec["model"]["vocab"]) + len(spec["added_tokens"])


def _drop_byte(spec: dict) -> None:
    del spec["model"]["vocab"]["Ā"]  # byte 0x00 in GPT-2's alphabet; no merge uses it


def _literal_split(spec: dict) -> None:
    split = {"type": "Split", "pattern": {"String": "a"}, "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, byte_level]}


@pytest.mark.parametrize(
    "damage, message",
    [
        (_add_unmade_token, "made by no merge"),
        (_drop_byte, "single bytes .*0x00"),
        (_literal_split, "does not match every character"),
    ],
)
def test_tiktoken_incompatible_tokenizer_json_is_rejected(
    damage, message: str, trained_hf, tmp_path: Path
) -> None:
    spec = json.loads(trained_hf[0].to_str())
    damage(spec)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(tmp_path)


def test_non_byte_level_tokenizer_json_is_rejected(tmp_path: Path) -> None:
    hf = HFTokenizer(models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(_pseudo_corpus(50),
                           trainers.BpeTrainer(vocab_size=200, show_progress=False))
    _save(hf, tmp_path)
    with pytest.raises(TokenizerError, match="not byte-level"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(
        json.dumps({"model": {"type": "WordPiece", "vocab": {}}})
    )
    with pytest.raises(TokenizerError, match="WordPiece"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------------------------------------------------
# round trips, streaming bytes, the byte tokenizer, save_tiktoken
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(params=["gpt2", "llama2-model", "llama2-bin", "tok512", "bytes", "hf-trained"])
def any_tokenizer(request: pytest.FixtureRequest, trained_hf) -> Tokenizer:
    name = request.param
    if name == "gpt2":
        return request.getfixturevalue("gpt2")
    if name.startswith("llama2"):
        file = "tokenizer.model" if name.endswith("model") else "tokenizer.bin"
        return load_tokenizer(shared_path("models", "llama2-tokenizer", file))
    if name == "tok512":
        return request.getfixturevalue("tok512")
    return byte_level_tokenizer() if name == "bytes" else trained_hf[1]


def test_unicode_round_trip_and_streamed_bytes(any_tokenizer: Tokenizer) -> None:
    for text in UNICODE_TEXTS + SAMPLES[:40]:
        ids = any_tokenizer.encode(text)
        assert all(0 <= i < any_tokenizer.vocab_size for i in ids)
        assert any_tokenizer.decode(ids) == text
        # decode_bytes concatenates, so a stream can emit each token's bytes as they come.
        streamed = b"".join(any_tokenizer.decode_bytes([i]) for i in ids)
        assert streamed == any_tokenizer.decode_bytes(ids)
        if isinstance(any_tokenizer, SentencePieceTokenizer) and text:
            assert streamed == b" " + text.encode()  # the dummy-prefix space, which decode() drops
        elif not isinstance(any_tokenizer, SentencePieceTokenizer):
            assert streamed == text.encode()


def test_cut_utf8_decodes_with_replacement(gpt2: TiktokenTokenizer,
                                           tok512: SentencePieceTokenizer) -> None:
    ids = tok512.encode("🦙")  # not in the 512 vocab: four byte-fallback tokens
    assert [tok512.pieces[i] for i in ids] == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert tok512.decode(ids[:3]) == "\ufffd"
    assert gpt2.decode(gpt2.encode("🦙")[:1]) == "\ufffd"


def test_byte_level_tokenizer_round_trips_any_bytes() -> None:
    tokenizer = byte_level_tokenizer()
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (257, None, 256)
    rng = random.Random(0)
    for _ in range(50):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(100)))
        assert tokenizer.decode_bytes(list(raw)) == raw
        text = raw.decode("utf-8", errors="replace")
        assert tokenizer.encode(text) == list(text.encode())
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode([256]) == "<|endoftext|>"
    assert tokenizer.encode("<|endoftext|>") == list(b"<|endoftext|>")


@pytest.mark.parametrize("kind", ["bytes", "gpt2", "hf-digits"])
def test_save_tiktoken_then_load(kind: str, tmp_path: Path) -> None:
    if kind == "bytes":
        original = byte_level_tokenizer()
    elif kind == "gpt2":
        original = gpt2_tokenizer(shared_path("models", "gpt2-tokenizer"))
    else:
        original = load_tokenizer(_save(_train_hf(HF_LAYOUTS["smollm-digits"]()[0]),
                                        tmp_path / "hf"))
        assert original.presplit
    saved = save_tiktoken(original, tmp_path / "saved")
    assert sorted(p.name for p in saved.iterdir()) == ["tiktoken_config.json", "tokenizer.tiktoken"]
    loaded = load_tokenizer(saved)
    assert (loaded.vocab_size, loaded.bos_id, loaded.eos_id) == (
        original.vocab_size,
        original.bos_id,
        original.eos_id,
    )
    for text in SAMPLES:
        assert loaded.encode(text) == original.encode(text)
    assert loaded.decode([original.eos_id]) == "<|endoftext|>"


def test_save_tiktoken_rejects_sentencepiece(tok512: SentencePieceTokenizer,
                                             tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="SentencePiece"):
        save_tiktoken(tok512, tmp_path)


# ---------------------------------------------------------------------------------------------------------
# the protobuf reader on a hand-made ModelProto; errors
# ---------------------------------------------------------------------------------------------------------


def _pb_varint(value: int) -> bytes:
    out = b""
    while True:
        out += bytes([value & 0x7F | (0x80 if value > 0x7F else 0)])
        value >>= 7
        if not value:
            return out


def _pb(field: int, value: int | bytes | float) -> bytes:
    """One protobuf field: ints as varints, floats as fixed32, bytes length-delimited."""
    if isinstance(value, bytes):
        return _pb_varint(field << 3 | 2) + _pb_varint(len(value)) + value
    if isinstance(value, float):
        return _pb_varint(field << 3 | 5) + struct.pack("<f", value)
    return _pb_varint(field << 3) + _pb_varint(value % (1 << 64))


def _model_proto(pieces: list[tuple[str, float, int]], trainer: bytes,
                 normalizer: bytes = b"") -> bytes:
    body = b"".join(
        _pb(1,
            _pb(1, p.encode()) + _pb(2, s) + (_pb(3, t) if t != 1 else b"")) for p, s, t in pieces
    )
    return body + _pb(2, trainer) + (_pb(3, normalizer) if normalizer else b"")


def test_hand_made_model_proto(tmp_path: Path) -> None:
    # No byte fallback, unk id 2, no eos, a user-defined piece, proto defaults for the normalizer
    # (add_dummy_prefix and remove_extra_whitespaces both true).
    pieces = [("<s>", 0.0, 3), ("<pad>", 0.0, 3), ("<unk>", 0.0, 2), ("<sep>", 0.0, 4)]
    pieces += [
        ("▁", -1.0, 1),
        ("a", -1.0, 1),
        ("b", -1.0, 1),
        ("ab", -2.0, 1),
        ("▁ab", -3.0, 1),
        ("▁a", -4.0, 1),
    ]
    trainer = _pb(3, 2) + _pb(40, 2) + _pb(41, 0) + _pb(42, -1)
    path = tmp_path / "tokenizer.model"
    path.write_bytes(_model_proto(pieces, trainer))
    tokenizer = load_tokenizer(tmp_path)
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (
        10, 0, None, 2,
    )
    assert not tokenizer.byte_fallback and tokenizer.remove_extra_whitespaces
    # "ab" (-2) merges before "▁a" (-4); then "▁"+"ab" -> "▁ab". Extra spaces go; unknowns "xy" ->
    # one <unk>.
    assert tokenizer.encode("  ab   xy<sep>a ") == [8, 4, 2, 3, 5]
    assert tokenizer.decode([0, 8, 4, 2, 3, 5]) == "ab <sep>a"
    # A HF Llama-2 folder: a SentencePiece-style tokenizer.json beside the tokenizer.model; the
    # model wins.
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"},
                                                         "pre_tokenizer": None}))
    assert isinstance(load_tokenizer(tmp_path), SentencePieceTokenizer)
    path.write_bytes(_model_proto(pieces, _pb(3, 1)))
    with pytest.raises(TokenizerError, match="UNIGRAM"):
        load_tokenizer(path)
    path.write_bytes(_model_proto(pieces, trainer, _pb(1, b"nmt_nfkc") + _pb(2, b"\x01\x02")))
    with pytest.raises(TokenizerError, match="nmt_nfkc"):
        load_tokenizer(path)
    path.write_bytes(b"\x0a\xff")
    with pytest.raises(TokenizerError, match="not a SentencePiece model"):
        load_tokenizer(path)


def test_missing_and_empty_paths(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(TokenizerError, match="tokenizer.json.*tokenizer.model"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="unknown tokenizer file"):
        load_tokenizer(tmp_path / "notes.txt")


def test_out_of_range_ids_are_rejected(any_tokenizer: Tokenizer) -> None:
    size = any_tokenizer.vocab_size
    for bad in (size, -1, 10**12):
        with pytest.raises(TokenizerError, match=f"token id {bad} .*vocab_size={size}"):
            any_tokenizer.decode([0, bad])
        with pytest.raises(TokenizerError, match=str(bad)):
            any_tokenizer.decode_bytes([bad])
    with pytest.raises(TokenizerError, match="str"):
        any_tokenizer.encode(b"bytes")  # type: ignore[arg-type]


def test_vocabulary_hole_and_bad_files(tmp_path: Path) -> None:
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 300}
    (tmp_path / "tokenizer.tiktoken").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items())
    )
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.vocab_size == 301 and tokenizer.encode("abab") == [300, 300]
    with pytest.raises(TokenizerError, match="280"):
        tokenizer.decode([280])
    (tmp_path / "tokenizer.tiktoken").write_text("not base64!! x\n")
    with pytest.raises(TokenizerError, match="tokenizer.tiktoken:1"):
        load_tokenizer(tmp_path)
    (tmp_path / "tok99.bin").write_bytes(struct.pack("<i", 7) + struct.pack("<fi", 0.0, 99))
    with pytest.raises(TokenizerError, match="token 0 has length 99"):
        load_tokenizer(tmp_path)  # tok*.bin comes before tokenizer.tiktoken


def test_gpt2_by_name_fails_clearly_offline(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # no ./gpt2 directory here

    def refuse(name: str) -> None:
        raise ConnectionError("no network")

    monkeypatch.setattr(tk.tiktoken, "get_encoding", refuse)
    with pytest.raises(TokenizerError, match="ConnectionError.*encoder.json"):
        load_tokenizer("gpt2")
    release = threading.Event()
    monkeypatch.setattr(tk.tiktoken, "get_encoding", lambda name: release.wait(10))
    monkeypatch.setattr(tk, "NETWORK_TIMEOUT_S", 0.2)
    try:
        with pytest.raises(TokenizerError, match="offline"):
            load_tokenizer("gpt2")
    finally:
        release.set()
