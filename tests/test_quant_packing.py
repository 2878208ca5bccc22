"""GPTQ v1 and AutoAWQ GEMM packing (docs/TESTING.md §C): golden words, an independent packer, round
trips, errors.

The golden words are written out by hand from the format descriptions: GPTQ codes 0..7 along K
pack to 0x76543210, AutoAWQ codes 0..7 along N to 0x75316420 (order [0,2,4,6,1,3,5,7]), GPTQ v1
symmetric 4-bit zeros (8, stored as 7) to 0x77777777. A second oracle packs word by word with
Python ints. Negative control: AWQ packed in plain order must fail its golden test.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.quant import packing
from nanoserve.quant.packing import (
    dequantize_awq,
    dequantize_gptq,
    pack_awq,
    pack_gptq,
    unpack_awq,
    unpack_gptq,
)


def _int32(word: int) -> int:
    """An unsigned 32-bit word as the int32 a tensor holds."""
    return word - (1 << 32) if word >= 1 << 31 else word


def _random_unpacked(N, K, group, bits, act_order, seed=0, zero_lo=1):
    g = torch.Generator().manual_seed(seed)
    G = -(-K // group)
    codes = torch.randint(0, 1 << bits, (N, K), generator=g).to(torch.uint8)
    # GPTQ v1: 1 .. 2^bits, AWQ: 0 ..
    zeros = torch.randint(zero_lo, (1 << bits) + zero_lo, (N, G), generator=g)
    scales = (torch.rand(N, G, generator=g) * 0.1 + 1e-3).half()
    g_idx = torch.arange(K) // group  # K
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=g)]
    return codes, zeros, scales, g_idx.to(torch.int32)


def _dense(codes, zeros, scales, g_idx):
    """W [N, K] in fp64 straight from the unpacked side."""
    g = g_idx.long()
    return (codes.long() - zeros[:, g]).double() * scales[:, g].double()


# ----------------------------------------------------------------------------- golden words
@pytest.mark.parametrize("bits,word", [(4, 0x76543210), (2, 0xE4E4E4E4), (8, 0x03020100)])
def test_gptq_golden_codes_along_k(bits, word):
    per = 32 // bits
    N, K = per, 2 * per
    # codes[n, k] = k mod 8 (mod 4 at 2, 8 bits)
    codes = (torch.arange(K) % (8 if bits == 4 else 4)).repeat(N, 1)
    zeros, scales = torch.ones(N, 1, dtype=torch.int64), torch.ones(N, 1)
    packed = pack_gptq(codes, zeros, scales, torch.zeros(K, dtype=torch.int32), bits)
    assert packed["qweight"].shape == (2, N) and packed["qweight"].dtype == torch.int32
    assert (packed["qweight"] == _int32(word)).all()
    got, *_ = unpack_gptq(torch.full((2, N), _int32(word), dtype=torch.int32), packed["qzeros"],
                          packed["scales"],
                          packed["g_idx"], bits)
    assert torch.equal(got.long(), codes)


@pytest.mark.parametrize("bits,zero,word",
                         [(4, 8, 0x77777777), (2, 2, 0x55555555), (8, 128, 0x7F7F7F7F)])
def test_gptq_v1_symmetric_zeros(bits, zero, word):
    """v1 stores zero − 1: the symmetric zero 2^(bits−1) reads 0x77777777 at 4 bits."""
    per = 32 // bits
    N, K, G = 2 * per, per, 3
    codes = torch.zeros(N, K, dtype=torch.uint8)
    packed = pack_gptq(codes, torch.full((N, G), zero), torch.ones(N, G),
                       torch.zeros(K, dtype=torch.int32), bits)
    assert packed["qzeros"].shape == (G, 2) and (packed["qzeros"] == _int32(word)).all()
    _, zeros, _, _ = unpack_gptq(packed["qweight"],
                                 torch.full((G, 2), _int32(word), dtype=torch.int32),
                                 packed["scales"], packed["g_idx"], bits)
    assert (zeros == zero).all()


def test_gptq_top_field_sets_the_sign_bit():
    codes = torch.full((8, 8), 15, dtype=torch.uint8)
    packed = pack_gptq(codes, torch.full((8, 1), 16), torch.ones(8, 1),
                       torch.zeros(8, dtype=torch.int32), 4)
    # 0xFFFFFFFF; zero 16 stored as 15
    assert (packed["qweight"] == -1).all() and (packed["qzeros"] == -1).all()
    assert torch.equal(unpack_gptq(**packed, bits=4)[0], codes)
    assert (dequantize_gptq(**packed, bits=4) == -1).all()  # (15 − 16) · 1


def _awq_golden_holds(pack=pack_awq) -> bool:
    N, K = 16, 4
    codes = (torch.arange(N) % 8)[:, None].repeat(1, K)  # codes 0..7 along N
    zeros = (torch.arange(N) % 8)[:, None].repeat(1, 2)
    packed = pack(codes, zeros, torch.ones(N, 2))
    assert packed["qweight"].shape == (K, 2) and packed["qzeros"].shape == (2, 2)
    return bool((packed["qweight"] == 0x75316420).all() and (packed["qzeros"] == 0x75316420).all())


def test_awq_golden_interleave():
    assert _awq_golden_holds()
    words = torch.full((4, 2), 0x75316420, dtype=torch.int32)
    codes, zeros, _ = unpack_awq(words, words[:1], torch.ones(1, 16, dtype=torch.float16),
                                 group_size=4)
    assert torch.equal(codes[:, 0].long(), torch.arange(16) % 8) and torch.equal(
        zeros[:, 0], torch.arange(16) % 8
    )


def test_awq_plain_order_fails_the_golden_test(monkeypatch):
    """Negative control: without the interleave, codes 0..7 pack to 0x76543210 and the golden test
    fails."""
    monkeypatch.setattr(packing, "AWQ_ORDER", list(range(8)))
    assert not _awq_golden_holds()


# ----------------------------------------------------------------------------- an independent
# packer
def _python_word(values, bits) -> int:
    """values[i] in field i, with Python ints."""
    word = 0
    for i, v in enumerate(values):
        word |= int(v) << (bits * i)
    return _int32(word)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gptq_matches_python_packer(bits):
    per = 32 // bits
    codes, zeros, scales, g_idx = _random_unpacked(
        per, 3 * per, per, bits, act_order=True, seed=bits
    )
    packed = pack_gptq(codes, zeros, scales, g_idx, bits)
    N, K = codes.shape
    want_qw = [[_python_word(codes[n, r * per:(r + 1) * per].tolist(), bits) for n in range(N)]
               for r in range(K // per)]
    want_qz = [[_python_word((zeros[c * per:(c + 1) * per, g] - 1).tolist(),
                             bits) for c in range(N // per)]
               for g in range(zeros.shape[1])]
    assert packed["qweight"].tolist() == want_qw
    assert packed["qzeros"].tolist() == want_qz
    assert torch.equal(packed["scales"], scales.t()) and torch.equal(packed["g_idx"], g_idx)


def test_awq_matches_python_packer():
    codes, zeros, scales, _ = _random_unpacked(16, 24, 8, 4, act_order=False, seed=3, zero_lo=0)
    packed = pack_awq(codes, zeros, scales)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    want_qw = [[_python_word([codes[8 * c + j, k] for j in order],
                             4) for c in range(2)] for k in range(24)]
    want_qz = [[_python_word([zeros[8 * c + j, g] for j in order],
                             4) for c in range(2)] for g in range(3)]
    assert packed["qweight"].tolist() == want_qw and packed["qzeros"].tolist() == want_qz


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_round_trip_and_dequantize(bits, act_order):
    codes, zeros, scales, g_idx = _random_unpacked(48, 96, 32, bits, act_order, seed=bits)
    packed = pack_gptq(codes, zeros, scales, g_idx, bits)
    assert packed["qweight"].shape == (96 * bits // 32, 48) and packed["qzeros"].shape == (
        3,
        48 * bits // 32,
    )
    got = unpack_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], bits)
    assert got[0].dtype == torch.uint8 and torch.equal(got[0], codes)
    assert (
        torch.equal(got[1].long(), zeros) and torch.equal(got[2], scales)
        and torch.equal(got[3], g_idx)
    )
    w = dequantize_gptq(**packed, bits=bits)
    # exact
    assert w.dtype == torch.float32 and torch.equal(w.double(), _dense(codes, zeros, scales, g_idx))


def test_awq_round_trip_and_dequantize():
    codes, zeros, scales, _ = _random_unpacked(40, 100, 32, 4, act_order=False, seed=5, zero_lo=0)
    packed = pack_awq(codes, zeros, scales)
    back = unpack_awq(packed["qweight"], packed["qzeros"], packed["scales"], group_size=32)
    assert torch.equal(back[0], codes) and torch.equal(back[1].long(),
                                                       zeros) and torch.equal(back[2], scales)
    w = dequantize_awq(packed["qweight"], packed["qzeros"], packed["scales"], group_size=32)
    assert torch.equal(w.double(), _dense(codes, zeros, scales, torch.arange(100) // 32))


# ----------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise():
    codes, zeros, scales, g_idx = _random_unpacked(16, 64, 32, 4, act_order=False)
    packed = pack_gptq(codes, zeros, scales, g_idx, 4)
    bad_pack = {
        "bits=3 is not supported": (codes, zeros, scales, g_idx, 3),
        "multiples of 8": (codes[:, :60], zeros, scales, g_idx[:60], 4),
        r"codes must lie in 0 \.\. 15": (codes.long() + 1, zeros, scales, g_idx, 4),
        "zero 0 cannot be written": (codes, zeros - 1, scales, g_idx, 4),
        "scales must be a float": (codes, zeros, scales[:, :1], g_idx, 4),
        "codes must be an integer": (codes.float(), zeros, scales, g_idx, 4),
        r"g_idx must hold groups 0 \.\. 1": (codes, zeros, scales, g_idx + 1, 4),
        "g_idx must be an int32/int64": (codes, zeros, scales, g_idx[:32], 4),
        "finite in fp16": (codes, zeros, scales.float() * 1e6, g_idx, 4),
    }
    for message, args in bad_pack.items():
        with pytest.raises(ValueError, match=message):
            pack_gptq(*args)
    qw, qz, sc, gi = packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"]
    bad_unpack = {
        "qweight must be a 2-D int32": (qw.long(), qz, sc, gi, 4),
        r"qzeros must be \[G, N·bits/32\]": (qw, qz[:, :1], sc, gi, 4),
        r"scales must be a float \[G, N\] = \[2, 16\]": (qw, qz, sc[:, :8], gi, 4),
        "bits=5": (qw, qz, sc, gi, 5),
    }
    for message, args in bad_unpack.items():
        with pytest.raises(ValueError, match=message):
            unpack_gptq(*args)
    with pytest.raises(ValueError, match="N=12 must be a multiple of 8"):
        pack_awq(codes[:12], zeros[:12] - 1, scales[:12])
    with pytest.raises(ValueError, match=r"AWQ zero points must lie in 0 \.\. 15"):
        pack_awq(codes, zeros, scales)  # zero 16 (from the v1 range) does not fit
    awq = pack_awq(codes, zeros - 1, scales)
    with pytest.raises(ValueError, match="qzeros must be"):
        unpack_awq(awq["qweight"], awq["qzeros"], awq["scales"], group_size=64)  # 1 group, not 2
