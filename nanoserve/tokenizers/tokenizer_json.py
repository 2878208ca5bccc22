"""HF ``tokenizer.json``: byte-level BPE converted to tiktoken's mergeable ranks, with the
pre-tokenizer's split regex and normalizer reproduced; or, for the SentencePiece-style files of
Llama-2 and Mistral ("▁" for spaces, byte fallback), sentencepiece.py's BPE with the file's merge
ranks (`MergesTokenizer`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import regex

from .base import (
    BOS_NAMES,
    BYTE,
    BYTE_PIECE,
    CONTROL,
    ENDOFTEXT,
    EOS_NAMES,
    GPT2_PATTERN,
    NORMAL,
    SPACE,
    UNKNOWN,
    TokenizerError,
    read_json,
)
from .bpe import TiktokenTokenizer, bpe_ranks, make_encoding
from .sentencepiece import MergesTokenizer


def hf_tokenizer(path: str | os.PathLike) -> TiktokenTokenizer | MergesTokenizer:
    """A HF ``tokenizer.json`` byte-level BPE, converted to tiktoken ranks; or a SentencePiece-style
    one (Llama-2,
    Mistral: "▁" for spaces, byte fallback), read by `_merges_tokenizer`.

    Supported pre-tokenizers: ``ByteLevel`` (GPT-2 regex); ``Sequence[Split(regex),
    ByteLevel(use_regex= False)]`` (Llama-3, Qwen2); either one after a ``Digits`` or ``Split`` step
    (SmolLM); normalizers: none or one unicode form (NFC ...). All added tokens become special
    tokens; like every nanoserve tokenizer, encode() treats their text as ordinary text (HF would
    match non-special added tokens in the text). BOS / EOS come from ``tokenizer_config.json``
    beside the file, else from common token names.

    Known gap: HF merges only listed pairs, tiktoken any pair that forms a token; `bpe_ranks`
    rejects the vocabularies where that can matter in ways we can check, and the tests compare with
    HF directly.
    """
    path = Path(path)
    spec = read_json(path)
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise TokenizerError(
            f"{path}: model type {kind!r}; only byte-level 'BPE' tokenizer.json is supported"
        )
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise TokenizerError(f"{path}: BPE option {key}={model[key]!r} is not supported (must "
                                 "be null)")
    merges = [
        tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []
    ]
    added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
    vocab = model.get("vocab") or {}
    # vocab keys are byte-level strings: equal to the text for printable ASCII
    names = {**vocab, **added}
    config_path = path.with_name("tokenizer_config.json")
    config = read_json(config_path) if config_path.is_file() else {}
    bos_id = _special_id(config, "bos_token", BOS_NAMES, names, config_path)
    eos_id = _special_id(config, "eos_token", EOS_NAMES, names, config_path)
    if _sentencepiece_style(spec):
        return _merges_tokenizer(path, spec, names, merges, bos_id, eos_id)
    pat_str, presplit, add_prefix_space = _hf_pre_tokenizer(spec.get("pre_tokenizer"), path)
    normalization = _hf_normalizer(spec.get("normalizer"), path)
    ranks = bpe_ranks(vocab, merges, set(added.values()), path)
    encoding = make_encoding(path.parent.name or "tokenizer.json", ranks, pat_str, added)
    if (
        bos_id is None
        and "bos_token" not in config
        and eos_id is not None
        and eos_id == names.get(ENDOFTEXT)
    ):
        bos_id = eos_id  # GPT-2's convention: <|endoftext|> starts and ends documents
    return TiktokenTokenizer(
        encoding,
        bos_id=bos_id,
        eos_id=eos_id,
        normalization=normalization,
        presplit=presplit,
        add_prefix_space=add_prefix_space,
    )


def _piece_type(piece: str, unk: str | None, special: set[str]) -> int:
    """A SentencePiece-style piece's type: a byte (<0xAB>), the unknown piece, a control token, or
    a normal piece."""
    if BYTE_PIECE.fullmatch(piece):
        return BYTE
    if piece == unk:
        return UNKNOWN
    if piece in special:
        return CONTROL
    return NORMAL


def _sentencepiece_style(spec: dict) -> bool:
    """Whether a tokenizer.json is a converted SentencePiece BPE: byte fallback, a Metaspace
    pre-tokenizer, or the "▁"-writing normalizer of Llama-2's files."""
    pre, norm = spec.get("pre_tokenizer") or {}, json.dumps(spec.get("normalizer"))
    return (
        bool(spec["model"].get("byte_fallback")) or pre.get("type") == "Metaspace" or SPACE in norm
    )


