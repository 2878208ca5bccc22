"""The tiktoken engine: byte-level BPE (GPT-2 and the families that copied it), and the byte
tokenizer of the demo models. Taught in notebooks/01_*.
"""

from __future__ import annotations

import functools
import os
import threading
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import regex
import tiktoken

from .base import (
    ENDOFTEXT,
    GPT2_PATTERN,
    TokenizerError,
    check_ids,
    check_special_ids,
    check_text,
    prepend_bos,
    read_json,
    read_text,
)

NETWORK_TIMEOUT_S = 30.0  # for tiktoken.get_encoding, which downloads when its cache is cold


class TiktokenTokenizer:
    """A byte-level BPE run by a ``tiktoken.Encoding`` (ranks == token ids, a split regex, special
    tokens).

    Three optional steps reproduce HF pipelines that tiktoken lacks: a unicode ``normalization``
    form (Qwen2: "NFC"), a ``presplit`` regex whose matches and the gaps between them are encoded
    separately (SmolLM's Digits pre-tokenizer: ``\\p{N}``), and ByteLevel's ``add_prefix_space`` (a
    space put before each piece that does not start with one).
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
            raise TokenizerError(f"normalization {normalization!r}: allowed are None, NFC, NFD, "
                                 "NFKC, NFKD")
        self.encoding = encoding
        self.vocab_size = encoding.n_vocab
        check_special_ids(self.vocab_size, bos_id=bos_id, eos_id=eos_id)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.normalization = normalization
        self.presplit = presplit
        self.add_prefix_space = add_prefix_space
        self._presplit_re = regex.compile(presplit) if presplit else None

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """Token ids of `text`; special-token text is encoded as ordinary text."""
        check_text(text)
        if self.normalization:
            text = unicodedata.normalize(self.normalization, text)
        ids: list[int] = []
        for piece in self._pieces(text):
            ids.extend(self.encoding.encode_ordinary(piece))
        return prepend_bos(ids, bos, self.bos_id)

    def _pieces(self, text: str) -> list[str]:
        """The text as the pieces tiktoken encodes one by one (the whole text unless a step splits
        it)."""
        pieces = _split_isolated(self._presplit_re, text) if self._presplit_re else [text]
        if self.add_prefix_space:
            pieces = [p if p.startswith(" ") else " " + p for p in pieces if p]
        return pieces

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        """Text → id of the special tokens (encode() never produces them from text; chat templates
        do)."""
        return {t: self.encoding.encode_single_token(t) for t in self.encoding.special_tokens_set}

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of the tokens, concatenated: decode_bytes(a + b) == decode_bytes(a) +
        decode_bytes(b)."""
        checked = check_ids(ids, self.vocab_size)
        try:
            return self.encoding.decode_bytes(checked)
        except KeyError as e:  # an id inside the range that no token has (vocabularies with holes)
            raise TokenizerError(f"{e.args[0]}: no token has this id in this vocabulary") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the tokens; bytes that are not valid UTF-8 (a cut-off character) become
        U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def _split_isolated(pattern: regex.Pattern, text: str) -> list[str]:
    """Split like HF's Split(behavior="Isolated"): every match is a piece, and so is every gap
    between."""
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


def make_encoding(
    name: str, ranks: dict[bytes, int], pat_str: str, specials: dict[str, int]
) -> tiktoken.Encoding:
    """A tiktoken.Encoding, after checking what tiktoken assumes but does not check itself."""
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"{name}: {len(missing)} single bytes (first: 0x{missing[0]:02X}) have no token; a "
            "byte-level BPE needs all 256 so that any text can be encoded"
        )
    clash = set(ranks.values()) & set(specials.values())
    if clash:
        raise TokenizerError(f"{name}: ids {sorted(clash)[:5]} are both ordinary and special "
                             "tokens")
    _check_pattern_covers_text(name, pat_str)
    return tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)


_PROBE_TEXT = "Hello, World! it's 2024: 3.14 ünïcödé 日本語 🦙🦙  \t\n\n x\r\n  ;-) \x00\x7f 'S'LL "


def _check_pattern_covers_text(name: str, pat_str: str) -> None:
    """tiktoken encodes only what the split regex matches; a regex that skips characters would drop
    text."""
    try:
        covered = "".join(regex.findall(pat_str, _PROBE_TEXT))
    except regex.error as e:
        raise TokenizerError(f"{name}: split regex {pat_str!r} does not compile: {e}") from None
    if covered != _PROBE_TEXT:
        raise TokenizerError(
            f"{name}: split regex {pat_str!r} does not match every character of a sample text; "
            "tiktoken would silently drop the unmatched text"
        )


