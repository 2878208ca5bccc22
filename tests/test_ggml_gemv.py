"""The CPU GEMV over packed llama.cpp blocks (kernels/cpu_ggml_gemv.c) against its reference (the
matrix dequantized, then multiplied) and against float64: weights the gguf package quantized,
several shapes and batch sizes, odd numbers of output rows. The only difference allowed is the
order of float additions. Negative control: one code changed in one block is caught by that
tolerance. Also the portable C path (compiled without AVX2) agrees."""

from __future__ import annotations

import ctypes

import pytest
import torch
from nanoserve.kernels import cpu_ggml_gemv as gemv
from nanoserve.kernels.cpu_ggml_gemv import ggml_gemv, ggml_gemv_ref

gguf = pytest.importorskip("gguf")
from gguf_writer import packed_weights  # noqa: E402

CODE_AT = {"Q8_0": 5, "Q4_0": 5, "Q4_K": 40, "Q6_K": 7}  # a byte of codes in the first block
pytestmark = pytest.mark.skipif(gemv.cpu_gemv_problem() is not None,
                                reason=str(gemv.cpu_gemv_problem()))


def _packed(type_name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(packed_weights(type_name, (n, k), seed))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("m, n, k", [(1, 1, 256), (1, 97, 512), (3, 64, 2048), (8, 130, 768),
                                     (19, 40, 512)])
def test_equals_the_reference_but_for_rounding(type_name, m, n, k):
    packed = _packed(type_name, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    ours = ggml_gemv(x, packed, type_name, n)
    exact = ggml_gemv_ref(x.double(), packed, type_name, n).double()
    ref = ggml_gemv_ref(x, packed, type_name, n)
    scale = exact.abs().max().item()
    assert (ours.double() - exact).abs().max().item() <= 1e-5 * scale * max(1, k / 512)
    assert (ref.double() - exact).abs().max().item() <= 1e-5 * scale * max(1, k / 512)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_negative_control_one_wrong_code_is_seen(type_name):
    """The tolerance above is tight enough to catch a single code read wrong."""
    packed = _packed(type_name, 64, 2048)
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(1))
    exact = ggml_gemv_ref(x.double(), packed, type_name, 64).double()
    broken = packed.clone()
    broken[5, CODE_AT[type_name]] ^= 0x10  # one code of row 5's first block
    diff = (ggml_gemv(x, broken, type_name, 64).double() - exact).abs().max().item()
    assert diff > 1e-5 * exact.abs().max().item() * 4


def test_bad_inputs_are_refused():
    packed = _packed("Q8_0", 4, 64)
    for x, says in [(torch.randn(1, 96), "packed must be"), (torch.randn(1, 48), "whole number"),
                    (torch.randn(1, 64, dtype=torch.float64), "float32")]:
        with pytest.raises(ValueError, match=says):
            ggml_gemv(x, packed, "Q8_0", 4)


def test_the_portable_c_path_agrees(monkeypatch, tmp_path):
    """The same source without AVX2 (the plain-C sums every other CPU runs)."""
    from nanoserve.kernels.cpu_build import build_library

    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    lib = build_library(gemv.SOURCE, [*gemv.FLAGS, "-mno-avx2", "-mno-f16c", "-mno-fma",
                                      "-mno-avx512f"],
                        "ggml_gemv_portable")
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ggml_gemv.argtypes = [i32, ptr, ptr, ptr, i64, i64, i64, i64, i32]
    for type_name, (kind, _, _) in gemv.KINDS.items():
        packed = _packed(type_name, 33, 512)
        for rows in (2, 5):  # the blocks multiplied in place; the row decoded once
            x = torch.randn(rows, 512)
            y = torch.empty(rows, 33)
            lib.ggml_gemv(kind, packed.data_ptr(), x.data_ptr(), y.data_ptr(), rows, 33, 512,
                          packed.shape[1], 1)
            assert torch.allclose(y, ggml_gemv(x, packed, type_name, 33), rtol=1e-5, atol=1e-5)
