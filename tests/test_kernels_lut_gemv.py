"""kernels/lut_gemv.py: the look-up GEMV of a clustered weight, in Triton's interpreter here (the
GPU compile matrix compiles it for sm_80..90), against two references: the kernel file's own
`lut_gemv_ref` (gather, then matmul, in torch) and F.linear with Ŵ looked up by numpy indexing.
Rows 1..16 (the multiply-add path up to 4 rows, tl.dot above), N and K off the tiles, 4, 8 and 16
centroids, fp32 and fp16 activations with an fp16 codebook. Negative control: codes looked up in
the neighbouring row's codebook miss by far. Bad inputs are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from nanoserve.kernels.lut_gemv import lut_gemv, lut_gemv_ref


def _case(seed, M, N, K, C, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    codes = torch.randint(0, C, (N, K), generator=g, dtype=torch.uint8)
    codebook = torch.randn(N, C, generator=g).half()
    return x, codes, codebook


def _numpy_w(codes, codebook) -> torch.Tensor:
    return torch.from_numpy(np.take_along_axis(codebook.float().numpy(),
                                               codes.numpy().astype(np.int64), 1))


@pytest.mark.parametrize("M,N,K,C,block_n,block_k", [
    (1, 37, 70, 16, 16, 16),   # multiply-adds, ragged N and K
    (3, 40, 33, 8, 16, 32),    # 3 rows padded to 4
    (5, 19, 48, 4, 16, 16),    # tl.dot on 16 padded rows
    (16, 64, 64, 16, 32, 32),  # the largest decode batch, on the tiles
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_references(M, N, K, C, block_n, block_k, dtype):
    x, codes, codebook = _case(M + N, M, N, K, C, dtype)
    want = F.linear(x.float(), _numpy_w(codes, codebook))
    ref = lut_gemv_ref(x, codes, codebook)
    got = lut_gemv(x, codes, codebook, block_n=block_n, block_k=block_k)
    assert got.dtype == dtype and got.shape == (M, N)
    # fp32: summation order only; fp16: the output's own rounding (|y| up to ~40)
    atol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (ref.float() - want).abs().max() <= atol
    assert (got.float() - want).abs().max() <= atol
    # control: each row's codes read through the next row's codebook
    wrong = lut_gemv(x, codes, codebook.roll(1, 0).contiguous(), block_n=block_n,
                     block_k=block_k)
    assert (wrong.float() - want).abs().max() > 1.0


def test_default_tiles():
    x, codes, codebook = _case(0, 2, 100, 130, 16)
    assert torch.allclose(lut_gemv(x, codes, codebook), lut_gemv_ref(x, codes, codebook),
                          atol=1e-4)


def test_bad_inputs_are_named():
    x, codes, codebook = _case(1, 2, 8, 16, 16)
    with pytest.raises(ValueError, match="at most 16 rows of x, got M=17"):
        lut_gemv(torch.zeros(17, 16), codes, codebook)
    with pytest.raises(ValueError, match="codes must be uint8, got torch.int64"):
        lut_gemv(x, codes.long(), codebook)
    with pytest.raises(ValueError, match="codes must be below the codebook's 8 entries, got 15"):
        lut_gemv(x, torch.full_like(codes, 15), codebook[:, :8].contiguous())
    with pytest.raises(ValueError, match="one of \\(4, 8, 16\\) .* got 5"):
        lut_gemv(x, codes % 5, codebook[:, :5].contiguous())
    with pytest.raises(ValueError, match="lut_gemv needs x \\[M, K\\]"):
        lut_gemv(x[:, :15], codes, codebook)