def _merges_tokenizer(path: Path, spec: dict, names: dict[str, int], merges: list[tuple[str, str]],
                      bos_id: int | None, eos_id: int | None) -> MergesTokenizer:
    """A SentencePiece-style tokenizer.json: spaces written "▁" (a normalizer Prepend("▁") +
    Replace(" ", "▁"), or a Metaspace pre-tokenizer), BPE over characters by merge rank, byte
    fallback to <0xXX> pieces."""
    model, norm, pre = spec["model"], spec.get("normalizer"), spec.get("pre_tokenizer")
    steps = (
        (norm.get("normalizers") or []) if isinstance(norm, dict) and norm.get("type") == "Sequence"
        else [norm] if norm else []
    )
    kinds = [(st.get("type"), st.get("prepend"), (st.get("pattern") or {}).get("String"),
              st.get("content"))
             for st in steps]
    if kinds not in ([], [("Prepend", SPACE, None, None), ("Replace", None, " ", SPACE)]):
        raise TokenizerError(f"{path}: normalizer {norm!r} is not supported with a "
                             "SentencePiece-style vocabulary; allowed: null, or Prepend('▁') then "
                             "Replace(' ', '▁')")
    if pre is not None and (
        pre.get("type") != "Metaspace" or pre.get("replacement", SPACE) != SPACE or kinds
    ):
        raise TokenizerError(f"{path}: pre_tokenizer {pre!r} is not supported here; allowed: null "
                             "(after the '▁' normalizer), or Metaspace('▁')")
    if pre is None:  # Llama-2's normalizer: "▁" before every text
        prefix = bool(kinds)
    else:  # Metaspace: prepend_scheme, or in older files add_prefix_space
        prefix = pre.get("prepend_scheme",
                         "always" if pre.get("add_prefix_space", True) else "never") != "never"
    special = {t["content"] for t in spec.get("added_tokens") or [] if t.get("special")}
    pieces = [""] * (max(names.values()) + 1)
    for piece, i in names.items():
        pieces[i] = piece
    unk = model.get("unk_token")
    types = [_piece_type(p, unk, special) for p in pieces]
    return MergesTokenizer(pieces, types, merges, split=bool((pre or {}).get("split", False)),
                           unk_id=names.get(unk),
                           bos_id=bos_id, eos_id=eos_id, add_dummy_prefix=prefix,
                           prefix_if_missing=pre is not None,
                           byte_fallback=bool(model.get("byte_fallback")))


def _hf_pre_tokenizer(spec: dict | None, where: Path) -> tuple[str, str | None, bool]:
    """(tiktoken regex, presplit regex or None, add_prefix_space) for a tokenizer.json
    pre_tokenizer."""
    if spec and spec.get("type") == "Sequence":
        steps = list(spec.get("pretokenizers") or [])
    else:
        steps = [spec] if spec else []
    if not steps or steps[-1].get("type") != "ByteLevel":
        raise TokenizerError(
            f"{where}: pre_tokenizer {spec!r} is not byte-level; supported: ByteLevel, or a "
            "Sequence ending in ByteLevel (after at most a Split and a Split/Digits step)"
        )
    byte_level = steps.pop()
    if byte_level.get("use_regex", True):
        pat_str = GPT2_PATTERN
    elif steps and steps[-1].get("type") == "Split":
        pat_str = _split_regex(steps.pop(), where)
    else:
        raise TokenizerError(f"{where}: ByteLevel(use_regex=false) must follow a Split "
                             "pre-tokenizer")
    if len(steps) > 1:
        raise TokenizerError(
            f"{where}: {len(steps) + 1} splitting steps before ByteLevel; at most 2 are supported"
        )
    presplit = _split_regex(steps[0], where) if steps else None
    return pat_str, presplit, bool(byte_level.get("add_prefix_space", False))


def _split_regex(step: dict, where: Path) -> str:
    """The regex of a Split(behavior=Isolated) or Digits pre-tokenizer step."""
    if step.get("type") == "Digits":
        return r"\p{N}" if step.get("individual_digits") else r"\p{N}+"
    if step.get("type") != "Split" or step.get("behavior") != "Isolated" or step.get("invert"):
        raise TokenizerError(
            f"{where}: pre-tokenizer step {step!r} is not supported; allowed: "
            "Split(behavior=Isolated, invert=false), Digits"
        )
    pattern = step.get("pattern") or {}
    if "Regex" in pattern:
        return pattern["Regex"]
    if "String" in pattern:
        return regex.escape(pattern["String"])
    raise TokenizerError(f"{where}: Split pattern {pattern!r} has neither 'Regex' nor 'String'")


def _hf_normalizer(spec: dict | None, where: Path) -> str | None:
    """The unicode normalization form of a tokenizer.json normalizer (None, NFC/NFD/NFKC/NFKD)."""
    if spec is None:
        return None
    if spec.get("type") == "Sequence" and len(spec.get("normalizers") or []) <= 1:
        inner = spec.get("normalizers") or []
        return _hf_normalizer(inner[0], where) if inner else None
    if spec.get("type") in ("NFC", "NFD", "NFKC", "NFKD"):
        return spec["type"]
    raise TokenizerError(
        f"{where}: normalizer {spec!r} is not supported; allowed: null, NFC, NFD, NFKC, NFKD"
    )


def _special_id(
    config: dict, key: str, fallbacks: tuple[str, ...], names: dict[str, int], where: Path
) -> int | None:
    """The id of config[key] (a token string or {"content": ...}); without the key, the first known
    name."""
    if key not in config:
        return next((names[n] for n in fallbacks if n in names), None)
    value = config[key]
    name = value.get("content") if isinstance(value, dict) else value
    if name is None:
        return None
    if name not in names:
        raise TokenizerError(f"{where}: {key} {name!r} is not a token of the vocabulary")
    return names[name]