# GPT-2 keeps its BPE strings printable: each byte becomes one visible character. Bytes that print
# as themselves ('!'..'~', '¡'..'¬', '®'..'ÿ') keep their character; the other 68 (space, control
# bytes, soft hyphen, ...) become chr(256), chr(257), ... in byte order.
def _byte_to_char_table() -> dict[int, str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table


_BYTE_TO_CHAR = _byte_to_char_table()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def token_chars(token: bytes) -> str:
    """GPT-2's byte -> character mapping on one token's bytes (the form HF vocabularies are written
    in)."""
    return "".join(_BYTE_TO_CHAR[b] for b in token)


def token_bytes(token: str, where: object) -> bytes:
    """Undo GPT-2's byte -> character mapping on one vocabulary string."""
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError as e:
        raise TokenizerError(
            f"{where}: token {token!r} has the character {e.args[0]!r}, which is not in GPT-2's "
            "byte alphabet: this is not a byte-level BPE vocabulary"
        ) from None


def bpe_ranks(
    vocab: dict[str, int], merges: Sequence[tuple[str, str]], special_ids: set[int], where: object
) -> dict[bytes, int]:
    """tiktoken's mergeable ranks for a byte-level BPE given as vocab + merge list (HF, GPT-2
    files).

    tiktoken merges, at every step, the adjacent pair whose concatenation has the lowest rank, and
    uses the token id as the rank; HF merges the pair that comes first in the merge list. The two
    agree when each merge's result has a larger id than its parts, ids grow along the merge list,
    and every multi-byte token is made by some merge (else tiktoken could make tokens that HF never
    does). Anything else is rejected.
    """
    ranks = {token_bytes(token, where): i for token, i in vocab.items() if i not in special_ids}
    made: set[int] = set()
    previous = -1
    for n, merge in enumerate(merges):
        if len(merge) != 2:
            raise TokenizerError(f"{where}: merge #{n} {merge!r} is not a pair of tokens")
        left, right = merge
        ids = [vocab.get(left), vocab.get(right), vocab.get(left + right)]
        if None in ids or ids[2] in special_ids:
            raise TokenizerError(
                f"{where}: merge #{n} ({left!r} + {right!r}) uses a token that is not in the vocab "
                "or makes an added token"
            )
        i_left, i_right, i_merged = ids
        if i_merged <= max(i_left, i_right) or i_merged < previous:
            raise TokenizerError(
                f"{where}: merge #{n} ({left!r} + {right!r} -> id {i_merged}) breaks merge order "
                f"(parts have ids {i_left} and {i_right}, the previous merge made id {previous}): "
                "tiktoken needs token ids that grow with the merge list, so this vocabulary is "
                "not tiktoken-compatible"
            )
        previous = i_merged
        made.add(i_merged)
    unmade = [token for token, i in ranks.items() if len(token) > 1 and i not in made]
    if unmade:
        raise TokenizerError(
            f"{where}: {len(unmade)} multi-byte tokens (e.g. {unmade[0]!r}) are made by no merge; "
            "tiktoken would produce them where the original tokenizer does not, so this is not "
            "tiktoken-compatible"
        )
    return ranks


def byte_level_tokenizer(bos: bool = False) -> TiktokenTokenizer:
    """257 tokens: one per byte (id == byte value) and ``<|endoftext|>`` = 256, the EOS; with
    `bos`, ``<|endoftext|>`` is also the BOS (as GPT-2's is), for a model trained with it first.

    The tokenizer of our demo models: no merges, so any text (and any byte string decoded as UTF-8)
    round-trips, and the model learns UTF-8 itself.
    """
    ranks = {bytes([b]): b for b in range(256)}
    encoding = make_encoding("nanoserve-bytes", ranks, GPT2_PATTERN, {ENDOFTEXT: 256})
    return TiktokenTokenizer(encoding, bos_id=256 if bos else None, eos_id=256)


def gpt2_tokenizer(directory: str | os.PathLike) -> TiktokenTokenizer:
    """GPT-2 (r50k): ``encoder.json`` + ``vocab.bpe`` in `directory`; ``<|endoftext|>`` is BOS and
    EOS."""
    directory = Path(directory)
    vocab = read_json(directory / "encoder.json")
    lines = read_text(directory / "vocab.bpe").splitlines()
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merges = [tuple(line.split(" ")) for line in lines if line]
    specials = {t: vocab[t] for t in (ENDOFTEXT, "<|startoftext|>") if t in vocab}
    ranks = bpe_ranks(vocab, merges, set(specials.values()), directory / "vocab.bpe")
    eot = specials.get(ENDOFTEXT)
    return TiktokenTokenizer(
        make_encoding("gpt2", ranks, GPT2_PATTERN, specials), bos_id=eot, eos_id=eot
    )


def tiktoken_named(name: str = "gpt2") -> TiktokenTokenizer:
    """A tokenizer from tiktoken's registry, which downloads it once (then caches): needs the
    network.

    Runs in a daemon thread so that an offline machine gets a TokenizerError after
    ``NETWORK_TIMEOUT_S`` seconds instead of a hang.
    """
    result: dict[str, Any] = {}

    def fetch() -> None:
        try:
            result["encoding"] = tiktoken.get_encoding(name)
        except BaseException as e:  # noqa: BLE001 - reported below, in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    thread.join(NETWORK_TIMEOUT_S)
    hint = "pass a directory with encoder.json + vocab.bpe instead"
    if thread.is_alive():
        raise TokenizerError(
            f"tiktoken.get_encoding({name!r}) took over {NETWORK_TIMEOUT_S:g} s (offline?): {hint}"
        )
    if "error" in result:
        error = result["error"]
        raise TokenizerError(
            f"tiktoken.get_encoding({name!r}) failed ({type(error).__name__}: {error}): {hint}"
        )
    encoding = result["encoding"]
    eot = encoding._special_tokens.get(ENDOFTEXT)
    return TiktokenTokenizer(encoding, bos_id=eot, eos_id=eot)
