"""What every tokenizer here shares: the `Tokenizer` protocol the engine uses, `TokenizerError`,
the id checks, the file readers, and the constants of the formats.

Two engines cover the vocabulary formats that checkpoints ship with:

* **tiktoken** (Rust, fast) runs every *byte-level* BPE (bpe.py): GPT-2's ``encoder.json`` +
  ``vocab.bpe``, HF ``tokenizer.json`` files of the GPT-2 / Llama-3 / Qwen2 / SmolLM family
  (tokenizer_json.py), ``tokenizer.tiktoken`` files (tiktoken_file.py), and the 257-token byte
  tokenizer of our demo models.
* A small pure-Python **SentencePiece BPE** (sentencepiece.py) runs Llama-2 style vocabularies
  (``tokenizer.model`` protobufs, read by protobuf.py; llama2.c ``tokenizer.bin`` / ``tok512.bin``,
  llama2c.py; and SentencePiece-style ``tokenizer.json`` files — Llama-2's, Mistral's Metaspace —
  where `MergesTokenizer` ranks pairs by the file's merge list, as HF does). There a merge is chosen
  by the *score* of the merged piece over unicode characters (or its rank), with byte fallback for
  unknown
  characters: tiktoken's rank-over-bytes BPE cannot express that exactly.

Both engines have the members of :class:`Tokenizer`; :func:`load_tokenizer` (load.py) picks one by
the files it finds. ``encode`` never parses special-token text (``"<|endoftext|>"`` is ordinary
text there); specials.py cuts it out where the special token's id is meant (chat templates, and
prompts unless the engine's ``split_special_tokens`` is set). ``bos=True`` prepends the BOS id.

Tests (tests/test_tokenizer.py) hold both engines to outside references: llama.cpp's tokenizer
vectors for GPT-2 and Llama-2, and the HF ``tokenizers`` library on tokenizer.json files built
offline.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import NanoserveError

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"
SPACE = "\u2581"  # "▁": SentencePiece writes spaces as this visible character inside pieces
RECOGNISED_FILES = (
    "tokenizer.json",
    "encoder.json + vocab.bpe",
    "tokenizer.model",
    "tokenizer.bin",
    "tok*.bin",
    "tokenizer.tiktoken (+ tiktoken_config.json)",
)
# Names tried for BOS / EOS when a tokenizer.json comes without a tokenizer_config.json.
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
EOS_NAMES = ("<|end_of_text|>", ENDOFTEXT, "</s>", "<eos>", "<|im_end|>")

# SentencePiece piece types (sentencepiece_model.proto, ModelProto.SentencePiece.Type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")


class TokenizerError(NanoserveError):
    """A tokenizer file or value that cannot be used; the message names it and what is allowed."""


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer (both engines below have exactly these members)."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str, bos: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    @property
    def special_tokens(self) -> dict[str, int]: ...
    def decode_bytes(self, ids: Sequence[int]) -> bytes: ...


def check_text(text: object) -> None:
    if not isinstance(text, str):
        raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")


def check_ids(ids: Iterable[int], vocab_size: int) -> list[int]:
    """The ids as plain ints, each checked to lie in [0, vocab_size)."""
    out = []
    for token in ids:
        token = operator.index(token)  # accepts numpy / 0-d torch integers, rejects floats
        if not 0 <= token < vocab_size:
            raise TokenizerError(
                f"token id {token} is out of range: this tokenizer has vocab_size={vocab_size}, "
                f"so ids must be in 0..{vocab_size - 1}"
            )
        out.append(token)
    return out


def check_special_ids(vocab_size: int, **ids: int | None) -> None:
    for name, value in ids.items():
        if value is not None and not 0 <= value < vocab_size:
            raise TokenizerError(f"{name}={value} is outside the vocabulary "
                                 f"(vocab_size={vocab_size})")


def prepend_bos(ids: list[int], bos: bool, bos_id: int | None) -> list[int]:
    if not bos:
        return ids
    if bos_id is None:
        raise TokenizerError("encode(bos=True): this tokenizer has no BOS token (bos_id is None)")
    return [bos_id, *ids]



def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer file {str(path)!r}: "
                             f"{e.strerror or e}") from None


def read_text(path: Path) -> str:
    try:
        return read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text ({e})") from None


def read_json(path: Path) -> Any:
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
