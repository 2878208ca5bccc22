"""``tokenizer.tiktoken`` files: "base64(token bytes) rank" lines, with special tokens in
``tiktoken_config.json``. How the demo models ship their byte tokenizer.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from .base import GPT2_PATTERN, TokenizerError, read_json, read_text
from .bpe import TiktokenTokenizer, make_encoding


def save_tiktoken(tokenizer: TiktokenTokenizer, directory: str | os.PathLike) -> Path:
    """Write `tokenizer` as ``tokenizer.tiktoken`` + ``tiktoken_config.json`` in `directory`; return
    the dir.

    :func:`load_tokenizer` reads it back (e.g. the demo byte tokenizer saved next to a checkpoint).
    """
    if not isinstance(tokenizer, TiktokenTokenizer):
        raise TokenizerError(
            f"save_tiktoken needs a tiktoken-backed tokenizer, got {type(tokenizer).__name__} "
            "(SentencePiece score-based merges have no tiktoken form)"
        )
    encoding = tokenizer.encoding
    special_names = {i: name for name, i in encoding._special_tokens.items()}
    config: dict[str, Any] = {"pat_str": encoding._pat_str,
                              "special_tokens": encoding._special_tokens}
    for key, token in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
        if token is not None and token not in special_names:
            raise TokenizerError(f"save_tiktoken: {key} id {token} is not a special token, so it "
                                 "has no name")
        config[key] = special_names.get(token)
    for key in ("normalization", "presplit", "add_prefix_space"):
        if getattr(tokenizer, key):
            config[key] = getattr(tokenizer, key)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = sorted(encoding._mergeable_ranks.items(), key=lambda item: item[1])
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks]
    (directory / "tokenizer.tiktoken").write_text("".join(lines), encoding="ascii")
    (directory / "tiktoken_config.json").write_text(json.dumps(config, indent=1) + "\n",
                                                    encoding="utf-8")
    return directory


def tiktoken_file_tokenizer(path: str | os.PathLike) -> TiktokenTokenizer:
    """A ``tokenizer.tiktoken`` file and the ``tiktoken_config.json`` beside it (if absent: GPT-2's
    regex)."""
    path = Path(path)
    ranks = {}
    for n, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise TokenizerError(f"{path}:{n}: expected 'base64-token rank', got "
                                 f"{line[:60]!r}") from None
    config_path = path.with_name("tiktoken_config.json")
    config = read_json(config_path) if config_path.is_file() else {}
    specials = config.get("special_tokens") or {}
    ids = {}
    for key in ("bos_token", "eos_token"):
        name = config.get(key)
        if name is not None and name not in specials:
            raise TokenizerError(
                f"{config_path}: {key} {name!r} is not one of special_tokens {sorted(specials)}"
            )
        ids[key] = specials.get(name) if name is not None else None
    return TiktokenTokenizer(
        make_encoding(
            path.parent.name or path.name, ranks, config.get("pat_str", GPT2_PATTERN), specials
        ),
        bos_id=ids["bos_token"],
        eos_id=ids["eos_token"],
        normalization=config.get("normalization"),
        presplit=config.get("presplit"),
        add_prefix_space=bool(config.get("add_prefix_space", False)),
    )
