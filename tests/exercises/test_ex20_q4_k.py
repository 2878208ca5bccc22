"""Exercise 20: dequantize llama.cpp's Q4_K (nanoserve/quant/ggml_blocks.py: k4_scales_mins,
four_bit_chunks, dequantize_q4_k).

Oracles: the `gguf` package's numpy reference (llama.cpp's own Python code): its
`Q4_K.get_scale_min` on random and hand-packed scale bytes, and its `dequantize` on random blocks
with edge cases (d = 0, dmin = 0, every scale and min 63, every code 0 or 15, a negative and a
subnormal d), compared bit for bit; the codes read through gguf with d = 1, dmin = 0 and every
scale 1 (then a weight is its code); and scales and mins packed by hand from the layout here, in
the opposite direction to the code under test.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from explain import expect, expect_close, expect_equal, explained_failure

gguf = pytest.importorskip("gguf")

REFERENCE = "nanoserve.quant.ggml_blocks"
EXERCISE = "ggml_blocks"
pytestmark = pytest.mark.ex20

Q4_K = gguf.GGMLQuantizationType.Q4_K
BLOCK_BYTES = 144
SCALES = [1, 2, 3, 63, 16, 33, 48, 62]  # the last four need their top two bits
MINS = [0, 63, 5, 40, 0, 17, 63, 35]


def _pack_scales_mins(scales: list[int], mins: list[int]) -> list[int]:
    """Twelve bytes from eight 6-bit scales and mins, written from the layout (an encoder)."""
    packed = [0] * 12
    for k in range(4):
        packed[k] = scales[k] | (scales[k + 4] >> 4) << 6
        packed[4 + k] = mins[k] | (mins[k + 4] >> 4) << 6
        packed[8 + k] = (scales[k + 4] & 0xF) | (mins[k + 4] & 0xF) << 4
    return packed


def _f16_bytes(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def _random_blocks(n: int, seed: int) -> np.ndarray:
    """n random Q4_K blocks, with d and dmin small float16 numbers and edge cases in the first
    eight: d = 0; dmin = 0; every scale and min 63; every code 15; every code 0; a negative d; a
    subnormal d; every scale 0 (the weights are the offsets alone)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 0:2] = _f16_bytes(rng.uniform(1e-4, 2e-2, n))
    blocks[:, 2:4] = _f16_bytes(rng.uniform(1e-4, 2e-2, n))
    blocks[0, 0:2] = _f16_bytes([0.0])
    blocks[1, 2:4] = _f16_bytes([0.0])
    blocks[2, 4:16] = 0xFF
    blocks[3, 16:] = 0xFF
    blocks[4, 16:] = 0
    blocks[5, 0:2] = _f16_bytes([-0.0123])
    blocks[6, 0:2] = _f16_bytes([2.0**-20])
    blocks[7, 4:8] = 0  # scale bytes 0-3 of the packing
    blocks[7, 12:16] &= 0xF0  # the low nibbles of its bytes 8-11
    return blocks


# ----------------------------------------------------------------------------- checks (shared with
# the mutants)
def check_scales_mins_by_hand(impl):
    packed = torch.tensor([_pack_scales_mins(SCALES, MINS)], dtype=torch.uint8)  # 1, 12
    case = f"k4_scales_mins(12 bytes packed from scales {SCALES} and mins {MINS})"
    scales, mins = impl.k4_scales_mins(packed)
    expect_equal(scales, torch.tensor([SCALES], dtype=torch.float32), f"{case}: the scales",
                 rows=("block", "blocks"))
    expect_equal(mins, torch.tensor([MINS], dtype=torch.float32), f"{case}: the mins",
                 rows=("block", "blocks"))


def check_scales_mins_against_gguf(impl):
    """Any 12 bytes are a valid packing: random ones against gguf's own unpacking."""
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(32, 12), dtype=np.uint8)  # n, 12
    packed[0] = 0xFF  # every bit set: 63 everywhere
    want_scales, want_mins = gguf.quants.Q4_K.get_scale_min(packed)
    scales, mins = impl.k4_scales_mins(torch.from_numpy(packed))
    case = "k4_scales_mins(32 random packings, the first all 0xFF) vs gguf's Q4_K.get_scale_min"
    expect_equal(scales, torch.from_numpy(want_scales.astype(np.float32)), f"{case}: the scales",
                 rows=("block", "blocks"), dims="block")
    expect_equal(mins, torch.from_numpy(want_mins.astype(np.float32)), f"{case}: the mins",
                 rows=("block", "blocks"), dims="block")


