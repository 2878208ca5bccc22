"""The Triton matmul over llama.cpp's blocks (kernels/ggml_matmul.py) vs dequantize-then-matmul.

Weights: Q8_0 quantized by the `gguf` package itself (gguf.quants.quantize); Q4_K and Q6_K, which
gguf 0.19 cannot quantize, as random valid bytes (gguf_writer.k_blocks: random codes, scales and
mins, fp16 d small enough that weights stay near ±0.1). Two references: the module's
`ggml_matmul_ref` (quant/ggml_blocks.py's dequantization, then x · Wᵀ in fp32) and an outside
oracle, x · Wᵀ in fp64 with W dequantized by gguf's numpy code. fp32 x: max |y − ref| ≤ 1e-5 ·
max |ref| (only the order of fp32 sums differs; measured ~5e-7). M ∈ {1, 3, 16, 64} (multiply-adds,
the tl.dot GEMV, the row-tiled GEMM), N off the 32-wide tiles, Q8_0 rows not a whole number of
256-weight steps, split-K with empty splits. Edge cases: negative and zero d, zero and maximal
scales. Negative controls: Q4_K's scale and min bytes swapped, its nibbles read in the wrong order,
Q6_K's ql halves exchanged: each misses the reference by far. Runs in Triton's interpreter
(conftest sets TRITON_INTERPRET=1); tests/test_kernels_compile.py compiles the kernel for GPUs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nanoserve.kernels.ggml_matmul import (
    TYPES,
    ggml_kernel_serves,
    ggml_matmul,
    ggml_matmul_ref,
)

from nanoserve.quant.ggml_blocks import BLOCK_TYPES

gguf = pytest.importorskip("gguf")
quants = pytest.importorskip("gguf.quants")
from gguf_writer import k_blocks  # noqa: E402

TOL = 1e-5  # max |y − ref| / max |ref|, fp32
N = 72  # off the interpreter's 32-wide column tiles
K_OF = {"Q8_0": 480, "Q4_K": 512, "Q6_K": 512}  # Q8_0: 15 blocks, not a whole 256-weight step


def _packed(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [n, k / block weights · block bytes]: gguf's quantization of N(0, 1) weights (Q8_0),
    random valid blocks (K-quants)."""
    rng = np.random.default_rng(seed)
    qtype = getattr(gguf.GGMLQuantizationType, name)
    if name == "Q8_0":
        raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    else:
        raw = k_blocks(qtype, (n, k), rng)
    return torch.from_numpy(np.ascontiguousarray(raw))


def _oracle(x: torch.Tensor, packed: torch.Tensor, name: str) -> torch.Tensor:
    """x · Wᵀ in fp64, W dequantized by gguf's numpy reference."""
    w = quants.dequantize(packed.numpy(), getattr(gguf.GGMLQuantizationType, name))
    return x.double() @ torch.from_numpy(w).double().t()


