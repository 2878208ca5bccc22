"""The tokenizer a GGUF file carries in its metadata (`tokenizer.ggml.*`), built as one of ours.

A GGUF file has no tokenizer.json; llama.cpp stores the vocabulary as arrays:

    tokenizer.ggml.model       "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokenizer.ggml.pre         which split regex a "gpt2" vocabulary is cut with first
                               ("gpt-2", "llama-bpe", ...): llama.cpp's name for the pre-tokenizer
    tokenizer.ggml.tokens      every token's text (byte-level: GPT-2's printable stand-ins)
    tokenizer.ggml.merges      "a b" pairs, in merge order ("gpt2")
    tokenizer.ggml.scores      each piece's score ("llama")
    tokenizer.ggml.token_type  1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    tokenizer.ggml.bos_token_id, .eos_token_id, .unknown_token_id

A "gpt2" vocabulary becomes a tiktoken BPE (bpe.py; control and user-defined tokens are its
special tokens), a "llama" one our SentencePiece BPE (sentencepiece.py) — the same two engines
that read HF and SentencePiece files, so a GGUF tokenizer is checked the same way: against
transformers' tokenizer built from the same file (tests/test_gguf_tokenizer.py).
"""

from __future__ import annotations

from .base import CONTROL, GPT2_PATTERN, USER_DEFINED, TokenizerError
from .bpe import TiktokenTokenizer, bpe_ranks, make_encoding
from .sentencepiece import SentencePieceTokenizer

# Llama-3's split: case-insensitive contractions, digits in threes, a symbol run keeps its newlines
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre → the split regex (llama.cpp's names); others are refused by name
PRE_TOKENIZERS = {"gpt-2": GPT2_PATTERN, "default": GPT2_PATTERN, "llama-bpe": LLAMA3_PATTERN,
                  "llama3": LLAMA3_PATTERN, "llama-v3": LLAMA3_PATTERN}


def gguf_tokenizer(meta: dict) -> TiktokenTokenizer | SentencePieceTokenizer | None:
    """The tokenizer of a GGUF file's metadata; None when the file has no vocabulary."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    kind = meta.get("tokenizer.ggml.model")
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    if kind == "gpt2":
        return _byte_level(meta, list(tokens), types, bos, eos)
    if kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        return SentencePieceTokenizer(
            list(tokens), list(scores), types, unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
            bos_id=bos, eos_id=eos, add_dummy_prefix=meta.get("tokenizer.ggml.add_space_prefix",
                                                              True))
    raise TokenizerError(f"GGUF tokenizer.ggml.model={kind!r} is not read here; allowed: gpt2, "
                         "llama")


def _byte_level(meta: dict, tokens: list[str], types: list[int], bos, eos) -> TiktokenTokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"GGUF tokenizer.ggml.pre={pre!r}: its split regex is not known here; "
                             f"allowed: {', '.join(PRE_TOKENIZERS)}")
    vocab = {token: i for i, token in enumerate(tokens)}
    specials = {t: i for i, (t, kind) in enumerate(zip(tokens, types))
                if kind in (CONTROL, USER_DEFINED)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
    ranks = bpe_ranks(vocab, merges, set(specials.values()), "the GGUF file's merges")
    encoding = make_encoding(f"gguf-{pre}", ranks, PRE_TOKENIZERS[pre], specials)
    return TiktokenTokenizer(encoding, bos_id=bos, eos_id=eos)