def check_codes_by_hand(impl):
    qs = torch.zeros(1, 128, dtype=torch.uint8)
    qs[0, 0], qs[0, 1], qs[0, 32], qs[0, 127] = 0x21, 0x43, 0x65, 0xF7  # chunk 0 bytes 0, 1; ...
    codes = impl.four_bit_chunks(qs)
    case = "four_bit_chunks(bytes 0x21, 0x43 at 0 and 1, 0x65 at 32, 0xF7 at 127, zeros elsewhere)"
    expect(codes.dtype == torch.uint8 and codes.shape == (1, 256), case, "uint8 codes [1, 256]",
           f"{codes.dtype} {tuple(codes.shape)}")
    picks = [0, 1, 32, 33, 64, 96, 223, 255]
    got = codes[0, picks].tolist()
    # byte l of chunk j: low nibble → weight 64j + l, high nibble → weight 64j + 32 + l
    expect(got == [1, 3, 2, 4, 5, 6, 7, 15], f"{case}: codes of weights {picks}",
           [1, 3, 2, 4, 5, 6, 7, 15], got)


def _unit_blocks(qs: np.ndarray) -> np.ndarray:
    """Q4_K blocks with d = 1, dmin = 0 and every scale 1, whose weights are their codes."""
    blocks = np.zeros((qs.shape[0], BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 0:2] = _f16_bytes([1.0])
    blocks[:, 4:8] = 1
    blocks[:, 12:16] = 1
    blocks[:, 16:] = qs
    return blocks


def check_codes_against_gguf(impl):
    qs = np.random.default_rng(2).integers(0, 256, size=(16, 128), dtype=np.uint8)  # n, 128
    want = gguf.quants.dequantize(_unit_blocks(qs), Q4_K).astype(np.uint8)  # n, 256
    codes = impl.four_bit_chunks(torch.from_numpy(qs))
    expect_equal(codes, torch.from_numpy(want), "four_bit_chunks(16 random blocks of codes) vs "
                 "gguf's dequantize with d = 1, dmin = 0, every scale 1", dims="block, weight")


def check_dequantize_against_gguf(impl):
    blocks = _random_blocks(64, seed=3)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, Q4_K))  # 64, 256
    got = impl.dequantize_q4_k(torch.from_numpy(blocks))
    case = ("dequantize_q4_k(64 random blocks: d = 0, dmin = 0, all scales and mins 63, all codes "
            "15, all codes 0, d < 0, a subnormal d, all scales 0, ...) vs gguf's dequantize, bit "
            "for bit")
    expect(isinstance(got, torch.Tensor) and got.dtype == torch.float32, case,
           "a float32 tensor", getattr(got, "dtype", type(got).__name__))
    expect_close(got, want, case, atol=0, dims="block, weight")


def check_dequantize_sub_block_steps(impl):
    """One block by hand: d 0.5, dmin 0.25, sub-block s with scale s + 1 and min 2s, every code 3:
    sub-block s reads 0.5·(s + 1)·3 − 0.25·2s."""
    block = np.zeros((1, BLOCK_BYTES), dtype=np.uint8)
    block[:, 0:2] = _f16_bytes([0.5])
    block[:, 2:4] = _f16_bytes([0.25])
    block[0, 4:16] = _pack_scales_mins([s + 1 for s in range(8)], [2 * s for s in range(8)])
    block[:, 16:] = 0x33
    got = impl.dequantize_q4_k(torch.from_numpy(block))
    want = torch.tensor([0.5 * (s + 1) * 3 - 0.25 * 2 * s for s in range(8)])  # 8
    case = "dequantize_q4_k(d 0.5, dmin 0.25, scales 1..8, mins 0, 2, .., 14, every code 3)"
    expect(got.shape == (1, 256), case, "shape (1, 256)", tuple(got.shape))
    expect_close(got.reshape(8, 32)[:, 0], want, f"{case}: each sub-block's weight", atol=0)
    expect(bool((got.reshape(8, 32) == got.reshape(8, 32)[:, :1]).all()), case,
           "one value per sub-block", "several")


