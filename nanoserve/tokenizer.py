"""Tokenizers: text <-> token ids for every model nanoserve runs.

Two engines cover the vocabulary formats that checkpoints ship with:

* **tiktoken** (Rust, fast) runs every *byte-level* BPE: GPT-2's ``encoder.json`` + ``vocab.bpe``, HF
  ``tokenizer.json`` files of the GPT-2 / Llama-3 / Qwen2 / SmolLM family (converted to tiktoken's
  "mergeable ranks"), ``tokenizer.tiktoken`` files, and the 257-token byte tokenizer of our demo models.
* A small pure-Python **SentencePiece BPE** runs Llama-2 style vocabularies (``tokenizer.model``
  protobufs, llama2.c ``tokenizer.bin`` / ``tok512.bin``). There a merge is chosen by the *score* of the
  merged piece over unicode characters, with byte fallback for unknown characters: tiktoken's
  rank-over-bytes BPE cannot express that exactly.

Both engines have the members of :class:`Tokenizer`; :func:`load_tokenizer` picks one by the files it
finds. ``encode`` never parses special-token text (``"<|endoftext|>"`` in a prompt is ordinary text), so a
prompt cannot inject control tokens; ``bos=True`` prepends the BOS id instead.

Tests (tests/test_tokenizer.py) hold both engines to outside references: llama.cpp's tokenizer vectors for
GPT-2 and Llama-2, and the HF ``tokenizers`` library on tokenizer.json files built offline.
"""

from __future__ import annotations

import base64
import functools
import heapq
import json
import operator
import os
import re
import struct
import threading
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import regex
import tiktoken

from nanoserve.errors import NanoserveError

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
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", ENDOFTEXT, "</s>", "<eos>", "<|im_end|>")
_NETWORK_TIMEOUT_S = 30.0  # for tiktoken.get_encoding, which downloads when its cache is cold

# SentencePiece piece types (sentencepiece_model.proto, ModelProto.SentencePiece.Type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_PIECE = re.compile(r"<0x([0-9A-F]{2})>")


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


def _check_text(text: object) -> None:
    if not isinstance(text, str):
        raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")


def _check_ids(ids: Iterable[int], vocab_size: int) -> list[int]:
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


def _check_special_ids(vocab_size: int, **ids: int | None) -> None:
    for name, value in ids.items():
        if value is not None and not 0 <= value < vocab_size:
            raise TokenizerError(f"{name}={value} is outside the vocabulary (vocab_size={vocab_size})")


def _prepend_bos(ids: list[int], bos: bool, bos_id: int | None) -> list[int]:
    if not bos:
        return ids
    if bos_id is None:
        raise TokenizerError("encode(bos=True): this tokenizer has no BOS token (bos_id is None)")
    return [bos_id, *ids]


# ---------------------------------------------------------------------------------------------------------
# tiktoken engine: byte-level BPE
# ---------------------------------------------------------------------------------------------------------


