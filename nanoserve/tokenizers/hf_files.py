"""A tiktoken tokenizer written as HF files: ``tokenizer.json`` + ``tokenizer_config.json``, so any
tool that loads a tokenizer from a path with ``transformers.AutoTokenizer`` (benchmarks, eval
harnesses) gets the same ids as nanoserve. The reverse of tokenizer_json.py; the demo models ship
both formats.

tiktoken keeps only *ranks* (token bytes -> id, the lower the earlier it merges); a HF byte-level
BPE wants a vocabulary of GPT-2 byte-characters and an ordered *merge list*. Each multi-byte token's
merge is the last step of tiktoken's own BPE run on that token's bytes with the lower ranks only: it
ends in two parts, and (left, right) is the merge. Merges are listed in the order of the tokens they
make, and ``ignore_merges`` is on because tiktoken looks a whole piece up first.
tests/test_hf_tokenizer_files.py checks ids against ``transformers`` on a corpus, for the demo's
byte tokenizer and GPT-2's 50k merges.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .base import TokenizerError
from .bpe import TiktokenTokenizer
from .bpe import token_chars as _chars


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts tiktoken's BPE reaches on `token`'s bytes using only tokens ranked below it."""
    limit, parts = ranks[token], [bytes([b]) for b in token]
    while len(parts) > 2:
        best = min((ranks.get(parts[i] + parts[i + 1], limit), i) for i in range(len(parts) - 1))
        if best[0] >= limit:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise TokenizerError(f"token {token!r} (rank {limit}) is made by no single merge of "
                             "lower-ranked tokens; it cannot be written as a HF BPE merge list")
    return parts[0], parts[1]


def tokenizer_json(tokenizer: TiktokenTokenizer) -> dict:
    """The HF ``tokenizer.json`` of a plain tiktoken tokenizer (no normalizer, no presplit)."""
    if tokenizer.normalization or tokenizer.presplit or tokenizer.add_prefix_space:
        raise TokenizerError("only a plain tiktoken tokenizer (no normalization, presplit or "
                             "prefix space) can be written as tokenizer.json here")
    ranks: dict[bytes, int] = tokenizer.encoding._mergeable_ranks
    specials = dict(sorted(tokenizer.special_tokens.items(), key=lambda x: x[1]))
    merges = [_last_merge(t, ranks) for t in sorted((t for t in ranks if len(t) > 1),
                                                    key=ranks.__getitem__)]
    vocab = {_chars(t): i for t, i in sorted(ranks.items(), key=lambda x: x[1])} | specials
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                          "rstrip": False,
                          "normalized": False, "special": True} for t, i in specials.items()],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": tokenizer.encoding._pat_str},
             "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": True,
                  "vocab": vocab, "merges": [[_chars(a), _chars(b)] for a, b in merges]},
    }


def save_hf_tokenizer(tokenizer: TiktokenTokenizer, directory: str | os.PathLike,
                      model_max_length: int,
                      chat_template: str | None = None) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into `directory`; return it."""
    directory = Path(directory)
    by_id = {i: t for t, i in tokenizer.special_tokens.items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "bos_token": by_id.get(tokenizer.bos_id),
              "eos_token": by_id.get(tokenizer.eos_id), "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json(tokenizer),
                                                         ensure_ascii=False) + "\n",
                                              encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n",
                                                     encoding="utf-8")
    return directory