def _err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y − ref| / max |ref|."""
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _x(M: int, K: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------- agreement
@pytest.mark.parametrize("name", TYPES)
def test_matches_reference_and_oracle(name):
    K = K_OF[name]
    packed = _packed(name, N, K, seed=0)
    for M in (1, 3, 16, 64):
        x = _x(M, K, seed=M)
        y = ggml_matmul(x, packed, name, N)
        assert y.shape == (M, N) and y.dtype == torch.float32
        assert _err(y, ggml_matmul_ref(x, packed, name, N)) < TOL, (name, M)
        assert _err(y, _oracle(x, packed, name)) < TOL, (name, M)


@pytest.mark.parametrize("name", TYPES)
def test_split_k_and_multiply_adds_agree(name):
    """The decode GEMV of 1 and 2 rows by multiply-adds (fma) and by tl.dot over a tile of 16, in
    1, 2 and 8 splits (8 > the 2 steps of K: empty splits write zeros): all within TOL of the
    oracle and of each other."""
    K = K_OF[name]
    packed = _packed(name, N, K, seed=2)
    for M in (1, 2):
        x = _x(M, K, seed=3)
        want = _oracle(x, packed, name)
        one = ggml_matmul(x, packed, name, N, split_k=1, fma=True)
        for split_k, fma in ((2, True), (8, True), (2, False)):
            y = ggml_matmul(x, packed, name, N, split_k=split_k, fma=fma)
            assert _err(y, want) < TOL and _err(y, one) < TOL, (split_k, fma)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_activations(dtype):
    """x and y in fp16 / bf16: y within one rounding of y's dtype of the fp32 reference on the same
    x (the interpreter computes in fp32; its bf16 store truncates)."""
    for name in TYPES:
        K = K_OF[name]
        packed = _packed(name, N, K, seed=4)
        for M in (1, 16):
            x = _x(M, K, dtype, seed=5)
            y = ggml_matmul(x, packed, name, N)
            assert y.dtype == dtype
            ref = ggml_matmul_ref(x.float(), packed, name, N)
            bound = 2 * torch.finfo(dtype).eps * ref.abs() + 1e-6 * ref.abs().max()
            assert ((y.float() - ref).abs() <= bound).all(), (name, M)


def test_strided_inputs():
    """x with stride 2 along K; W a column slice of wider rows (row stride > bytes per row)."""
    packed = _packed("Q4_K", N, 512, seed=6)
    wide = torch.zeros(N, packed.shape[1] + 16, dtype=torch.uint8)
    wide[:, :packed.shape[1]] = packed
    view = wide[:, :packed.shape[1]]  # N, 288   stride (304, 1)
    x = _x(3, 1024, seed=7)[:, ::2]  # 3, 512   stride (1024, 2)
    for M in (1, 3):
        y = ggml_matmul(x[:M], view, "Q4_K", N)
        assert _err(y, _oracle(x[:M], packed, "Q4_K")) < TOL


# ----------------------------------------------------------------------------- edge cases
def _set_f16(packed: torch.Tensor, name: str, at: int, values: np.ndarray) -> None:
    """Write fp16 values (one per block, in block order) at byte `at` of every block."""
    kind = BLOCK_TYPES[name]
    blocks = packed.view(-1, kind.block_bytes)
    raw = torch.from_numpy(values.astype(np.float16).view(np.uint8).reshape(-1, 2))
    blocks[:, at:at + 2] = raw


@pytest.mark.parametrize("name", TYPES)
def test_negative_and_zero_scales(name):
    """d (and Q4_K's dmin) negative in some blocks, zero in others; Q4_K scale bytes all 0x00 or
    all 0xFF (6-bit scales and mins of 0 and 63) in some super-blocks; Q6_K's int8 scales at -128,
    0 and 127."""
    K = K_OF[name]
    packed = _packed(name, N, K, seed=8)
    kind = BLOCK_TYPES[name]
    blocks = packed.view(-1, kind.block_bytes)
    n = blocks.shape[0]
    rng = np.random.default_rng(9)
    d_at = {"Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}[name]
    for at in d_at:
        current = blocks[:, at:at + 2].contiguous().view(torch.float16).float().numpy().ravel()
        sign = rng.choice([-1.0, 1.0], n)
        zero = rng.random(n) < 0.15
        _set_f16(packed, name, at, np.where(zero, 0.0, sign * np.abs(current)))
    if name == "Q4_K":
        blocks[0::5, 4:16] = 0
        blocks[1::5, 4:16] = 255
    if name == "Q6_K":
        blocks[0::3, 192:208] = torch.tensor(np.array([-128, 0, 127] * 5 + [-1], dtype=np.int8)
                                             .view(np.uint8))
    for M in (1, 16):
        x = _x(M, K, seed=10)
        y = ggml_matmul(x, packed, name, N)
        assert _err(y, ggml_matmul_ref(x, packed, name, N)) < TOL
        assert _err(y, _oracle(x, packed, name)) < TOL


# ----------------------------------------------------------------------------- negative controls
def test_a_wrong_reading_of_the_blocks_is_caught():
    """The comparison can fail: the kernel fed bytes read the wrong way misses the reference of
    the true bytes by far (error > 0.05, where the tolerance is 1e-5): Q4_K with its four scale
    bytes and four min bytes swapped, Q4_K with low and high nibbles exchanged, Q6_K with the two
    32-byte runs of each half's ql exchanged."""
    x = _x(3, 512, seed=11)
    q4 = _packed("Q4_K", N, 512, seed=12)
    want = ggml_matmul_ref(x, q4, "Q4_K", N)
    assert _err(ggml_matmul(x, q4, "Q4_K", N), want) < TOL  # the true reading passes

    swapped = q4.clone().view(-1, 144)
    swapped[:, 4:8], swapped[:, 8:12] = q4.view(-1, 144)[:, 8:12], q4.view(-1, 144)[:, 4:8]
    assert _err(ggml_matmul(x, swapped.view(N, -1), "Q4_K", N), want) > 0.05

    nibbles = q4.clone().view(-1, 144)
    codes = nibbles[:, 16:]
    nibbles[:, 16:] = (codes >> 4) | (codes << 4)
    assert _err(ggml_matmul(x, nibbles.view(N, -1), "Q4_K", N), want) > 0.05

    q6 = _packed("Q6_K", N, 512, seed=13)
    exchanged = q6.clone().view(-1, 210)
    for h in (0, 64):  # each half's ql: bytes h .. h + 31 and h + 32 .. h + 63 exchanged
        exchanged[:, h:h + 32] = q6.view(-1, 210)[:, h + 32:h + 64]
        exchanged[:, h + 32:h + 64] = q6.view(-1, 210)[:, h:h + 32]
    want6 = ggml_matmul_ref(x, q6, "Q6_K", N)
    assert _err(ggml_matmul(x, q6, "Q6_K", N), want6) < TOL
    assert _err(ggml_matmul(x, exchanged.view(N, -1), "Q6_K", N), want6) > 0.05


# ----------------------------------------------------------------------------- checks
def test_refused_inputs_say_why():
    packed = _packed("Q8_0", 8, 64, seed=14)
    x = _x(2, 64)
    with pytest.raises(ValueError, match="reads Q8_0, Q4_K, Q6_K, not 'Q4_0'"):
        ggml_matmul(x, packed, "Q4_0", 8)
    with pytest.raises(ValueError, match=r"packed must be uint8 \(8, 68\) for Q8_0"):
        ggml_matmul(x, packed[:, :60], "Q8_0", 8)
    with pytest.raises(ValueError, match="K=48 is not a whole number of 32-weight Q8_0 blocks"):
        ggml_matmul(_x(2, 48), packed, "Q8_0", 8)
    with pytest.raises(ValueError, match="fma=True takes M ≤ 2 rows, got M=3"):
        ggml_matmul(_x(3, 64), packed, "Q8_0", 8, fma=True)
    with pytest.raises(ValueError, match="split_k > 1 takes M ≤ 16 rows, got M=17"):
        ggml_matmul(_x(17, 64), packed, "Q8_0", 8, split_k=2)
    with pytest.raises(ValueError, match="x must be 2-D"):
        ggml_matmul(x.to(torch.int32), packed, "Q8_0", 8)


def test_ggml_linear_uses_the_kernel_only_on_cuda():
    """GGMLLinear's CUDA branch (nanoserve/models/gguf_file.py) asks `ggml_kernel_serves`: never
    for CPU tensors (the C kernel or dequantize + F.linear serve those)."""
    packed = _packed("Q6_K", 8, 256, seed=15)
    assert not ggml_kernel_serves(_x(1, 256), packed, "Q6_K")