class TiktokenTokenizer:
    """A byte-level BPE run by a ``tiktoken.Encoding`` (ranks == token ids, a split regex, special tokens).

    Three optional steps reproduce HF pipelines that tiktoken lacks: a unicode ``normalization`` form
    (Qwen2: "NFC"), a ``presplit`` regex whose matches and the gaps between them are encoded separately
    (SmolLM's Digits pre-tokenizer: ``\\p{N}``), and ByteLevel's ``add_prefix_space`` (a space put before
    each piece that does not start with one).
    """

    def __init__(
        self,
        encoding: tiktoken.Encoding,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        normalization: str | None = None,
        presplit: str | None = None,
        add_prefix_space: bool = False,
    ) -> None:
        if normalization not in (None, "NFC", "NFD", "NFKC", "NFKD"):
            raise TokenizerError(f"normalization {normalization!r}: allowed are None, NFC, NFD, NFKC, NFKD")
        self.encoding = encoding
        self.vocab_size = encoding.n_vocab
        _check_special_ids(self.vocab_size, bos_id=bos_id, eos_id=eos_id)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.normalization = normalization
        self.presplit = presplit
        self.add_prefix_space = add_prefix_space
        self._presplit_re = regex.compile(presplit) if presplit else None

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """Token ids of `text`; special-token text is encoded as ordinary text."""
        _check_text(text)
        if self.normalization:
            text = unicodedata.normalize(self.normalization, text)
        ids: list[int] = []
        for piece in self._pieces(text):
            ids.extend(self.encoding.encode_ordinary(piece))
        return _prepend_bos(ids, bos, self.bos_id)

    def _pieces(self, text: str) -> list[str]:
        """The text as the pieces tiktoken encodes one by one (the whole text unless a step splits it)."""
        pieces = _split_isolated(self._presplit_re, text) if self._presplit_re else [text]
        if self.add_prefix_space:
            pieces = [p if p.startswith(" ") else " " + p for p in pieces if p]
        return pieces

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        """Text → id of the special tokens (encode() never produces them from text; chat templates do)."""
        return {t: self.encoding.encode_single_token(t) for t in self.encoding.special_tokens_set}

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of the tokens, concatenated: decode_bytes(a + b) == decode_bytes(a) + decode_bytes(b)."""
        checked = _check_ids(ids, self.vocab_size)
        try:
            return self.encoding.decode_bytes(checked)
        except KeyError as e:  # an id inside the range that no token has (vocabularies with holes)
            raise TokenizerError(f"{e.args[0]}: no token has this id in this vocabulary") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the tokens; bytes that are not valid UTF-8 (a cut-off character) become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def _split_isolated(pattern: regex.Pattern, text: str) -> list[str]:
    """Split like HF's Split(behavior="Isolated"): every match is a piece, and so is every gap between."""
    pieces, start = [], 0
    for match in pattern.finditer(text):
        if match.start() > start:
            pieces.append(text[start : match.start()])
        if match.end() > match.start():
            pieces.append(match.group())
        start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def _encoding(
    name: str, ranks: dict[bytes, int], pat_str: str, specials: dict[str, int]
) -> tiktoken.Encoding:
    """A tiktoken.Encoding, after checking what tiktoken assumes but does not check itself."""
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"{name}: {len(missing)} single bytes (first: 0x{missing[0]:02X}) have no token; a byte-level "
            "BPE needs all 256 so that any text can be encoded"
        )
    clash = set(ranks.values()) & set(specials.values())
    if clash:
        raise TokenizerError(f"{name}: ids {sorted(clash)[:5]} are both ordinary and special tokens")
    _check_pattern_covers_text(name, pat_str)
    return tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)


_PROBE_TEXT = "Hello, World! it's 2024: 3.14 ünïcödé 日本語 🦙🦙  \t\n\n x\r\n  ;-) \x00\x7f 'S'LL "


def _check_pattern_covers_text(name: str, pat_str: str) -> None:
    """tiktoken encodes only what the split regex matches; a regex that skips characters would drop text."""
    try:
        covered = "".join(regex.findall(pat_str, _PROBE_TEXT))
    except regex.error as e:
        raise TokenizerError(f"{name}: split regex {pat_str!r} does not compile: {e}") from None
    if covered != _PROBE_TEXT:
        raise TokenizerError(
            f"{name}: split regex {pat_str!r} does not match every character of a sample text; tiktoken "
            "would silently drop the unmatched text"
        )


