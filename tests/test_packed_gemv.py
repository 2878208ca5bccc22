"""The CPU GEMV over packed weights (kernels/cpu_packed_gemv.c) against its references (the matrix
dequantized, then multiplied) and against float64: llama.cpp blocks the gguf package quantized, and
GPTQ grids packed by nanoserve.quant.packing (4 and 8 bits, asymmetric, groups of 32 to K), several
shapes and batch sizes, odd numbers of output rows. The only difference allowed is the order of
float additions. Negative controls: one code changed in one block is caught by that tolerance,
and so is a grid's zero point read without GPTQ v1's + 1. Also the portable C path (compiled
without AVX2) agrees, and `QuantLinear` on the CPU runs the kernel and equals its own dequantized
product."""

from __future__ import annotations

import ctypes

import pytest
import torch
from nanoserve.kernels import cpu_packed_gemv as gemv
from nanoserve.kernels.cpu_packed_gemv import ggml_gemv, ggml_gemv_ref, grid_gemv, grid_gemv_ref

from nanoserve.quant.packing import dequantize_gptq, pack_gptq
from nanoserve.quant.qlinear import QuantLinear

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


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_whole_matrices_decode_as_ggufs_reference_bit_for_bit(type_name):
    """The prefill path's decoding (many rows: decode, then a BLAS GEMM) against gguf's numpy
    dequantization."""
    packed = _packed(type_name, 37, 512)
    theirs = gguf.quants.dequantize(packed.numpy(), getattr(gguf.GGMLQuantizationType, type_name))
    ours = gemv.ggml_dequantize(packed, type_name, 37, 512)
    assert torch.equal(ours, torch.from_numpy(theirs.reshape(37, 512)))


