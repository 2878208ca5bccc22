"""SwiGLU's activation in one Triton kernel (kernels/silu_mul.py) against silu_and_mul_ref, its
plain-torch reference `F.silu(gate) * up`, in the interpreter: fp32 / fp16 / bf16, halves of 1, 7,
64, 1000 and 2500 values (2500: three column blocks of 1024, the last one masked), fp16 rounded
where torch rounds (silu, then the product), a 3-d input, rows apart in memory, a transposed input.
Controls: the halves swapped (silu of up, times gate) and GELU in silu's place miss the tolerance.
Refused: an odd last dimension, a dtype outside DTYPES."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from nanoserve.kernels.silu_mul import silu_and_mul, silu_and_mul_ref

# How far the kernel may be from torch, relative to torch's value, in units of eps (the dtype's
# relative precision: an ulp is at most eps·|v|). float32: exp and the division differ in the last
# bits, a few eps, so 1e-6. fp16 and bf16 round twice, each rounding as torch's:
# 1. silu in float32 (torch's value up to float32's last bits) rounded to the dtype: at most one
#    ulp from torch's, so the exact products silu·up differ by at most eps·|y|;
# 2. each product rounded to the dtype: to nearest, half an ulp from its exact value, eps/2 · |y|
#    for the kernel's and as much for torch's.
# Together 2·eps. bf16 in Triton's interpreter converts by truncation (test_kernels_norm.py:
# test_the_interpreter_truncates_to_bfloat16), a whole ulp from the exact product: 2.5·eps. The
# bound needs silu to be a normal number: fp16 silu(g) underflows below g ≈ −12, so the inputs
# here have σ = 2.
TOL = {torch.float32: 1e-6, torch.float16: 2 * torch.finfo(torch.float16).eps,
       torch.bfloat16: 2.5 * torch.finfo(torch.bfloat16).eps}


def _rel_err(got, want):
    """The largest |got − want| relative to |want| (below the smallest normal number, to it)."""
    scale = want.float().abs().clamp(min=torch.finfo(want.dtype).tiny)
    return ((got.float() - want.float()).abs() / scale).max().item()


def _gate_up(rows, inter, dtype, seed=0):
    """[rows, 2·inter]: gate then up, σ = 2."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * inter, generator=g) * 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter", [1, 7, 64, 1000, 2500])
def test_kernel_equals_the_torch_reference(dtype, inter):
    x = _gate_up(5, inter, dtype)
    want = silu_and_mul_ref(x)
    got = silu_and_mul(x)
    assert got.dtype == dtype and got.shape == (5, inter)
    assert _rel_err(got, want) <= TOL[dtype]
    # controls: the halves swapped (silu of up, times gate); GELU in silu's place
    gate, up = x[:, :inter], x[:, inter:]
    swapped = silu_and_mul(torch.cat([up, gate], dim=-1))
    assert _rel_err(swapped, want) > 10 * TOL[dtype]
    assert _rel_err(F.gelu(gate) * up, got) > 10 * TOL[dtype]


def test_fp16_rounds_twice_where_torch_does():
    """The tolerance cannot tell one rounding from two; agreement can. fp16 rounds to nearest in the
    interpreter too, so the kernel equals torch but where the two float32 silus straddle a rounding
    boundary (a few in 10,000 here); the product of the unrounded silu, rounded once, differs from
    torch in about a quarter of the values."""
    x = _gate_up(5, 2500, torch.float16)
    want = silu_and_mul_ref(x)
    rounded_once = (F.silu(x[:, :2500].float()) * x[:, 2500:].float()).half()
    assert (silu_and_mul(x) != want).float().mean() < 0.01
    assert (rounded_once != want).float().mean() > 0.1


def test_a_3d_input_keeps_its_leading_dimensions():
    x = _gate_up(2 * 3, 96, torch.bfloat16, seed=1).view(2, 3, 192)  # B, T, 2·I
    got = silu_and_mul(x)
    assert got.shape == (2, 3, 96)
    assert _rel_err(got, silu_and_mul_ref(x)) <= TOL[torch.bfloat16]


def test_rows_apart_in_memory_and_a_transposed_input():
    wide = _gate_up(4, 40, torch.float16, seed=2)  # 4, 80
    rows_apart = wide[:, :70]  # 4, 70: each row 80 values from the next, the last dim contiguous
    transposed = _gate_up(70, 2, torch.float16, seed=3).t()  # [70, 4] read as 4, 70: strided
    for x in (rows_apart, transposed):
        assert not x.is_contiguous()
        assert _rel_err(silu_and_mul(x), silu_and_mul_ref(x)) <= TOL[torch.float16]


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="even and positive"):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="even and positive"):
        silu_and_mul(torch.randn(2, 0))
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        silu_and_mul(torch.randn(2, 8, dtype=torch.float64))