# GPT-2 keeps its BPE strings printable: each byte becomes one visible character. Bytes that print as
# themselves ('!'..'~', '¡'..'¬', '®'..'ÿ') keep their character; the other 68 (space, control bytes,
# soft hyphen, ...) become chr(256), chr(257), ... in byte order.
def _byte_to_char_table() -> dict[int, str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table


_BYTE_TO_CHAR = _byte_to_char_table()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _token_bytes(token: str, where: object) -> bytes:
    """Undo GPT-2's byte -> character mapping on one vocabulary string."""
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError as e:
        raise TokenizerError(
            f"{where}: token {token!r} has the character {e.args[0]!r}, which is not in GPT-2's byte "
            "alphabet: this is not a byte-level BPE vocabulary"
        ) from None


def _bpe_ranks(
    vocab: dict[str, int], merges: Sequence[tuple[str, str]], special_ids: set[int], where: object
) -> dict[bytes, int]:
    """tiktoken's mergeable ranks for a byte-level BPE given as vocab + merge list (HF, GPT-2 files).

    tiktoken merges, at every step, the adjacent pair whose concatenation has the lowest rank, and uses the
    token id as the rank; HF merges the pair that comes first in the merge list. The two agree when each
    merge's result has a larger id than its parts, ids grow along the merge list, and every multi-byte token
    is made by some merge (else tiktoken could make tokens that HF never does). Anything else is rejected.
    """
    ranks = {_token_bytes(token, where): i for token, i in vocab.items() if i not in special_ids}
    made: set[int] = set()
    previous = -1
    for n, merge in enumerate(merges):
        if len(merge) != 2:
            raise TokenizerError(f"{where}: merge #{n} {merge!r} is not a pair of tokens")
        left, right = merge
        ids = [vocab.get(left), vocab.get(right), vocab.get(left + right)]
        if None in ids or ids[2] in special_ids:
            raise TokenizerError(
                f"{where}: merge #{n} ({left!r} + {right!r}) uses a token that is not in the vocab or makes "
                "an added token"
            )
        i_left, i_right, i_merged = ids
        if i_merged <= max(i_left, i_right) or i_merged < previous:
            raise TokenizerError(
                f"{where}: merge #{n} ({left!r} + {right!r} -> id {i_merged}) breaks merge order (parts "
                f"have ids {i_left} and {i_right}, the previous merge made id {previous}): tiktoken needs "
                "token ids that grow with the merge list, so this vocabulary is not tiktoken-compatible"
            )
        previous = i_merged
        made.add(i_merged)
    unmade = [token for token, i in ranks.items() if len(token) > 1 and i not in made]
    if unmade:
        raise TokenizerError(
            f"{where}: {len(unmade)} multi-byte tokens (e.g. {unmade[0]!r}) are made by no merge; tiktoken "
            "would produce them where the original tokenizer does not, so this is not tiktoken-compatible"
        )
    return ranks


def byte_level_tokenizer() -> TiktokenTokenizer:
    """257 tokens: one per byte (id == byte value) and ``<|endoftext|>`` = 256, the EOS (no BOS).

    The tokenizer of our demo models: no merges, so any text (and any byte string decoded as UTF-8)
    round-trips, and the model learns UTF-8 itself.
    """
    ranks = {bytes([b]): b for b in range(256)}
    encoding = _encoding("nanoserve-bytes", ranks, GPT2_PATTERN, {ENDOFTEXT: 256})
    return TiktokenTokenizer(encoding, bos_id=None, eos_id=256)


def gpt2_tokenizer(directory: str | os.PathLike) -> TiktokenTokenizer:
    """GPT-2 (r50k): ``encoder.json`` + ``vocab.bpe`` in `directory`; ``<|endoftext|>`` is BOS and EOS."""
    directory = Path(directory)
    vocab = _read_json(directory / "encoder.json")
    lines = _read_text(directory / "vocab.bpe").splitlines()
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merges = [tuple(line.split(" ")) for line in lines if line]
    specials = {t: vocab[t] for t in (ENDOFTEXT, "<|startoftext|>") if t in vocab}
    ranks = _bpe_ranks(vocab, merges, set(specials.values()), directory / "vocab.bpe")
    eot = specials.get(ENDOFTEXT)
    return TiktokenTokenizer(_encoding("gpt2", ranks, GPT2_PATTERN, specials), bos_id=eot, eos_id=eot)


def tiktoken_named(name: str = "gpt2") -> TiktokenTokenizer:
    """A tokenizer from tiktoken's registry, which downloads it once (then caches): needs the network.

    Runs in a daemon thread so that an offline machine gets a TokenizerError after
    ``_NETWORK_TIMEOUT_S`` seconds instead of a hang.
    """
    result: dict[str, Any] = {}

    def fetch() -> None:
        try:
            result["encoding"] = tiktoken.get_encoding(name)
        except BaseException as e:  # noqa: BLE001 - reported below, in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    thread.join(_NETWORK_TIMEOUT_S)
    hint = "pass a directory with encoder.json + vocab.bpe instead"
    if thread.is_alive():
        raise TokenizerError(
            f"tiktoken.get_encoding({name!r}) took over {_NETWORK_TIMEOUT_S:g} s (offline?): {hint}"
        )
    if "error" in result:
        error = result["error"]
        raise TokenizerError(
            f"tiktoken.get_encoding({name!r}) failed ({type(error).__name__}: {error}): {hint}"
        )
    encoding = result["encoding"]
    eot = encoding._special_tokens.get(ENDOFTEXT)
    return TiktokenTokenizer(encoding, bos_id=eot, eos_id=eot)


# ---------------------------------------------------------------------------------------------------------
# HF tokenizer.json (byte-level BPE) -> tiktoken
# ---------------------------------------------------------------------------------------------------------


def hf_tokenizer(path: str | os.PathLike) -> TiktokenTokenizer:
    """A HF ``tokenizer.json`` byte-level BPE, converted to tiktoken ranks.

    Supported pre-tokenizers: ``ByteLevel`` (GPT-2 regex); ``Sequence[Split(regex), ByteLevel(use_regex=
    False)]`` (Llama-3, Qwen2); either one after a ``Digits`` or ``Split`` step (SmolLM); normalizers: none
    or one unicode form (NFC ...). All added tokens become special tokens; like every nanoserve tokenizer,
    encode() treats their text as ordinary text (HF would match non-special added tokens in the text).
    BOS / EOS come from ``tokenizer_config.json`` beside the file, else from common token names.

    Known gap: HF merges only listed pairs, tiktoken any pair that forms a token; `_bpe_ranks` rejects the
    vocabularies where that can matter in ways we can check, and the tests compare with HF directly.
    """
    path = Path(path)
    spec = _read_json(path)
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise TokenizerError(
            f"{path}: model type {kind!r}; only byte-level 'BPE' tokenizer.json is supported"
        )
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise TokenizerError(f"{path}: BPE option {key}={model[key]!r} is not supported (must be null)")
    pat_str, presplit, add_prefix_space = _hf_pre_tokenizer(spec.get("pre_tokenizer"), path)
    normalization = _hf_normalizer(spec.get("normalizer"), path)
    added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
    vocab = model.get("vocab") or {}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    ranks = _bpe_ranks(vocab, merges, set(added.values()), path)
    encoding = _encoding(path.parent.name or "tokenizer.json", ranks, pat_str, added)

    config_path = path.with_name("tokenizer_config.json")
    config = _read_json(config_path) if config_path.is_file() else {}
    names = {**vocab, **added}  # vocab keys are byte-level strings: equal to the text for printable ASCII
    bos_id = _special_id(config, "bos_token", _BOS_NAMES, names, config_path)
    eos_id = _special_id(config, "eos_token", _EOS_NAMES, names, config_path)
    if bos_id is None and "bos_token" not in config and eos_id is not None and eos_id == names.get(ENDOFTEXT):
        bos_id = eos_id  # GPT-2's convention: <|endoftext|> starts and ends documents
    return TiktokenTokenizer(
        encoding,
        bos_id=bos_id,
        eos_id=eos_id,
        normalization=normalization,
        presplit=presplit,
        add_prefix_space=add_prefix_space,
    )


def _hf_pre_tokenizer(spec: dict | None, where: Path) -> tuple[str, str | None, bool]:
    """(tiktoken regex, presplit regex or None, add_prefix_space) for a tokenizer.json pre_tokenizer."""
    if spec and spec.get("type") == "Sequence":
        steps = list(spec.get("pretokenizers") or [])
    else:
        steps = [spec] if spec else []
    if not steps or steps[-1].get("type") != "ByteLevel":
        raise TokenizerError(
            f"{where}: pre_tokenizer {spec!r} is not byte-level; supported: ByteLevel, or a Sequence ending "
            "in ByteLevel (after at most a Split and a Split/Digits step)"
        )
    byte_level = steps.pop()
    if byte_level.get("use_regex", True):
        pat_str = GPT2_PATTERN
    elif steps and steps[-1].get("type") == "Split":
        pat_str = _split_regex(steps.pop(), where)
    else:
        raise TokenizerError(f"{where}: ByteLevel(use_regex=false) must follow a Split pre-tokenizer")
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
            f"{where}: pre-tokenizer step {step!r} is not supported; allowed: Split(behavior=Isolated, "
            "invert=false), Digits"
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
    """The id of config[key] (a token string or {"content": ...}); without the key, the first known name."""
    if key not in config:
        return next((names[n] for n in fallbacks if n in names), None)
    value = config[key]
    name = value.get("content") if isinstance(value, dict) else value
    if name is None:
        return None
    if name not in names:
        raise TokenizerError(f"{where}: {key} {name!r} is not a token of the vocabulary")
    return names[name]


# ---------------------------------------------------------------------------------------------------------
# tokenizer.tiktoken files: "base64(token bytes) rank" lines + tiktoken_config.json
# ---------------------------------------------------------------------------------------------------------


def save_tiktoken(tokenizer: TiktokenTokenizer, directory: str | os.PathLike) -> Path:
    """Write `tokenizer` as ``tokenizer.tiktoken`` + ``tiktoken_config.json`` in `directory`; return the dir.

    :func:`load_tokenizer` reads it back (e.g. the demo byte tokenizer saved next to a checkpoint).
    """
    if not isinstance(tokenizer, TiktokenTokenizer):
        raise TokenizerError(
            f"save_tiktoken needs a tiktoken-backed tokenizer, got {type(tokenizer).__name__} (SentencePiece "
            "score-based merges have no tiktoken form)"
        )
    encoding = tokenizer.encoding
    special_names = {i: name for name, i in encoding._special_tokens.items()}
    config: dict[str, Any] = {"pat_str": encoding._pat_str, "special_tokens": encoding._special_tokens}
    for key, token in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
        if token is not None and token not in special_names:
            raise TokenizerError(f"save_tiktoken: {key} id {token} is not a special token, so it has no name")
        config[key] = special_names.get(token)
    for key in ("normalization", "presplit", "add_prefix_space"):
        if getattr(tokenizer, key):
            config[key] = getattr(tokenizer, key)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = sorted(encoding._mergeable_ranks.items(), key=lambda item: item[1])
    lines = [f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks]
    (directory / "tokenizer.tiktoken").write_text("".join(lines), encoding="ascii")
    (directory / "tiktoken_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return directory


def tiktoken_file_tokenizer(path: str | os.PathLike) -> TiktokenTokenizer:
    """A ``tokenizer.tiktoken`` file and the ``tiktoken_config.json`` beside it (if absent: GPT-2's regex)."""
    path = Path(path)
    ranks = {}
    for n, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise TokenizerError(f"{path}:{n}: expected 'base64-token rank', got {line[:60]!r}") from None
    config_path = path.with_name("tiktoken_config.json")
    config = _read_json(config_path) if config_path.is_file() else {}
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
        _encoding(path.parent.name or path.name, ranks, config.get("pat_str", GPT2_PATTERN), specials),
        bos_id=ids["bos_token"],
        eos_id=ids["eos_token"],
        normalization=config.get("normalization"),
        presplit=config.get("presplit"),
        add_prefix_space=bool(config.get("add_prefix_space", False)),
    )


# ---------------------------------------------------------------------------------------------------------
# SentencePiece BPE (Llama-2): score-ordered merges over unicode characters, byte fallback
# ---------------------------------------------------------------------------------------------------------


class SentencePieceTokenizer:
    """SentencePiece's BPE encoder, in pure Python.

    encode: spaces become "▁" and a "▁" is put in front (``add_dummy_prefix``); the text is split into
    characters; then, repeatedly, the adjacent pair whose concatenation is the highest-scoring vocabulary
    piece is merged (leftmost on ties). Characters left outside the vocabulary become one ``<0xXX>`` token
    per UTF-8 byte (``byte_fallback``) or ``unk_id``. decode: "▁" -> " ", byte tokens -> their byte,
    control and unknown tokens -> nothing, and (like ``sp.decode``) the one space that the dummy prefix
    put at the start is dropped. ``decode_bytes`` keeps that space, so that it concatenates over a stream.
    """

    def __init__(
        self,
        pieces: Sequence[str],
        scores: Sequence[float],
        types: Sequence[int],
        *,
        unk_id: int | None = 0,
        bos_id: int | None = 1,
        eos_id: int | None = 2,
        add_dummy_prefix: bool = True,
        remove_extra_whitespaces: bool = False,
        byte_fallback: bool = True,
    ) -> None:
        if not len(pieces) == len(scores) == len(types):
            raise TokenizerError(f"{len(pieces)} pieces, {len(scores)} scores and {len(types)} types differ")
        self.pieces, self.scores, self.types = list(pieces), list(scores), list(types)
        self.vocab_size = len(self.pieces)
        _check_special_ids(self.vocab_size, unk_id=unk_id, bos_id=bos_id, eos_id=eos_id)
        self.unk_id, self.bos_id, self.eos_id = unk_id, bos_id, eos_id
        self.add_dummy_prefix = add_dummy_prefix
        self.remove_extra_whitespaces = remove_extra_whitespaces
        kinds = list(zip(self.pieces, self.types))
        self._merge_score = {p: s for p, s, t in zip(self.pieces, self.scores, self.types) if t == NORMAL}
        self._piece_id: dict[str, int] = {}
        for i, (piece, kind) in enumerate(kinds):
            if kind in (NORMAL, USER_DEFINED, UNUSED):
                self._piece_id.setdefault(piece, i)
        self._byte_id = {int(p[3:5], 16): i for i, (p, t) in enumerate(kinds) if t == BYTE}
        self.byte_fallback = byte_fallback
        if byte_fallback and sorted(self._byte_id) != list(range(256)):
            raise TokenizerError(
                f"byte_fallback needs 256 <0xXX> byte pieces, this vocabulary has {len(self._byte_id)}"
            )
        if not byte_fallback and unk_id is None:
            raise TokenizerError("a SentencePiece vocabulary without byte_fallback needs an unk_id")
        user = sorted((p for p, t in kinds if t == USER_DEFINED and p), key=len, reverse=True)
        self._user_re = regex.compile("|".join(map(regex.escape, user))) if user else None
        self._bytes = [_piece_surface(p, t) for p, t in kinds]

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """Token ids of `text` (what ``sp.encode(text)`` gives); special-token text is ordinary text."""
        _check_text(text)
        ids: list[int] = []
        for symbol in self._segment(self._normalize(text)):
            token = self._piece_id.get(symbol)
            if token is not None:
                ids.append(token)
            elif self.byte_fallback:
                ids.extend(self._byte_id[b] for b in symbol.encode("utf-8"))
            elif not (ids and ids[-1] == self.unk_id):  # SentencePiece merges a run of unknowns into one
                ids.append(self.unk_id)
        return _prepend_bos(ids, bos, self.bos_id)

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        """Text → id of the control tokens (<s>, </s>, ...), which encode() never produces from text."""
        return {p: i for i, (p, t) in enumerate(zip(self.pieces, self.types)) if t == CONTROL and p}

    def _normalize(self, text: str) -> str:
        if self.remove_extra_whitespaces:
            text = re.sub(" +", " ", text).strip(" ")
        if not text:
            return ""
        text = text.replace(" ", SPACE)
        return SPACE + text if self.add_dummy_prefix else text

    def _segment(self, text: str) -> list[str]:
        """The merged symbols of `text`; user-defined pieces are matched first and never merged further."""
        if self._user_re is None:
            return self._bpe(list(text))
        symbols, start = [], 0
        for match in self._user_re.finditer(text):
            symbols += self._bpe(list(text[start : match.start()])) + [match.group()]
            start = match.end()
        return symbols + self._bpe(list(text[start:]))

    def _pair_priority(self, score: float, position: int) -> tuple[float, int]:
        """Heap key of a candidate merge: highest score first, then leftmost (smallest key pops first)."""
        return (-score, position)

    def _bpe(self, symbols: list[str]) -> list[str]:
        """Merge adjacent symbols, best pair first, until no adjacent pair forms a mergeable piece.

        The symbols form a linked list (prev/next indices); candidate pairs wait in a heap keyed by
        `_pair_priority` and are dropped on pop when a merge has since changed either side (lazy deletion).
        Each merged symbol keeps the position of its left part, which is what the tie-break compares.
        """
        n = len(symbols)
        symbols = list(symbols)
        prev = list(range(-1, n - 1))
        next_ = [*range(1, n), -1] if n else []
        heap: list[tuple[tuple[float, int], int, str]] = []

        def push(left: int) -> None:
            right = next_[left] if left != -1 else -1
            if right == -1:
                return
            merged = symbols[left] + symbols[right]
            score = self._merge_score.get(merged)
            if score is not None:
                heapq.heappush(heap, (self._pair_priority(score, left), left, merged))

        for i in range(n - 1):
            push(i)
        while heap:
            _, left, merged = heapq.heappop(heap)
            right = next_[left]
            if not symbols[left] or right == -1 or symbols[left] + symbols[right] != merged:
                continue  # stale: one side was merged into something else after this pair was pushed
            symbols[left], symbols[right] = merged, ""
            next_[left] = next_[right]
            if next_[right] != -1:
                prev[next_[right]] = left
            push(prev[left])
            push(left)
        return [s for s in symbols if s]

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of the tokens, concatenated (keeps the dummy-prefix space: safe to stream)."""
        return b"".join(self._bytes[i] for i in _check_ids(ids, self.vocab_size))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the tokens as ``sp.decode`` gives it: without the leading space of the dummy prefix."""
        ids = _check_ids(ids, self.vocab_size)
        text = self.decode_bytes(ids).decode("utf-8", errors="replace")
        if self.add_dummy_prefix or self.remove_extra_whitespaces:
            first = next((i for i in ids if self.types[i] not in (CONTROL, UNKNOWN)), None)
            if first is not None and self.pieces[first].startswith(SPACE):
                text = text[1:]
        return text


def _piece_surface(piece: str, kind: int) -> bytes:
    """The bytes one piece decodes to."""
    if kind == BYTE:
        return bytes([int(piece[3:5], 16)])
    if kind in (CONTROL, UNKNOWN):
        return b""
    return piece.replace(SPACE, " ").encode("utf-8")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of the protobuf base-128 varint at `pos`."""
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _proto_fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) for each field of one protobuf message, in order.

    Wire type 0 (varint) gives an int; 1 (fixed64), 2 (length-delimited: strings, bytes, sub-messages)
    and 5 (fixed32: float) give the raw bytes. That is all ModelProto uses.
    """
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = data[pos : pos + size], pos + size
        else:
            raise ValueError(f"field {field} has wire type {wire}, which ModelProto does not use")
        if pos > len(data):
            raise ValueError(f"field {field} runs past the end of the data")
        yield field, value


def _int32(value: int) -> int:
    """A protobuf int32 read as a varint: negative numbers arrive as 64-bit two's complement."""
    return value - (1 << 64) if value >= 1 << 63 else value


def sentencepiece_tokenizer(path: str | os.PathLike) -> SentencePieceTokenizer:
    """A SentencePiece ``tokenizer.model`` (a ModelProto protobuf) of model type BPE.

    Field numbers, from sentencepiece_model.proto: ModelProto 1 pieces {1 piece, 2 score, 3 type},
    2 trainer_spec {3 model_type (1 unigram, 2 bpe; default unigram), 35 byte_fallback, 40 unk_id,
    41 bos_id, 42 eos_id}, 3 normalizer_spec {1 name, 2 precompiled_charsmap, 3 add_dummy_prefix,
    4 remove_extra_whitespaces, 5 escape_whitespaces; all three default true}.
    """
    path = Path(path)
    data = _read_bytes(path)
    pieces, scores, types = [], [], []
    trainer: dict[int, Any] = {}
    normalizer: dict[int, Any] = {}
    try:
        for field, value in _proto_fields(data):
            if field == 1:
                piece = dict(_proto_fields(value))
                pieces.append(piece[1].decode("utf-8"))
                scores.append(struct.unpack("<f", piece[2])[0] if 2 in piece else 0.0)
                types.append(piece.get(3, NORMAL))
            elif field == 2:
                trainer = dict(_proto_fields(value))
            elif field == 3:
                normalizer = dict(_proto_fields(value))
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise TokenizerError(
            f"{path}: not a SentencePiece model protobuf ({type(e).__name__}: {e})"
        ) from None
    if not pieces:
        raise TokenizerError(f"{path}: no pieces found; not a SentencePiece model")
    model_type = trainer.get(3, 1)
    if model_type != 2:
        kind = {1: "UNIGRAM", 3: "WORD", 4: "CHAR"}.get(model_type, str(model_type))
        raise TokenizerError(f"{path}: SentencePiece model type {kind}; only BPE models are supported")
    if normalizer.get(2) or not normalizer.get(5, 1):
        name = normalizer.get(1, b"?").decode("utf-8", "replace")
        raise TokenizerError(
            f"{path}: normalizer {name!r} rewrites text with its own rules; only 'identity' is supported"
        )
    ids = {
        key: _int32(trainer.get(field, default))
        for key, field, default in (("unk_id", 40, 0), ("bos_id", 41, 1), ("eos_id", 42, 2))
    }
    return SentencePieceTokenizer(
        pieces,
        scores,
        types,
        **{key: (None if value < 0 else value) for key, value in ids.items()},
        add_dummy_prefix=bool(normalizer.get(3, 1)),
        remove_extra_whitespaces=bool(normalizer.get(4, 1)),
        byte_fallback=bool(trainer.get(35, 0)),
    )


def llama2c_tokenizer(path: str | os.PathLike) -> SentencePieceTokenizer:
    """A llama2.c ``tokenizer.bin`` / ``tok512.bin``: the pieces and scores of a SentencePiece BPE.

    Layout (little-endian): int32 max_token_length, then per token float32 score, int32 length, bytes.
    Spaces are stored as " " (not "▁"); types are implied: ids 0/1/2 are <unk>/<s>/</s>, ``<0xXX>`` pieces
    are bytes, the rest normal. llama2.c adds the dummy prefix, as Llama-2's model does.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise TokenizerError(f"{path}: {len(data)} bytes is too short for a llama2.c tokenizer")
    (max_length,) = struct.unpack_from("<i", data, 0)
    if not 0 < max_length <= 1024:
        raise TokenizerError(
            f"{path}: header max_token_length={max_length}; a llama2.c tokenizer has 1..1024"
        )
    pieces, scores, pos = [], [], 4
    while pos < len(data):
        if pos + 8 > len(data):
            raise TokenizerError(f"{path}: file ends inside the header of token {len(pieces)}")
        score, length = struct.unpack_from("<fi", data, pos)
        pos += 8
        if not 0 <= length <= max_length or pos + length > len(data):
            raise TokenizerError(
                f"{path}: token {len(pieces)} has length {length} (max_token_length={max_length})"
            )
        try:
            pieces.append(data[pos : pos + length].decode("utf-8"))
        except UnicodeDecodeError:
            raise TokenizerError(f"{path}: token {len(pieces)} is not valid UTF-8") from None
        scores.append(score)
        pos += length
    if len(pieces) < 3:
        raise TokenizerError(f"{path}: {len(pieces)} tokens; ids 0/1/2 must be <unk>/<s>/</s>")
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE if _BYTE_PIECE.fullmatch(p) else NORMAL for p in pieces[3:]]
    pieces = [p.replace(" ", SPACE) if t == NORMAL else p for p, t in zip(pieces, types)]
    byte_fallback = types.count(BYTE) == 256
    return SentencePieceTokenizer(pieces, scores, types, byte_fallback=byte_fallback)


# ---------------------------------------------------------------------------------------------------------
# Loading by path
# ---------------------------------------------------------------------------------------------------------


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds any of RECOGNISED_FILES (a checkpoint may come without a tokenizer)."""
    p = Path(directory)
    names = ("tokenizer.json", "encoder.json", "tokenizer.model", "tokenizer.bin", "tokenizer.tiktoken")
    return p.is_dir() and (any((p / n).is_file() for n in names) or any(p.glob("tok*.bin")))


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer in `path`: a directory (first found of RECOGNISED_FILES, in that order) or one file.

    A tokenizer.json that is not byte-level gives way to a tokenizer.model beside it (HF Llama-2 folders).

    The bare name "gpt2", when no such path exists, asks tiktoken's registry (needs the network once).
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
            # HF Llama-2 folders ship a SentencePiece-style tokenizer.json (not byte-level) next to the
            # tokenizer.model it was converted from: that file is the authoritative one.
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
        "(any *.json is read as a HF tokenizer.json, any *.model as SentencePiece, any *.bin as llama2.c)"
    )


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer file {str(path)!r}: {e.strerror or e}") from None


def _read_text(path: Path) -> str:
    try:
        return _read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text ({e})") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
