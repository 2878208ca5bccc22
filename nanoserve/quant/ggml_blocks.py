"""llama.cpp's quantized tensor types (the `ggml_type`s a GGUF file stores), dequantized in torch.

A GGML tensor is a run of fixed-size *blocks*; each block holds the codes of a few dozen or a few
hundred consecutive weights of a row and the float16 numbers that scale them. Two families:

- **legacy blocks of 32 weights**: one scale `d` (and for the `_1` types a minimum `m`):

      Q8_0  d, 32 int8 codes                        w = d·q                      8.5 bits/weight
      Q4_0  d, 16 bytes of 4-bit codes              w = d·(q − 8)                4.5
      Q4_1  d, m, 16 bytes of 4-bit codes           w = d·q + m                  5.0
      Q5_0  d, 32 high bits, 16 bytes of low nibbles w = d·(q − 16)              5.5
      Q5_1  d, m, 32 high bits, 16 bytes            w = d·q + m                  6.0

  A block's 16 code bytes hold weight j in the low nibble of byte j and weight 16 + j in its high
  nibble; the fifth bit of weight j is bit j of the 32-bit word `qh`.

- **K-quants, super-blocks of 256 weights** in sub-blocks of 16 or 32, each sub-block with its
  own small integer scale (and minimum) that the super-block's float16 `d` (and `dmin`) scale in
  turn — "scales of scales", so a 6-bit sub-scale costs 6 bits, not 16:

      Q2_K  16 sub-blocks of 16: 4-bit scale and min each; 2-bit codes   w = d·s·q − dmin·m
      Q3_K  16 sub-blocks of 16: 6-bit signed scales; 3-bit codes        w = d·(s − 32)·(q − 4)
      Q4_K  8 sub-blocks of 32: 6-bit scale and min each; 4-bit codes    w = d·s·q − dmin·m
      Q5_K  as Q4_K with a fifth bit per code                            w = d·s·q − dmin·m
      Q6_K  16 sub-blocks of 16: int8 scales; 6-bit codes                w = d·s·(q − 32)

Each `dequantize_*` takes the blocks as a uint8 tensor [n, bytes per block] and returns float32
[n, weights per block], computing as llama.cpp does (the sub-block's scale d·s first, in float32),
so the result equals llama.cpp's and the `gguf` package's reference bit for bit
(tests/test_ggml_blocks.py). `dequantize(data, type_name)` takes any tensor's bytes. Layouts are
those of llama.cpp's ggml-common.h; the code is written from them, not from its sources.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import NanoserveError

QK = 32  # weights in a legacy block
QK_K = 256  # weights in a K-quant super-block


@dataclass(frozen=True)
class BlockType:
    """A GGML type: its id in GGUF files, weights and bytes per block."""

    name: str
    type_id: int
    block_weights: int
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_weights


# the types read here, with ggml's ids (enum ggml_type)
BLOCK_TYPES = {t.name: t for t in [
    BlockType("F32", 0, 1, 4), BlockType("F16", 1, 1, 2), BlockType("BF16", 30, 1, 2),
    BlockType("Q4_0", 2, QK, 18), BlockType("Q4_1", 3, QK, 20), BlockType("Q5_0", 6, QK, 22),
    BlockType("Q5_1", 7, QK, 24), BlockType("Q8_0", 8, QK, 34),
    BlockType("Q2_K", 10, QK_K, 84), BlockType("Q3_K", 11, QK_K, 110),
    BlockType("Q4_K", 12, QK_K, 144), BlockType("Q5_K", 13, QK_K, 176),
    BlockType("Q6_K", 14, QK_K, 210),
]}


# ----------------------------------------------------------------------------- reading fields
def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block, as float32 [n, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _u32(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian uint32 at byte `at` of each block, as int64 [n, 1]."""
    b = blocks[:, at:at + 4].long()
    return b[:, :1] | b[:, 1:2] << 8 | b[:, 2:3] << 16 | b[:, 3:4] << 24


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, B] bytes → [n, 2B] codes: the B low nibbles, then the B high ones (ggml's order)."""
    return torch.cat([qs & 0xF, qs >> 4], dim=1)


# ----------------------------------------------------------------------------- legacy blocks
def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return d * blocks[:, 2:].contiguous().view(torch.int8).float()


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return d * (_nibbles(blocks[:, 2:]).float() - 8)


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return d * _nibbles(blocks[:, 4:]).float() + m


def _five_bit_codes(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    """Q5 codes: the nibbles after `qh`, each with its bit of the 32-bit `qh` as the fifth."""
    high = (_u32(blocks, qh_at) >> torch.arange(QK)) & 1
    return _nibbles(blocks[:, qh_at + 4:]).long() | high << 4


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return d * (_five_bit_codes(blocks, 2).float() - 16)


def dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return d * _five_bit_codes(blocks, 4).float() + m


# ----------------------------------------------------------------------------- K-quants
def _two_bit_planes(qs: torch.Tensor) -> torch.Tensor:
    """[n, 64] bytes → [n, 256] 2-bit codes in ggml's order: for each half (32 bytes), the four
    bit pairs (shift 0, 2, 4, 6) of its 32 bytes in turn."""
    halves = qs.reshape(-1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    return ((halves >> shifts) & 3).reshape(-1, QK_K)


def _per_subblock(values: torch.Tensor, size: int) -> torch.Tensor:
    """Each sub-block's value [n, S] repeated over its `size` weights → [n, S·size]."""
    return values.repeat_interleave(size, dim=1)


def dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    scales = blocks[:, :16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    scale = _per_subblock(d * (scales & 0xF).float(), 16)
    low = _per_subblock(dmin * (scales >> 4).float(), 16)
    return scale * _two_bit_planes(blocks[:, 16:80]).float() - low


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K's sixteen 6-bit scales from 12 bytes: scale k takes the nibble (k // 8) of byte k % 8
    as its low 4 bits and the bit pair (k // 4) of byte 8 + k % 4 as its top 2; minus 32."""
    k = torch.arange(16)
    low = (packed[:, k % 8].long() >> (4 * (k // 8))) & 0xF
    high = (packed[:, 8 + k % 4].long() >> (2 * (k // 4))) & 3
    return (low | high << 4) - 32


def dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks, 108)
    scale = _per_subblock(d * _q3_k_scales(packed).float(), 16)
    # the third bit: bit b of hmask byte l belongs to weight 32·b + l; clear means "minus 4"
    bits = (hmask.reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1
    q = _two_bit_planes(qs).long() - 4 * (1 - bits.reshape(-1, QK_K).long())
    return scale * q.float()


def k4_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's eight 6-bit scales and eight 6-bit mins from 12 bytes: sub-blocks 0-3 in
    the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles of bytes
    8-11 (scale low, min high) with their top 2 bits in the spare bits 6-7 of bytes 0-3 and 4-7.
    packed: uint8 [n, 12] → (scales, mins), each float32 [n, 8] holding integers 0..63."""
    p = packed.long()
    first_scales, first_mins = p[:, 0:4] & 63, p[:, 4:8] & 63
    last_scales = (p[:, 8:12] & 0xF) | (p[:, 0:4] >> 6) << 4
    last_mins = (p[:, 8:12] >> 4) | (p[:, 4:8] >> 6) << 4
    return (torch.cat([first_scales, last_scales], 1).float(),
            torch.cat([first_mins, last_mins], 1).float())


def four_bit_chunks(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes → [n, 256] codes (uint8, 0..15): for each 32-byte chunk, its 32 low nibbles
    then its 32 high ones — byte l of chunk j holds weights 64·j + l and 64·j + 32 + l."""
    chunks = qs.reshape(-1, 4, 1, 32)
    shifts = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return ((chunks >> shifts) & 0xF).reshape(-1, QK_K)


def _k4_dequantize(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = k4_scales_mins(blocks[:, 4:16])
    return _per_subblock(d * scales, 32) * q.float() - _per_subblock(dmin * mins, 32)


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks uint8 [n, 144] → float32 [n, 256]: d (bytes 0-1) and dmin (2-3) in float16,
    the packed sub-block scales and mins (4-15), the codes (16-143); weight i of sub-block s is
    (d·scale_s)·q_i − (dmin·min_s), each product taken in float32 first."""
    return _k4_dequantize(blocks, four_bit_chunks(blocks[:, 16:144]))


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    qh = blocks[:, 16:48]
    # the fifth bit: bit b of qh byte l belongs to weight 32·b + l (the order of the nibbles)
    bits = (qh.reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1
    q = four_bit_chunks(blocks[:, 48:176]).long() | bits.reshape(-1, QK_K).long() << 4
    return _k4_dequantize(blocks, q)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Per half of 128 weights: 64 bytes of low nibbles `ql` and 32 bytes of bit pairs `qh`.
    Weight 32·g + l of a half (g = 0..3, l = 0..31) takes the low (g < 2) or high nibble of
    ql[l + 32·(g % 2)] and the bit pair g of qh[l]."""
    ql = blocks[:, :128].reshape(-1, 2, 2, 1, 32)  # half, which 32 bytes, -, l
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks, 208)
    nibble_shift = torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 1, 2, 1)
    low = ((ql >> nibble_shift) & 0xF).transpose(2, 3).reshape(-1, 2, 4, 32)  # g = 2·nib + half
    pair_shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (qh >> pair_shift) & 3
    q = (low.long() | high.long() << 4).reshape(-1, QK_K) - 32
    return _per_subblock(d * scales, 16) * q.float()


def _floats(dtype: torch.dtype):
    return lambda blocks: blocks.contiguous().view(dtype).float()


DEQUANTIZE = {
    "F32": _floats(torch.float32), "F16": _floats(torch.float16),
    "BF16": _floats(torch.bfloat16),
    "Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1,
    "Q5_0": dequantize_q5_0, "Q5_1": dequantize_q5_1,
    "Q2_K": dequantize_q2_k, "Q3_K": dequantize_q3_k, "Q4_K": dequantize_q4_k,
    "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k,
}


def dequantize(data: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGML tensor's bytes (uint8, any shape) → float32 of `shape` (its last dimension a whole
    number of blocks, as GGUF requires)."""
    kind = BLOCK_TYPES.get(type_name)
    if kind is None:
        raise NanoserveError(f"GGML type {type_name!r} is not read here; allowed: "
                             f"{', '.join(BLOCK_TYPES)}")
    numel = 1
    for size in shape:
        numel *= size
    if shape and shape[-1] % kind.block_weights:
        raise NanoserveError(f"a {type_name} tensor's rows must hold whole blocks of "
                             f"{kind.block_weights} weights; got shape {tuple(shape)}")
    blocks = data.reshape(-1).view(torch.uint8).reshape(-1, kind.block_bytes)
    if blocks.shape[0] * kind.block_weights != numel:
        raise NanoserveError(f"{blocks.numel()} bytes of {type_name} hold "
                             f"{blocks.shape[0] * kind.block_weights} weights, not the "
                             f"{numel} of shape {tuple(shape)}")
    return DEQUANTIZE[type_name](blocks).reshape(shape)
