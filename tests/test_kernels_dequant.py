"""Fused W4A16 dequant-matmul against dequantize-then-matmul and an independent oracle
(docs/TESTING.md §C).

The weights are packed here, with plain integer arithmetic (not through nanoserve/quant/packing.py),
and the oracle is A · Wᵀ in fp64 with W built from the same integer codes; the module's reference
(`dequant_matmul_ref`) goes through packing.dequantize_gptq. Error: mean |C − C_ref| / mean |C_ref|
< 1e-3 (docs/TESTING.md), for M ∈ {1, 2, 3, 8, 16, 33, 64, 128} (GEMV up to 16, the tiled GEMM
above), K and N on and off the interpreter's 32-wide tiles, groups 32 / 64 / 128, act-order g_idx.
Negative
controls: a wrong g_idx and zeros stored without v1's − 1 must miss by far. `dequantize_int4`, the
kernel that writes W out, must equal packing.dequantize_gptq and the fp64 W bit for bit (exact: a
code difference times an fp16 scale fits fp32). Runs in Triton's interpreter without CUDA (conftest
sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pytest
import torch
from nanoserve.kernels.dequant_matmul import (
    choose_split_k,
    dequant_gemm,
    dequant_gemv,
    dequant_matmul,
    dequant_matmul_ref,
    dequantize_int4,
)

from nanoserve.quant.packing import dequantize_gptq

# docs/TESTING.md §C; fp32 in the interpreter lands near 1e-7 (only the summation order differs)
TOL = 1e-3
# (K, N, group, act-order): on the 32-wide tiles; both off them, last group partial; group wider
# than a tile
SHAPES = [(128, 64, 32, False), (200, 72, 64, True), (320, 40, 128, True)]


def _pack_words(x: torch.Tensor) -> torch.Tensor:
    """int [R, L] → int32 [R, L/8]: x[:, 8j + i] goes to bits 4i .. 4i+3 of word j."""
    words = torch.zeros(x.shape[0], x.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        words |= x[:, i::8].long() << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_case(K, N, group, act_order, seed=0, v1_offset=True):
    """GPTQ v1 tensors for random 4-bit codes, and W [N, K] in fp64 built from those codes."""
    g = torch.Generator().manual_seed(seed)
    G = -(-K // group)
    codes = torch.randint(0, 16, (N, K), generator=g)  # N, K
    zeros = torch.randint(1, 16, (N, G), generator=g)  # N, G
    scales = (torch.rand(N, G, generator=g) * 0.05 + 0.01).half()  # N, G
    g_idx = torch.arange(K) // group  # K
    if act_order:  # GPTQ's desc_act: groups follow a permutation of the rows
        g_idx = g_idx[torch.randperm(K, generator=g)]
    w = (codes - zeros[:, g_idx]).double() * scales[:, g_idx].double()  # N, K
    tensors = {
        "qweight": _pack_words(codes).t().contiguous(),  # K/8, N   packed along K
        # G, N/8   v1 stores zero − 1
        "qzeros": _pack_words((zeros - 1 if v1_offset else zeros).t()),
        "scales": scales.t().contiguous(),  # G, N
        "g_idx": g_idx.to(torch.int32),  # K
    }
    return tensors, w


def _rel(c, ref) -> float:
    c, ref = c.double(), ref.double()
    return ((c - ref).abs().mean() / ref.abs().mean()).item()


def _activations(M, K, dtype=torch.float32, seed=1):
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------- agreement
@pytest.mark.parametrize("M", [1, 2, 3, 8, 16, 33, 64, 128])
def test_matches_reference_and_oracle(M):
    for i, (K, N, group, act_order) in enumerate(SHAPES):
        tensors, w = _gptq_case(K, N, group, act_order, seed=i)
        a = _activations(M, K, seed=M)
        c = dequant_matmul(a, **tensors)
        assert c.shape == (M, N) and c.dtype == torch.float32
        assert _rel(c, dequant_matmul_ref(a, **tensors)) < TOL
        assert _rel(c, a.double() @ w.t()) < TOL


@pytest.mark.parametrize("M", [1, 16, 33, 128])
def test_fp16_activations(M):
    tensors, w = _gptq_case(200, 72, 64, True, seed=4)
    a = _activations(M, 200, torch.float16)
    c = dequant_matmul(a, **tensors)
    assert c.dtype == torch.float16
    assert _rel(c, dequant_matmul_ref(a, **tensors)) < TOL
    assert _rel(c, a.double() @ w.t()) < TOL


# 3 divides no tile count; 16 > the 10 tiles of K = 320
@pytest.mark.parametrize("split_k", [2, 3, 16])
def test_split_k_matches_one_split(split_k):
    tensors, w = _gptq_case(320, 40, 128, True, seed=5)
    a = _activations(3, 320)
    one = dequant_matmul(a, **tensors, split_k=1)
    c = dequant_matmul(a, **tensors, split_k=split_k)
    assert (c - one).abs().max() <= 1e-5 * one.abs().max()
    assert _rel(c, a.double() @ w.t()) < TOL


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("grouped", [True, False], ids=["g64", "act-order"])
def test_multiply_adds_and_the_dot_agree(M, grouped):
    """The GEMV of one or two rows by multiply-adds (fma=True, what M ≤ FMA_MAX_M takes) and by
    tl.dot over a tile of 16 (fma=False): both within the tolerance of the fp64 oracle and of each
    other, with split-K and ragged K and N."""
    K, N, group = (256, 96, 64) if grouped else (200, 72, 64)
    tensors, w = _gptq_case(K, N, group, not grouped, seed=7)
    a = _activations(M, K, seed=8)
    want = a.double() @ w.t()
    for split_k in (1, 3):
        kwargs = dict(split_k=split_k, group_size=group if grouped else None)
        fma = dequant_gemv(a, **tensors, fma=True, **kwargs)
        dot = dequant_gemv(a, **tensors, fma=False, **kwargs)
        assert _rel(fma, want) < 1e-6 and _rel(dot, want) < 1e-6
        assert (fma - dot).abs().max() <= 1e-5 * dot.abs().max()
    with pytest.raises(ValueError, match="fma=True takes M ≤ 2 rows, got M=3"):
        dequant_gemv(_activations(3, K), **tensors, fma=True)


def test_gemv_and_gemm_agree():
    tensors, _ = _gptq_case(200, 72, 32, True, seed=6)
    for M in (1, 16):
        a = _activations(M, 200, seed=M)
        gemv, gemm = dequant_gemv(a, **tensors, split_k=2), dequant_gemm(a, **tensors)
        assert (gemv - gemm).abs().max() <= 1e-5 * gemm.abs().max()


def test_strided_activations():
    tensors, w = _gptq_case(128, 64, 32, False)
    a = _activations(40, 256)[:, ::2]  # M, K with stride 2 along K
    assert _rel(dequant_matmul(a, **tensors), a.double() @ w.t()) < TOL
    assert _rel(dequant_matmul(a[:5], **tensors), a[:5].double() @ w.t()) < TOL


# ----------------------------------------------------------------------------- negative controls
def test_wrong_g_idx_is_caught():
    """Act-order weights read with the plain k // group assignment: most rows get another group's
    scale."""
    tensors, w = _gptq_case(200, 72, 32, True, seed=7)
    a = _activations(8, 200)
    want = a.double() @ w.t()
    plain = dict(tensors, g_idx=torch.arange(200, dtype=torch.int32) // 32)
    assert _rel(dequant_matmul(a, **plain), want) > 0.1
    assert _rel(dequant_matmul(a, **tensors), want) < TOL


def test_zeros_without_v1_offset_are_caught():
    """Zeros stored as the real zero (AWQ's convention): the kernel adds 1 and shifts every weight
    by a scale."""
    tensors, w = _gptq_case(128, 64, 32, False, v1_offset=False)
    a = _activations(3, 128)
    assert _rel(dequant_matmul(a, **tensors), a.double() @ w.t()) > 0.1


# ----------------------------------------------------------------------------- dequantize_int4: W
# written out
@pytest.mark.parametrize("K, N, group, act_order",
                         [*SHAPES, (64, 8, 64, False), (96, 48, 32, True)])
def test_dequantize_int4_equals_dequantize_gptq_bitwise(K, N, group, act_order):
    """fp32 W [N, K], bit for bit: (code − zero) · fp16 scale is exact in fp32, on both sides and in
    the fp64 oracle.

    Shapes: on the interpreter's 32 × 32 tiles, off them (K = 200, N = 72 or 40: masked edges), one
    program (N = 8), groups 32 / 64 / 128, plain and act-order g_idx; random codes put bit 31 in
    many qweight words.
    """
    tensors, w = _gptq_case(K, N, group, act_order, seed=K + N)
    # sign-bit words: >> sign-extends them, the mask must drop it
    assert (tensors["qweight"] < 0).any()
    out = dequantize_int4(**tensors)  # N, K
    assert out.shape == (N, K) and out.dtype == torch.float32
    assert torch.equal(out, dequantize_gptq(**tensors, bits=4))
    assert torch.equal(out.double(), w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_int4_half_dtypes(dtype):
    """One fp32 product rounded once to dtype, as dequantize_gptq(..., dtype=dtype) does (bf16: see
    the wrapper)."""
    tensors, _ = _gptq_case(200, 72, 64, True, seed=9)
    out = dequantize_int4(**tensors, dtype=dtype)  # N, K
    assert out.dtype == dtype and torch.equal(out, dequantize_gptq(**tensors, bits=4, dtype=dtype))


def test_dequantize_int4_strided_views():
    """Column slices of wider tensors (non-contiguous qweight, qzeros, scales): the kernel reads
    through strides."""
    tensors, _ = _gptq_case(128, 80, 32, True, seed=10)
    views = dict(tensors, qweight=tensors["qweight"][:, :40], qzeros=tensors["qzeros"][:, :5],
                 # K/8, 40 | G, 5 | G, 40   (fp32 scales too)
                 scales=tensors["scales"].float()[:, :40])
    assert not views["qweight"].is_contiguous()
    want = dequantize_gptq(**{k: v.contiguous() for k, v in views.items()}, bits=4)  # 40, K
    assert torch.equal(dequantize_int4(**views), want)


def test_dequantize_int4_wrong_g_idx_is_caught():
    """Negative control: act-order weights read with groups k // group_size come out wrong almost
    everywhere."""
    tensors, w = _gptq_case(200, 72, 32, True, seed=7)
    plain = dict(tensors, g_idx=torch.arange(200, dtype=torch.int32) // 32)
    assert (dequantize_int4(**plain).double() != w).float().mean() > 0.5
    assert torch.equal(dequantize_int4(**tensors).double(), w)


def test_dequantize_int4_validation():
    tensors, _ = _gptq_case(128, 64, 32, False)
    bad = {
        "dtype must be one of": dict(tensors, dtype=torch.int32),
        "qweight must be a 2-D int32": dict(tensors, qweight=tensors["qweight"].long()),
        "qzeros must be": dict(tensors, qzeros=tensors["qzeros"][:, :4]),
        r"g_idx must hold groups 0 \.\. 3": dict(tensors, g_idx=tensors["g_idx"] * 2),
    }
    for message, kwargs in bad.items():
        with pytest.raises(ValueError, match=message):
            dequantize_int4(**kwargs)


# ----------------------------------------------------------------------------- validation,
# heuristic
def test_validation_errors():
    tensors, _ = _gptq_case(128, 64, 32, False)
    a = _activations(2, 128)
    bad = {
        "4-bit kernel": (dict(tensors, bits=8), a),
        r"a must be \[M, K\] = \[M, 128\]": (tensors, a[:, :64]),
        r"a must be one of": (tensors, a.to(torch.int32)),
        "qweight must be a 2-D int32": (dict(tensors, qweight=tensors["qweight"].long()), a),
        "qzeros must be": (dict(tensors, qzeros=tensors["qzeros"][:, :4]), a),
        "scales must be a float": (dict(tensors, scales=tensors["scales"][:, :32]), a),
        r"g_idx must hold groups 0 \.\. 3": (dict(tensors, g_idx=tensors["g_idx"] * 2), a),
        r"g_idx must be an int32/int64 \[K\]": (dict(tensors, g_idx=tensors["g_idx"][:64]), a),
    }
    for message, (kwargs, act) in bad.items():
        with pytest.raises(ValueError, match=message):
            dequant_matmul(act, **kwargs)
    with pytest.raises(ValueError, match="split_k must be"):
        dequant_matmul(a, **tensors, split_k=0)
    with pytest.raises(ValueError, match="M ≤ 16"):
        dequant_gemv(_activations(17, 128), **tensors)


def test_choose_split_k():
    if not torch.cuda.is_available():
        assert choose_split_k(4096, 4096) == 1
    # ⌈4 · 132 / 64 N-tiles of 128⌉; 128 K-tiles allow 32
    assert choose_split_k(8192, 8192, num_sms=132) == 9
    # ⌈4 · 132 / 32⌉ = 17, but 64 K-tiles allow 16
    assert choose_split_k(4096, 4096, num_sms=132) == 16
    assert choose_split_k(4096, 256, num_sms=132) == 1  # 4 K-tiles: one split
    assert choose_split_k(64, 1 << 16, num_sms=132) == 16  # capped at MAX_SPLIT_K


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol",
                         [(torch.float16, 1e-3), (torch.bfloat16, 4e-3), (torch.float32, 1e-4)])
def test_compiled_kernels_on_cuda(dtype, tol):
    """bf16 rounds each dequantized weight to 8 mantissa bits (~1e-3 relative on C): a wider
    bound."""
    # act-order: the row-by-row gather; sorted groups: the grouped path too
    for act_order in (True, False):
        tensors, w = _gptq_case(4096, 1000, 128, act_order, seed=8)
        tensors = {k: v.cuda() for k, v in tensors.items()}
        groups = [None] if act_order else [None, 128]
        for M in (1, 7, 16, 33, 64, 256):
            a = _activations(M, 4096, dtype).cuda()
            want = (a.double() @ w.cuda().t()).float()  # M, N
            for gs in groups:
                for c in (dequant_matmul(a, **tensors, group_size=gs),
                          dequant_gemm(a, **tensors, group_size=gs)):
                    assert c.dtype == dtype and _rel(c, want) < tol
                if M <= 16:
                    for split_k in (1, 5):
                        assert (
                            _rel(dequant_gemv(a, **tensors, split_k=split_k, group_size=gs), want)
                            < tol
                        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_dequantize_int4_on_cuda(dtype):
    """The compiled kernel rounds fp32 to dtype on the GPU (round to nearest even, as torch):
    bitwise again."""
    tensors, _ = _gptq_case(4096, 1000, 128, True, seed=8)
    tensors = {k: v.cuda() for k, v in tensors.items()}
    out = dequantize_int4(**tensors, dtype=dtype)  # N, K
    torch.cuda.synchronize()
    assert torch.equal(out, dequantize_gptq(**tensors, bits=4, dtype=dtype))


@pytest.mark.parametrize("K,N,group", [(256, 96, 64), (192, 40, 32), (320, 72, 64)])
def test_grouped_path_matches_the_reference(K, N, group):
    """group_size= (sorted groups: one zero and scale row per tile, the scale applied after the dot)
    computes what the row-by-row path does, for the GEMV (with split-K) and the GEMM, ragged K and N
    included."""
    tensors, w = _gptq_case(K, N, group, False, seed=3)
    for M in (1, 5, 20):
        a = _activations(M, K)
        want = a.double() @ w.t()  # M, N
        assert _rel(dequant_matmul(a, **tensors, group_size=group), want) < 1e-6
        assert _rel(dequant_gemm(a, **tensors, group_size=group), want) < 1e-6
        if M <= 16:
            assert _rel(dequant_gemv(a, **tensors, split_k=3, group_size=group), want) < 1e-6


def test_grouped_path_refuses_act_order_and_a_wrong_promise_is_wrong():
    """group_size= is a promise about g_idx: on CPU it is checked (act-order is refused by name).
    The negative control bypasses the check and shows what the promise buys when false: one scale
    row per tile is wrong."""
    tensors, w = _gptq_case(256, 64, 32, True, seed=4)
    a = _activations(3, 256)
    with pytest.raises(ValueError, match="act-order"):
        dequant_matmul(a, **tensors, group_size=32)
    from nanoserve.kernels import dequant_matmul as dm

    K, N = 256, 64
    wrong = dm._launch_gemv(a, *tensors.values(), K, N, 1, group_size=32)  # the check skipped
    assert _rel(wrong, a.double() @ w.t()) > 0.1


def test_quant_linear_takes_the_grouped_path_only_for_sorted_groups():
    """QuantLinear looks at its g_idx once: sorted groups -> the kernels' group_size; act-order ->
    None (the gather path). A state dict loaded later (a new g_idx) is looked at again."""
    from nanoserve.quant.qlinear import QuantLinear

    layer = QuantLinear(256, 64, 4, 64, bias=False)
    assert layer.kernel_group_size() == 64
    state = dict(layer.state_dict())
    state["g_idx"] = state["g_idx"][torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    layer.load_state_dict(state)
    assert layer.kernel_group_size() is None


def test_split_k_reduces_inside_its_launch_and_leaves_the_counters_at_zero():
    """One launch: the last split of each column tile sums the partials (in split order) and
    resets its tile's counter, so a second call gives the same bits. Control: counters left
    non-zero make a split reduce before the others have written their partials."""
    from nanoserve.kernels import dequant_matmul as dm
    from nanoserve.kernels.checks import values_unread

    from nanoserve.tools.launch_count import LaunchCounter

    tensors, w = _gptq_case(320, 40, 128, True, seed=5)
    a, other = _activations(3, 320), _activations(3, 320, seed=9)
    with values_unread(), LaunchCounter() as counter:
        c = dequant_gemv(a, **tensors, split_k=3)
    assert counter.total() == 1 and dict(counter.triton) == {"_dequant_gemv_kernel": 1}
    counts = dm._COUNTS[a.device]
    assert not counts.any()
    assert torch.equal(dequant_gemv(a, **tensors, split_k=3), c)
    assert _rel(c, a.double() @ w.t()) < TOL
    want = dequant_gemv(other, **tensors, split_k=3)
    counts[:4] = 1  # as a launch that died half-way would leave them
    stale = dequant_gemv(other, **tensors, split_k=3)
    counts.zero_()
    assert not torch.allclose(stale, want)
