"""The W8A8 int8 GEMM kernel (kernels/int8_matmul.py) against exact integer arithmetic
(docs/TESTING.md §D).

The int32 accumulation is exact, so the kernel must equal the float64 reference bit for bit before
the scales (compared after them with fp32 rounding only); ragged M, N, K cross every tile edge; the
bias and the output dtypes go through the epilogue. Negative control: a kernel whose scales were
swapped (per column applied per row) misses by far. Runs in Triton's interpreter without CUDA; the
GPU test is marked."""

from __future__ import annotations

import pytest
import torch
from nanoserve.kernels.int8_matmul import w8a8_matmul, w8a8_matmul_ref

from nanoserve.quant.int8 import W8A8Linear


def _operands(M, K, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (M, K), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    a[0], w[0] = 127, -127  # the largest products
    return (
        a, torch.rand(M, generator=g) + 0.01, w, torch.rand(N, generator=g) + 0.01,
        torch.randn(N, generator=g),
    )


@pytest.mark.parametrize("shape", [(1, 7, 5), (17, 100, 33), (40, 256, 70)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemm_equals_integer_arithmetic(shape, with_bias):
    a, sa, w, sw, bias = _operands(*shape)
    bias = bias if with_bias else None
    got = w8a8_matmul(a, sa, w, sw, bias)
    exact = (a.long()[:, None, :] * w.long()[None, :, :]).sum(-1)  # M, N   term by term in int64
    want = exact.float() * sa[:, None] * sw[None, :] + (0 if bias is None else bias)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    torch.testing.assert_close(got, w8a8_matmul_ref(a, sa, w, sw, bias), atol=0, rtol=1e-6)
    small = sa * 1e-3  # keeps every output inside fp16's range
    want = exact.float() * small[:, None] * sw[None, :] + (0 if bias is None else bias)
    # one cast, at the end
    for dtype, ulp in ((torch.float16, 2.0 ** -10), (torch.bfloat16, 2.0 ** -7)):
        torch.testing.assert_close(w8a8_matmul(a, small, w, sw, bias, dtype).float(), want,
                                   atol=1e-5, rtol=ulp)


def test_negative_control_swapped_scales_miss():
    a, sa, w, sw, _ = _operands(16, 64, 16)
    assert (w8a8_matmul(a, sa, w, sw) - w8a8_matmul_ref(a, sw, w, sa)).abs().max() > 1.0


def test_bad_inputs_are_refused_by_name():
    a, sa, w, sw, _ = _operands(4, 16, 8)
    with pytest.raises(ValueError, match="must be int8 with one K"):
        w8a8_matmul(a.float(), sa, w, sw)
    with pytest.raises(ValueError, match=r"scale_a must be fp32 \[4\]"):
        w8a8_matmul(a, sa.half(), w, sw)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        w8a8_matmul(a, sa, w, sw, torch.zeros(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_int8_gemm_and_w8a8_linear_on_cuda():
    for M in (1, 16, 100):
        a, sa, w, sw, bias = (t.cuda() for t in _operands(M, 4096, 512))
        torch.testing.assert_close(w8a8_matmul(a, sa, w, sw, bias),
                                   w8a8_matmul_ref(a, sa, w, sw, bias),
                                   atol=1e-3, rtol=1e-5)
    lin = torch.nn.Linear(256, 128).cuda().to(torch.bfloat16)
    q = W8A8Linear.from_linear(lin)
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(q(x).float(), q.forward_ref(x).float(), atol=2e-2, rtol=2e-2)