# ----------------------------------------------------------------------------- the tests
def test_ex20_1_scales_and_mins_by_hand(impl):
    check_scales_mins_by_hand(impl)


def test_ex20_1_scales_and_mins_equal_gguf(impl):
    check_scales_mins_against_gguf(impl)


def test_ex20_2_codes_by_hand(impl):
    check_codes_by_hand(impl)


def test_ex20_2_codes_equal_gguf(impl):
    check_codes_against_gguf(impl)


def test_ex20_3_one_block_by_hand(impl):
    check_dequantize_sub_block_steps(impl)


def test_ex20_3_dequantize_equals_gguf_bit_for_bit(impl):
    check_dequantize_against_gguf(impl)


# ----------------------------------------------------------------------------- known-wrong variants
def _q4_k(top_bits=True, nibbles_swapped=False, side_by_side=False, min_sign=-1.0,
          d_at=0, dmin_at=2):
    def k4_scales_mins(packed):
        p = packed.long()
        low, high = p[:, 8:12] & 0xF, p[:, 8:12] >> 4
        if nibbles_swapped:  # wrong: the min in the low nibble
            low, high = high, low
        last_scales, last_mins = low, high
        if top_bits:
            last_scales = last_scales | (p[:, 0:4] >> 6) << 4
            last_mins = last_mins | (p[:, 4:8] >> 6) << 4
        scales = torch.cat([p[:, 0:4] & 63, last_scales], 1)
        mins = torch.cat([p[:, 4:8] & 63, last_mins], 1)
        return scales.float(), mins.float()

    def four_bit_chunks(qs):
        if side_by_side:  # wrong: byte l holds weights 2l and 2l + 1
            return torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 256)
        chunks = qs.reshape(-1, 4, 1, 32)
        return torch.cat([chunks & 0xF, chunks >> 4], dim=2).reshape(-1, 256)

    def dequantize_q4_k(blocks):
        d = blocks[:, d_at:d_at + 2].contiguous().view(torch.float16).float()  # n, 1
        dmin = blocks[:, dmin_at:dmin_at + 2].contiguous().view(torch.float16).float()
        scales, mins = k4_scales_mins(blocks[:, 4:16])  # n, 8
        q = four_bit_chunks(blocks[:, 16:]).float().reshape(-1, 8, 32)
        step, offset = (d * scales)[:, :, None], (dmin * mins)[:, :, None]
        return (step * q + min_sign * offset).reshape(-1, 256)

    return SimpleNamespace(k4_scales_mins=k4_scales_mins, four_bit_chunks=four_bit_chunks,
                           dequantize_q4_k=dequantize_q4_k)


SCALE_CHECKS = [check_scales_mins_by_hand, check_scales_mins_against_gguf,
                check_dequantize_against_gguf]
WRONG = {
    "the last four scales and mins without their top two bits": (_q4_k(top_bits=False),
                                                                 SCALE_CHECKS),
    "scale and min nibbles of bytes 8-11 swapped": (_q4_k(nibbles_swapped=True), SCALE_CHECKS),
    "neighbouring weights side by side in a byte": (
        _q4_k(side_by_side=True),
        [check_codes_by_hand, check_codes_against_gguf, check_dequantize_against_gguf]),
    "the min added, not subtracted": (_q4_k(min_sign=1.0), [check_dequantize_sub_block_steps,
                                                            check_dequantize_against_gguf]),
    "d and dmin read from each other's bytes": (_q4_k(d_at=2, dmin_at=0),
                                                [check_dequantize_sub_block_steps,
                                                 check_dequantize_against_gguf]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex20_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex20_the_checks_pass_on_a_right_variant_built_the_same_way():
    right = _q4_k()
    for check in (check_scales_mins_by_hand, check_scales_mins_against_gguf, check_codes_by_hand,
                  check_codes_against_gguf, check_dequantize_sub_block_steps,
                  check_dequantize_against_gguf):
        check(right)
