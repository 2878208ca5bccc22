"""SentencePiece BPE (Llama-2): score-ordered merges over unicode characters, byte fallback,
read from a ``tokenizer.model`` protobuf.
"""

from __future__ import annotations

import functools
import heapq
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import regex

from .base import (
    BYTE,
    CONTROL,
    NORMAL,
    SPACE,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    TokenizerError,
    check_ids,
    check_special_ids,
    check_text,
    prepend_bos,
    read_bytes,
)
from .protobuf import int32, proto_fields


class SentencePieceTokenizer:
    """SentencePiece's BPE encoder, in pure Python.

    encode: spaces become "▁" and a "▁" is put in front (``add_dummy_prefix``); the text is split
    into characters; then, repeatedly, the adjacent pair whose concatenation is the highest-scoring
    vocabulary piece is merged (leftmost on ties). Characters left outside the vocabulary become one
    ``<0xXX>`` token per UTF-8 byte (``byte_fallback``) or ``unk_id``. decode: "▁" -> " ", byte
    tokens -> their byte, control and unknown tokens -> nothing, and (like ``sp.decode``) the one
    space that the dummy prefix put at the start is dropped. ``decode_bytes`` keeps that space, so
    that it concatenates over a stream.
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
            raise TokenizerError(f"{len(pieces)} pieces, {len(scores)} scores and {len(types)} "
                                 "types differ")
        self.pieces, self.scores, self.types = list(pieces), list(scores), list(types)
        self.vocab_size = len(self.pieces)
        check_special_ids(self.vocab_size, unk_id=unk_id, bos_id=bos_id, eos_id=eos_id)
        self.unk_id, self.bos_id, self.eos_id = unk_id, bos_id, eos_id
        self.add_dummy_prefix = add_dummy_prefix
        self.remove_extra_whitespaces = remove_extra_whitespaces
        kinds = list(zip(self.pieces, self.types))
        self._merge_score = {p: s for p, s,
                             t in zip(self.pieces, self.scores, self.types) if t == NORMAL}
        self._piece_id: dict[str, int] = {}
        for i, (piece, kind) in enumerate(kinds):
            if kind in (NORMAL, USER_DEFINED, UNUSED):
                self._piece_id.setdefault(piece, i)
        self._byte_id = {int(p[3:5], 16): i for i, (p, t) in enumerate(kinds) if t == BYTE}
        self.byte_fallback = byte_fallback
        if byte_fallback and sorted(self._byte_id) != list(range(256)):
            raise TokenizerError(
                "byte_fallback needs 256 <0xXX> byte pieces, this vocabulary has "
                f"{len(self._byte_id)}"
            )
        if not byte_fallback and unk_id is None:
            raise TokenizerError("a SentencePiece vocabulary without byte_fallback needs an unk_id")
        user = sorted((p for p, t in kinds if t == USER_DEFINED and p), key=len, reverse=True)
        self._user_re = regex.compile("|".join(map(regex.escape, user))) if user else None
        self._bytes = [_piece_surface(p, t) for p, t in kinds]

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """Token ids of `text` (what ``sp.encode(text)`` gives); special-token text is ordinary
        text."""
        check_text(text)
        ids: list[int] = []
        for symbol in self._segment(self._normalize(text)):
            token = self._piece_id.get(symbol)
            if token is not None:
                ids.append(token)
            elif self.byte_fallback:
                ids.extend(self._byte_id[b] for b in symbol.encode("utf-8"))
            elif not (ids and ids[-1] == self.unk_id):
                # SentencePiece merges a run of unknowns into one
                ids.append(self.unk_id)
        return prepend_bos(ids, bos, self.bos_id)

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        """Text → id of the control tokens (<s>, </s>, ...), which encode() never produces from
        text."""
        return {p: i for i, (p, t) in enumerate(zip(self.pieces, self.types)) if t == CONTROL and p}

    def _normalize(self, text: str) -> str:
        if self.remove_extra_whitespaces:
            text = re.sub(" +", " ", text).strip(" ")
        if not text:
            return ""
        text = text.replace(" ", SPACE)
        return SPACE + text if self.add_dummy_prefix else text

    def _segment(self, text: str) -> list[str]:
        """The merged symbols of `text`; user-defined pieces are matched first and never merged
        further."""
        if self._user_re is None:
            return self._bpe(list(text))
        symbols, start = [], 0
        for match in self._user_re.finditer(text):
            symbols += self._bpe(list(text[start : match.start()])) + [match.group()]
            start = match.end()
        return symbols + self._bpe(list(text[start:]))

    def _pair_priority(self, rank: float, position: int) -> tuple[float, int]:
        """Heap key of a candidate merge: the smallest rank first, then the leftmost (smallest key
        pops first)."""
        return (rank, position)

    def _pair_rank(self, left: str, right: str) -> float | None:
        """How early the pair merges (smaller first), or None if it never does: here, the merged
        piece's score, negated (SentencePiece); `MergesTokenizer` ranks pairs by a merge list (HF's
        BPE)."""
        score = self._merge_score.get(left + right)
        return None if score is None else -score

    def _bpe(self, symbols: list[str]) -> list[str]:
        """Merge adjacent symbols, best pair first, until no adjacent pair forms a mergeable piece.

        The symbols form a linked list (prev/next indices); candidate pairs wait in a heap keyed by
        `_pair_priority` and are dropped on pop when a merge has since changed either side (lazy
        deletion). Each merged symbol keeps the position of its left part, which is what the
        tie-break compares.
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
            rank = self._pair_rank(symbols[left], symbols[right])
            if rank is not None:
                heapq.heappush(heap,
                               (self._pair_priority(rank, left), left,
                                symbols[left] + symbols[right]))

        for i in range(n - 1):
            push(i)
        while heap:
            _, left, merged = heapq.heappop(heap)
            right = next_[left]
            if not symbols[left] or right == -1 or symbols[left] + symbols[right] != merged:
                # stale: one side was merged into something else after this pair was pushed
                continue
            symbols[left], symbols[right] = merged, ""
            next_[left] = next_[right]
            if next_[right] != -1:
                prev[next_[right]] = left
            push(prev[left])
            push(left)
        return [s for s in symbols if s]

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of the tokens, concatenated (keeps the dummy-prefix space: safe to stream)."""
        return b"".join(self._bytes[i] for i in check_ids(ids, self.vocab_size))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the tokens as ``sp.decode`` gives it: without the leading space of the dummy
        prefix."""
        ids = check_ids(ids, self.vocab_size)
        text = self.decode_bytes(ids).decode("utf-8", errors="replace")
        if self.add_dummy_prefix or self.remove_extra_whitespaces:
            first = next((i for i in ids if self.types[i] not in (CONTROL, UNKNOWN)), None)
            if first is not None and self.pieces[first].startswith(SPACE):
                text = text[1:]
        return text


