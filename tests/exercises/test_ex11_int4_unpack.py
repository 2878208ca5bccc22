"""Exercise 11: unpacking int4 in a Triton kernel (nanoserve/kernels/dequant_matmul.py:
dequantize_int4).

Oracles: golden words written by hand (GPTQ codes 0..7 along K pack to 0x76543210; symmetric v1
zeros read 0x77777777, docs/TESTING.md §C) with their fields read by Python's unbounded ints (no
sign extension there), and for random weights W built here in fp64 from the integer codes, without
nanoserve, beside packing.dequantize_gptq. Every comparison is bitwise: (code − zero) times an fp16
scale is exact in fp32. The known-wrong variants at the end are one small Triton kernel whose flags
switch one bug on each.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from explain import expect, expect_close, explained_failure

from nanoserve.quant.packing import dequantize_gptq

REFERENCE = "nanoserve.kernels.dequant_matmul"
EXERCISE = "dequant_matmul"
pytestmark = pytest.mark.ex11


def _int32(words: list[list[int]]) -> torch.Tensor:
    """Unsigned 32-bit words → the int32 tensor holding the same bits (bit 31 set: negative)."""
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words],
                        dtype=torch.int32)


def _fields(word: int) -> list[int]:
    """The eight 4-bit fields of an unsigned word, field 0 (the low bits) first."""
    return [(word >> (4 * i)) & 0xF for i in range(8)]


def _pack(x: torch.Tensor) -> torch.Tensor:
    """int [R, L] → int32 [R, L/8]: x[:, 8j + i] goes to bits 4i .. 4i+3 of word j."""
    words = torch.zeros(x.shape[0], x.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        words |= x[:, i::8].long() << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _weights(K, N, group, act_order, seed=0):
    """GPTQ v1 tensors for random codes 0..15 and zeros 1..16 (16 is stored as 15: bit 31 in
    qzeros), and W in fp64."""
    g = torch.Generator().manual_seed(seed)
    G = -(-K // group)
    codes = torch.randint(0, 16, (N, K), generator=g)  # N, K
    zeros = torch.randint(1, 17, (N, G), generator=g)  # N, G
    scales = (torch.randn(N, G, generator=g) * 0.05).half()  # N, G   signs mixed
    g_idx = torch.arange(K) // group  # K
    if act_order:  # GPTQ's desc_act: the groups follow a permutation of the rows
        g_idx = g_idx[torch.randperm(K, generator=g)]
    w = (codes - zeros[:, g_idx]).double() * scales[:, g_idx].double()  # N, K
    tensors = {"qweight": _pack(codes).t().contiguous(),  # K/8, N
               "qzeros": _pack((zeros - 1).t()),  # G, N/8   v1 stores zero − 1
               "scales": scales.t().contiguous(),  # G, N
               "g_idx": g_idx.to(torch.int32)}  # K
    return tensors, w


# ----------------------------------------------------------------------------- checks (shared with
# the variants)
def check_golden_codes(impl):
    """qweight words 0x76543210: row k of every column holds code k % 8. Zero 1 (stored 0) and scale
    1: W = code − 1."""
    qweight = _int32([[0x76543210] * 8] * 2)  # K/8 = 2, N = 8
    qzeros = torch.zeros(1, 1, dtype=torch.int32)  # G = 1, N/8 = 1
    W = impl.dequantize_int4(qweight, qzeros, torch.ones(1, 8, dtype=torch.float16),
                             torch.zeros(16, dtype=torch.int32))
    case = "dequantize_int4(words 0x76543210: row k holds code k % 8; zero 1, scale 1)"
    expect(W.dtype == torch.float32, case, "float32", W.dtype)
    expect_close(W, (torch.arange(16) % 8 - 1).float().expand(8, 16), case, atol=0, dims="n, k")


WORDS = [0xFEDCBA98, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF, 0x0F0F0F0F, 0xF0F0F0F0, 0x89ABCDEF, 0x76543210]


def check_sign_bit_words(impl):
    """Words with bit 31 set are negative int32s, and >> copies the sign bit down: the mask must
    remove it.

    Column n holds WORDS[n] in row-word 0 and WORDS[7 - n] in row-word 1; 0xFEDCBA98 holds codes
    8..15.
    """
    assert _fields(0xFEDCBA98) == list(range(8, 16))
    qweight = _int32([WORDS, WORDS[::-1]])  # K/8 = 2, N = 8   six of the eight words negative
    W = impl.dequantize_int4(qweight, torch.zeros(1, 1, dtype=torch.int32),
                             torch.ones(1, 8, dtype=torch.float16),
                             torch.zeros(16, dtype=torch.int32))  # N, K   zero 1, scale 1
    want = torch.tensor([_fields(WORDS[n]) + _fields(WORDS[7 - n]) for n in range(8)]) - 1  # N, K
    expect_close(W, want.float(), "dequantize_int4(words with the sign bit set, e.g. 0xFEDCBA98 "
                 "= codes 8..15; zero 1, scale 1): code − 1", atol=0, dims="n, k")


def check_v1_zeros(impl):
    """Zeros are packed along N and stored as zero − 1: 0x77777777 reads 8 for columns 0..7,
    0xFEDCBA98 (a negative word) reads 9..16 for columns 8..15. Codes k % 8, scales (n + 1) / 4."""
    qweight = _int32([[0x76543210] * 16])  # K/8 = 1, N = 16
    qzeros = _int32([[0x77777777, 0xFEDCBA98]])  # G = 1, N/8 = 2
    scales = ((torch.arange(16) + 1) / 4).half()[None]  # 1, N   exact in fp16
    W = impl.dequantize_int4(qweight, qzeros, scales, torch.zeros(8, dtype=torch.int32))  # N, K
    zero = torch.tensor([8] * 8 + list(range(9, 17)))  # N
    want = (torch.arange(8)[None, :] - zero[:, None]).float() * scales.float().t()  # N, K
    expect_close(W, want, "dequantize_int4(qzeros words 0x77777777, 0xFEDCBA98: zeros stored "
                 "as zero − 1, 8 for columns 0..7, 9..16 for 8..15)", atol=0, dims="n, k")


def check_round_trip(impl, K=200, N=72, group=64, act_order=False, dtype=torch.float32, seed=0):
    """Random weights, bitwise: against the fp64 W built from the codes, and
    packing.dequantize_gptq."""
    tensors, w = _weights(K, N, group, act_order, seed)
    # sign bits on both sides
    assert (tensors["qweight"] < 0).any() and (tensors["qzeros"] < 0).any()
    out = impl.dequantize_int4(**tensors, dtype=dtype)  # N, K
    case = (f"dequantize_int4(random K={K}, N={N}, groups of {group}, act_order={act_order}, "
            f"dtype={dtype})")
    expect(out.dtype == dtype, case, dtype, out.dtype)
    expect_close(out, dequantize_gptq(**tensors, bits=4, dtype=dtype),
                 f"{case} against packing.dequantize_gptq", atol=0, dims="n, k")
    expect_close(out.double(), w.to(dtype).double(), f"{case} against W built from the codes",
                 atol=0, dims="n, k")


def check_act_order(impl):
    """Groups of 32 assigned to the rows in a random order: neighbouring rows of a tile use
    different groups."""
    check_round_trip(impl, K=200, N=72, group=32, act_order=True, seed=1)


# ----------------------------------------------------------------------------- the tests
def test_ex11_1_golden_word_0x76543210_gives_codes_0_to_7(impl):
    check_golden_codes(impl)


def test_ex11_1_negative_words_unpack_without_sign_extension(impl):
    check_sign_bit_words(impl)


def test_ex11_2_v1_zeros_0x77777777_read_as_8(impl):
    check_v1_zeros(impl)


@pytest.mark.parametrize("K, N, group", [(64, 32, 32), (200, 72, 64), (320, 40, 128)])
def test_ex11_2_random_weights_bitwise(impl, K, N, group):
    """On the 32-wide tiles of the hint, off them (masked edges), groups 32 / 64 / 128."""
    check_round_trip(impl, K, N, group, seed=K)


def test_ex11_3_act_order_g_idx(impl):
    check_act_order(impl)


def test_ex11_3_half_precision_output(impl):
    check_round_trip(impl, 96, 48, 32, act_order=True, dtype=torch.float16, seed=2)


# ----------------------------------------------------------------------------- known-wrong variants
@triton.jit
def _variant_kernel(QW, QZ, S, G_IDX, W, N, K, group_size,
                    FIELD: tl.constexpr, PLUS_ONE: tl.constexpr, GROUPS: tl.constexpr,
                    BLOCK: tl.constexpr):
    # W [N, K] fp32 from contiguous GPTQ v1 tensors, one program per [BLOCK, BLOCK] tile of W in [K,
    # N]
    offs_k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # BLOCK
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # BLOCK
    mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]  # BLOCK, BLOCK
    # BLOCK, BLOCK
    words = tl.load(QW + (offs_k // 8)[:, None] * N + offs_n[None, :], mask=mask, other=0)
    shift = ((offs_k % 8) * 4)[:, None]  # BLOCK, 1
    if FIELD == "mask":
        codes = (words >> shift) & 0xF
    elif FIELD == "no mask":  # the higher fields, and the copies of the sign bit, stay
        codes = words >> shift
    else:
        # "shl, sar": move the field to the top bits and shift back down, which sign-extends codes
        # 8..15
        codes = (words << (28 - shift)) >> 28
    if GROUPS == "g_idx":
        g = tl.load(G_IDX + offs_k, mask=offs_k < K, other=0)  # BLOCK
    else:  # "k // group_size": right for plain groups only
        g = offs_k // group_size
    # BLOCK, BLOCK
    zwords = tl.load(QZ + g[:, None] * (N // 8) + (offs_n // 8)[None, :], mask=mask, other=0)
    zeros = (zwords >> ((offs_n % 8) * 4)[None, :]) & 0xF
    if PLUS_ONE:
        zeros = zeros + 1
    # BLOCK, BLOCK
    scales = tl.load(S + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(
        W + offs_n[None, :] * K + offs_k[:, None], (codes - zeros).to(tl.float32) * scales,
        mask=mask,
    )


def _variant(field="mask", plus_one=True, groups="g_idx"):
    def dequantize_int4(qweight, qzeros, scales, g_idx, *, dtype=torch.float32):
        K, N = qweight.shape[0] * 8, qweight.shape[1]
        w = torch.empty(N, K)  # N, K
        group_size = int(torch.bincount(g_idx.long()).max())  # the size of the largest group
        _variant_kernel[(triton.cdiv(K, 32), triton.cdiv(N, 32))](
            qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), g_idx.contiguous(), w,
            N, K, group_size,
            FIELD=field, PLUS_ONE=plus_one, GROUPS=groups, BLOCK=32)
        return w.to(dtype)
    return SimpleNamespace(dequantize_int4=dequantize_int4)


WRONG = {
    "no mask after the shift": (_variant(field="no mask"), [check_golden_codes, check_round_trip]),
    # passes check_golden_codes (codes 0..7 are fine): only words with bit 31 and codes ≥ 8 show it
    "field read by << then >> (sign-extends codes 8..15)": (_variant(field="shl, sar"),
                                                           [check_sign_bit_words, check_round_trip]),
    "zero without v1's + 1": (_variant(plus_one=False), [check_v1_zeros, check_round_trip]),
    # passes check_round_trip with plain groups: only act-order shows it
    "group from k // group_size, not g_idx": (_variant(groups="k // group_size"),
                                              [check_act_order]),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_ex11_known_wrong_variants_fail_and_say_why(name):
    wrong, checks = WRONG[name]
    for check in checks:
        explained_failure(check, wrong)


def test_ex11_the_checks_pass_on_a_right_variant_built_the_same_way():
    """The variants differ from this one in one flag each, so their failures are that flag's."""
    right = _variant()
    for check in (check_golden_codes, check_sign_bit_words, check_v1_zeros, check_round_trip,
                  check_act_order):
        check(right)
    check_round_trip(right, 96, 48, 32, act_order=True, dtype=torch.float16, seed=2)
