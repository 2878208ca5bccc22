"""Finding and loading the tokenizer of a checkpoint directory (or one tokenizer file) by the
files it holds.
"""

from __future__ import annotations

import os
from pathlib import Path

from .base import RECOGNISED_FILES, Tokenizer, TokenizerError
from .bpe import gpt2_tokenizer, tiktoken_named
from .llama2c import llama2c_tokenizer
from .sentencepiece import sentencepiece_tokenizer
from .tiktoken_file import tiktoken_file_tokenizer
from .tokenizer_json import hf_tokenizer


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds any of RECOGNISED_FILES (a checkpoint may come without a
    tokenizer)."""
    p = Path(directory)
    names = ("tokenizer.json", "encoder.json", "tokenizer.model", "tokenizer.bin",
             "tokenizer.tiktoken")
    return p.is_dir() and (any((p / n).is_file() for n in names) or any(p.glob("tok*.bin")))


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer in `path`: a directory (first found of RECOGNISED_FILES, in that order) or one
    file.

    A tokenizer.json that is not byte-level gives way to a tokenizer.model beside it (HF Llama-2
    folders).

    The bare name "gpt2", when no such path exists, asks tiktoken's registry (needs the network
    once).
    """
    p = Path(path)
    if str(path) == "gpt2" and not p.exists():
        return tiktoken_named("gpt2")
    if p.is_file():
        return _load_file(p)
    if not p.is_dir():
        raise TokenizerError(
            f"tokenizer path {str(p)!r} does not exist; give a directory with one of "
            f"{', '.join(RECOGNISED_FILES)}, or one such file"
        )
    if (p / "tokenizer.json").is_file():
        try:
            return hf_tokenizer(p / "tokenizer.json")
        except TokenizerError:
            # HF Llama-2 folders ship a SentencePiece-style tokenizer.json (not byte-level) next to
            # the tokenizer.model it was converted from: that file is the authoritative one.
            if not (p / "tokenizer.model").is_file():
                raise
    if (p / "encoder.json").is_file() and (p / "vocab.bpe").is_file():
        return gpt2_tokenizer(p)
    if (p / "tokenizer.model").is_file():
        return sentencepiece_tokenizer(p / "tokenizer.model")
    bins = [p / "tokenizer.bin"] if (p / "tokenizer.bin").is_file() else sorted(p.glob("tok*.bin"))
    if bins:
        return llama2c_tokenizer(bins[0])
    if (p / "tokenizer.tiktoken").is_file():
        return tiktoken_file_tokenizer(p / "tokenizer.tiktoken")
    present = sorted(f.name for f in p.iterdir())[:10]
    raise TokenizerError(
        f"no tokenizer in {str(p)!r} (it holds {present or 'nothing'}); "
        f"recognised: {', '.join(RECOGNISED_FILES)}"
    )


def _load_file(path: Path) -> Tokenizer:
    """One tokenizer file, by its name."""
    if path.name in ("encoder.json", "vocab.bpe"):
        return gpt2_tokenizer(path.parent)
    if path.suffix == ".json":
        return hf_tokenizer(path)
    if path.suffix == ".model":
        return sentencepiece_tokenizer(path)
    if path.suffix == ".bin":
        return llama2c_tokenizer(path)
    if path.suffix == ".tiktoken":
        return tiktoken_file_tokenizer(path)
    raise TokenizerError(
        f"{str(path)!r}: unknown tokenizer file type; recognised: {', '.join(RECOGNISED_FILES)} "
        "(any *.json is read as a HF tokenizer.json, any *.model as SentencePiece, any *.bin as "
        "llama2.c)"
    )