def test_many_rows_multiply_slab_by_slab():
    """decoded_matmul: W decoded a slab of rows at a time (here 256 rows of 512, the last slab
    short), each multiplied by a GEMM, equals the whole product."""
    packed = _packed("Q4_K", 600, 512)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(1))
    slabs = []

    def decode(n0, n1):
        slabs.append((n0, n1))
        return gemv.ggml_dequantize(packed[n0:n1], "Q4_K", n1 - n0, 512)

    y = gemv.decoded_matmul(x, decode, 600)
    assert slabs == [(0, 256), (256, 512), (512, 600)]
    exact = ggml_gemv_ref(x.double(), packed, "Q4_K", 600).double()
    assert (y.double() - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()


def test_bad_inputs_are_refused():
    packed = _packed("Q8_0", 4, 64)
    for x, says in [(torch.randn(1, 96), "packed must be"), (torch.randn(1, 48), "whole number"),
                    (torch.randn(1, 64, dtype=torch.float64), "float32")]:
        with pytest.raises(ValueError, match=says):
            ggml_gemv(x, packed, "Q8_0", 4)


def _portable_library(monkeypatch, tmp_path) -> ctypes.CDLL:
    """The same source without AVX2 (the plain-C sums every other CPU runs)."""
    from nanoserve.kernels.cpu_build import build_library

    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    lib = build_library(gemv.SOURCE, [*gemv.FLAGS, "-mno-avx2", "-mno-f16c", "-mno-fma",
                                      "-mno-avx512f"], "packed_gemv_portable")
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ggml_gemv.argtypes = [i32, ptr, ptr, ptr, i64, i64, i64, i64, i32]
    lib.grid_gemv.argtypes = [i32, ptr, i64, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i32]
    return lib


def test_the_portable_c_path_agrees(monkeypatch, tmp_path):
    lib = _portable_library(monkeypatch, tmp_path)
    for type_name, (kind, _, _) in gemv.KINDS.items():
        packed = _packed(type_name, 33, 512)
        for rows in (2, 5):  # the blocks multiplied in place; the row decoded once
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
            y = torch.empty(rows, 33)
            lib.ggml_gemv(kind, packed.data_ptr(), x.data_ptr(), y.data_ptr(), rows, 33, 512,
                          packed.shape[1], 1)
            _assert_equal_but_for_rounding(y, ggml_gemv(x, packed, type_name, 33))


def _assert_equal_but_for_rounding(y: torch.Tensor, want: torch.Tensor) -> None:
    """Two float32 sums of the same 512 products in different orders: equal to 1e-5 of the
    largest output (one element may be a small difference of large terms)."""
    assert (y - want).abs().max().item() <= 1e-5 * want.abs().max().item()


# ----------------------------------------------------------------------------- GPTQ's grids
def _grid(bits: int, n: int, k: int, group: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random codes, zero points (asymmetric: anywhere in v1's 1 .. 2^bits) and scales of both
    signs, packed as GPTQ v1 by nanoserve.quant.packing."""
    gen = torch.Generator().manual_seed(seed)
    top = 1 << bits
    codes = torch.randint(0, top, (n, k), generator=gen)
    zeros = torch.randint(1, top + 1, (n, k // group), generator=gen)
    scales = torch.randn(n, k // group, generator=gen) * 0.01
    g_idx = torch.arange(k) // group
    return pack_gptq(codes, zeros, scales, g_idx, bits)


def _layer(packed: dict, bits: int) -> QuantLinear:
    k = packed["g_idx"].numel()
    n = packed["scales"].shape[1]
    layer = QuantLinear(k, n, bits, k // packed["scales"].shape[0], bias=False,
                        dtype=torch.float32)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        getattr(layer, name).copy_(packed[name])
    return layer


def _grid_args(packed: dict, bits: int) -> tuple:
    """What grid_gemv reads, from GPTQ v1 tensors (a QuantLinear derives the floats)."""
    layer = _layer(packed, bits)
    return (layer.qweight, *layer.cpu_floats(), bits, layer.group_size)


def _exact(x: torch.Tensor, packed: dict, bits: int) -> torch.Tensor:
    """float64 product with the matrix packing.py dequantizes (not the kernel's own reference)."""
    weight = dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"].float(),
                             packed["g_idx"], bits)
    return torch.nn.functional.linear(x.double(), weight.double())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m, n, k, group", [(1, 8, 32, 32), (1, 96, 512, 128), (3, 64, 2048, 128),
                                            (5, 40, 768, 768), (19, 24, 256, 64),
                                            (8, 136, 512, 128), (3, 48, 768, 768),
                                            (2, 40, 384, 128)])
def test_grids_equal_the_dequantized_product_but_for_rounding(bits, m, n, k, group):
    """Under 4 rows the threads split the groups (one group: the outputs; 3 groups: unevenly),
    from 4 rows on the outputs, in panels of 16."""
    packed = _grid(bits, n, k, group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    exact = _exact(x, packed, bits)
    args = _grid_args(packed, bits)
    tolerance = 1e-5 * exact.abs().max().item() * max(1, k / 512)
    assert (grid_gemv(x, *args).double() - exact).abs().max().item() <= tolerance
    assert (grid_gemv_ref(x.double(), *args) - exact).abs().max().item() <= 1e-9


@pytest.mark.parametrize("bits", [4, 8])
def test_negative_controls_one_wrong_code_or_v1s_zero_offset_is_seen(bits):
    packed = _grid(bits, 64, 1024, 128)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(1))
    exact = _exact(x, packed, bits)
    qweight, scales, zeros, _, group = _grid_args(packed, bits)
    tolerance = 1e-5 * exact.abs().max().item() * 2
    broken = qweight.clone()
    broken[5, 7] ^= 1 << bits  # code 1 of word 5, output 7
    assert (grid_gemv(x, broken, scales, zeros, bits, group).double()
            - exact).abs().max().item() > tolerance
    stored = zeros - 1  # v1 stores zero − 1: forgetting the + 1 on the way back
    assert (grid_gemv(x, qweight, scales, stored, bits, group).double()
            - exact).abs().max().item() > tolerance


def test_a_view_of_stacked_codes_is_read_with_its_stride():
    """models/triton_layers.py stacks q, k, v: each layer's qweight is a column slice of one
    tensor, rows `N_total` words apart."""
    packed = _grid(4, 96, 256, 128)
    qweight, scales, zeros, bits, group = _grid_args(packed, 4)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4))
    whole = grid_gemv(x, qweight, scales, zeros, bits, group)
    part = grid_gemv(x, qweight[:, 32:64], scales[:, 32:64].contiguous(),
                     zeros[:, 32:64].contiguous(), bits, group)
    assert torch.equal(part, whole[:, 32:64])


