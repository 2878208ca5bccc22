"""Just enough of the protobuf wire format to read SentencePiece's ``tokenizer.model``: varints and
length-delimited fields.
"""

from __future__ import annotations

from collections.abc import Iterator


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


def proto_fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) for each field of one protobuf message, in order.

    Wire type 0 (varint) gives an int; 1 (fixed64), 2 (length-delimited: strings, bytes,
    sub-messages) and 5 (fixed32: float) give the raw bytes. That is all ModelProto uses.
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


def int32(value: int) -> int:
    """A protobuf int32 read as a varint: negative numbers arrive as 64-bit two's complement."""
    return value - (1 << 64) if value >= 1 << 63 else value