class MergesTokenizer(SentencePieceTokenizer):
    """The same BPE over unicode characters with byte fallback, but a pair merges by its rank in a
    merge list, as HF's BPE does: what a Llama-2 / Mistral ``tokenizer.json`` holds
    (tokenizer_json.py reads it). split=True: the Metaspace pre-tokenizer's split, each word from a
    "▁" on, merged on its own."""

    def __init__(self, pieces: Sequence[str], types: Sequence[int],
                 merges: Sequence[tuple[str, str]], *,
                 split: bool = False, prefix_if_missing: bool = False, **kwargs) -> None:
        super().__init__(pieces, [0.0] * len(pieces), types, **kwargs)
        # the first listing wins
        self._ranks = {pair: rank for rank, pair in reversed(list(enumerate(merges)))}
        self.split = split  # Metaspace(split=True): each "▁"-led word is merged on its own
        # Metaspace: no "▁" prefix on a text that already starts with one
        self.prefix_if_missing = prefix_if_missing

    def _pair_rank(self, left: str, right: str) -> float | None:
        return self._ranks.get((left, right))

    def _normalize(self, text: str) -> str:
        if self.prefix_if_missing and text.startswith(" "):
            return text.replace(" ", SPACE)
        return super()._normalize(text)

    def _segment(self, text: str) -> list[str]:
        words = regex.findall(f"{SPACE}[^{SPACE}]*|[^{SPACE}]+", text) if self.split else [text]
        symbols = []
        for word in words:
            symbols += SentencePieceTokenizer._segment(self, word)
        return symbols


def _piece_surface(piece: str, kind: int) -> bytes:
    """The bytes one piece decodes to."""
    if kind == BYTE:
        return bytes([int(piece[3:5], 16)])
    if kind in (CONTROL, UNKNOWN):
        return b""
    return piece.replace(SPACE, " ").encode("utf-8")


def sentencepiece_tokenizer(path: str | os.PathLike) -> SentencePieceTokenizer:
    """A SentencePiece ``tokenizer.model`` (a ModelProto protobuf) of model type BPE.

    Field numbers, from sentencepiece_model.proto: ModelProto 1 pieces {1 piece, 2 score, 3 type},
    2 trainer_spec {3 model_type (1 unigram, 2 bpe; default unigram), 35 byte_fallback, 40 unk_id,
    41 bos_id, 42 eos_id}, 3 normalizer_spec {1 name, 2 precompiled_charsmap, 3 add_dummy_prefix,
    4 remove_extra_whitespaces, 5 escape_whitespaces; all three default true}.
    """
    path = Path(path)
    data = read_bytes(path)
    pieces, scores, types = [], [], []
    trainer: dict[int, Any] = {}
    normalizer: dict[int, Any] = {}
    try:
        for field, value in proto_fields(data):
            if field == 1:
                piece = dict(proto_fields(value))
                pieces.append(piece[1].decode("utf-8"))
                scores.append(struct.unpack("<f", piece[2])[0] if 2 in piece else 0.0)
                types.append(piece.get(3, NORMAL))
            elif field == 2:
                trainer = dict(proto_fields(value))
            elif field == 3:
                normalizer = dict(proto_fields(value))
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise TokenizerError(
            f"{path}: not a SentencePiece model protobuf ({type(e).__name__}: {e})"
        ) from None
    if not pieces:
        raise TokenizerError(f"{path}: no pieces found; not a SentencePiece model")
    model_type = trainer.get(3, 1)
    if model_type != 2:
        kind = {1: "UNIGRAM", 3: "WORD", 4: "CHAR"}.get(model_type, str(model_type))
        raise TokenizerError(f"{path}: SentencePiece model type {kind}; only BPE models are "
                             "supported")
    if normalizer.get(2) or not normalizer.get(5, 1):
        name = normalizer.get(1, b"?").decode("utf-8", "replace")
        raise TokenizerError(
            f"{path}: normalizer {name!r} rewrites text with its own rules; only 'identity' is "
            "supported"
        )
    ids = {
        key: int32(trainer.get(field, default))
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