@pytest.mark.parametrize("bits", [4, 8])
def test_whole_grids_decode_as_packing_does_bit_for_bit(bits):
    """The prefill path's decoding (then a BLAS GEMM) against packing.py's dequantization."""
    packed = _grid(bits, 40, 512, 128)
    qweight, scales, zeros, _, group = _grid_args(packed, bits)
    want = dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"].float(),
                           packed["g_idx"], bits)
    assert torch.equal(gemv.grid_dequantize(qweight, scales, zeros, bits, group), want)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 7, 70])
def test_quantlinear_on_the_cpu_runs_the_kernel_and_keeps_its_tensors(bits, rows):
    packed = _grid(bits, 64, 512, 128, seed=2)
    layer = _layer(packed, bits)
    before = {name: t.clone() for name, t in layer.state_dict().items()}
    x = torch.randn(rows, 3, 512, generator=torch.Generator().manual_seed(3))
    assert layer.cpu_kernel_problem(x) is None
    y = layer(x)
    exact = _exact(x.reshape(-1, 512), packed, bits).reshape(rows, 3, 64)
    assert (y.double() - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()
    after = layer.state_dict()
    assert all(torch.equal(after[name], t) for name, t in before.items())


@pytest.mark.parametrize("replace", [False, True])
def test_quantlinear_sees_its_tensors_changed_in_place_or_replaced(replace):
    """The kernel's call is prepared once per set of tensors: new values copied in (a state dict
    loaded, a `copy_`) or a buffer replaced must prepare it again. Control: the call prepared
    before the change, run on the same x, misses the new weights."""
    layer = _layer(_grid(4, 64, 512, 128, seed=2), 4)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(3))
    layer(x)
    stale = layer._cpu_grid()
    new = _grid(4, 64, 512, 128, seed=5)
    for name in ("qweight", "qzeros", "scales"):
        if replace:
            setattr(layer, name, new[name].clone())
        else:
            getattr(layer, name).copy_(new[name])
    exact = _exact(x, new, 4)
    tolerance = 1e-5 * exact.abs().max().item()
    assert (layer(x).double() - exact).abs().max().item() <= tolerance
    assert (stale(x).double() - exact).abs().max().item() > 100 * tolerance


def test_act_order_and_2_bit_layers_take_the_torch_path():
    layer = _layer(_grid(4, 32, 256, 128), 4)
    layer.g_idx.copy_(layer.g_idx.flip(0))
    layer._sorted_groups = None
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4))
    assert "act-order" in layer.cpu_kernel_problem(x)
    exact = torch.nn.functional.linear(x.double(), layer.dequantize().double())
    assert torch.allclose(layer(x).double(), exact, rtol=1e-5, atol=1e-6)
    two_bit = QuantLinear(256, 32, 2, 128, bias=False, dtype=torch.float32)
    assert "2-bit" in two_bit.cpu_kernel_problem(x)


def test_the_portable_c_path_agrees_on_grids(monkeypatch, tmp_path):
    lib = _portable_library(monkeypatch, tmp_path)
    for bits in (4, 8):
        qweight, scales, zeros, _, group = _grid_args(_grid(bits, 24, 512, 128), bits)
        for rows in (2, 5):
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
            y = torch.empty(rows, 24)
            lib.grid_gemv(bits, qweight.data_ptr(), qweight.stride(0), scales.data_ptr(),
                          zeros.data_ptr(), group, x.data_ptr(), y.data_ptr(), rows, 24, 512, 1)
            _assert_equal_but_for_rounding(y, grid_gemv(x, qweight, scales, zeros, bits, group))
