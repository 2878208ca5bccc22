"""llama2.c tokenizer files (``tokenizer.bin``, ``tok512.bin``): a SentencePiece vocabulary stored
as (score, length, bytes) records.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from .base import BYTE, BYTE_PIECE, CONTROL, NORMAL, SPACE, UNKNOWN, TokenizerError, read_bytes
from .sentencepiece import SentencePieceTokenizer


def llama2c_tokenizer(path: str | os.PathLike) -> SentencePieceTokenizer:
    """A llama2.c ``tokenizer.bin`` / ``tok512.bin``: the pieces and scores of a SentencePiece BPE.

    Layout (little-endian): int32 max_token_length, then per token float32 score, int32 length,
    bytes. Spaces are stored as " " (not "▁"); types are implied: ids 0/1/2 are <unk>/<s>/</s>,
    ``<0xXX>`` pieces are bytes, the rest normal. llama2.c adds the dummy prefix, as Llama-2's model
    does.
    """
    path = Path(path)
    data = read_bytes(path)
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
    types = [UNKNOWN, CONTROL,
             CONTROL] + [BYTE if BYTE_PIECE.fullmatch(p) else NORMAL for p in pieces[3:]]
    pieces = [p.replace(" ", SPACE) if t == NORMAL else p for p, t in zip(pieces, types)]
    byte_fallback = types.count(BYTE) == 256
    return SentencePieceTokenizer(pieces, scores, types, byte_fallback=byte_fallback)
