"""The Triton kernels on 8-bit KV pools (kernels/kv_quant.py) against torch (docs/TESTING.md §D).

The outside oracle for the bits is torch's own int8 rounding and float8_e4m3fn / float8_e5m2 dtypes,
through nanoserve/kv/quant.py: `store_kv` must write exactly the codes and fp16 scales
`KVQuant.quantize` gives (every FP8 code decoded, every midpoint between two codes rounded to even,
−0, subnormals, the largest values), and paged decode / flash prefill over a quantized pool must
equal the fp32 reference attention over the dequantized tensors (≤ 1e-5). Unused slots hold NaN
codes (FP8) and NaN scales: a kernel reading past a context returns NaN. Negative control: the same
comparison with the scales one slot off misses by far. Runs in Triton's interpreter without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from nanoserve.kernels.flash_attention import flash_attention, flash_attention_ref
from nanoserve.kernels.kv_quant import KV_QUANT_CODES, fp8_decode, fp8_encode
from nanoserve.kernels.paged_attention import paged_attention, paged_attention_ref
from nanoserve.kernels.store_kv import store_kv, store_kv_ref

from nanoserve.kv.quant import FORMATS

MODES = list(FORMATS)
FP8 = ["fp8_e4m3", "fp8_e5m2"]
CODE = KV_QUANT_CODES


@triton.jit
def _encode_kernel(X, Bits, n, KV_QUANT: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Bits + offs, fp8_encode(tl.load(X + offs, mask=offs < n, other=0.0), KV_QUANT),
             mask=offs < n)


@triton.jit
def _decode_kernel(Bits, Out, n, KV_QUANT: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Out + offs, fp8_decode(tl.load(Bits + offs, mask=offs < n, other=0), KV_QUANT),
             mask=offs < n)


def _finite_codes(name):
    """Every FP8 bit pattern that is a finite number."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return bits[torch.isfinite(bits.view(FORMATS[name].fp8).float())]


@pytest.mark.parametrize("name", FP8)
def test_every_fp8_code_decodes_exactly_and_every_midpoint_rounds_to_even(name):
    fp8 = FORMATS[name].fp8
    bits = _finite_codes(name)
    out = torch.empty(len(bits))
    _decode_kernel[(1,)](bits, out, len(bits), KV_QUANT=CODE[name], N=256)
    assert torch.equal(out, bits.view(fp8).float())  # bit for bit, −0 and the subnormals included
    values = bits.view(fp8).float().unique()  # sorted
    mids = (values[1:] + values[:-1]) / 2  # ties: round to the code with an even mantissa
    x = torch.cat([values, mids, mids.nextafter(values[1:]), mids.nextafter(values[:-1]),
                   torch.tensor([-0.0])])
    got = torch.empty(len(x), dtype=torch.uint8)
    _encode_kernel[(1,)](x, got, len(x), KV_QUANT=CODE[name], N=triton.next_power_of_2(len(x)))
    assert torch.equal(got, x.to(fp8).view(torch.uint8))


def _pools(name, nb=40, bs=4, hkv=2, d=24, poison=True):
    """Quantized pools (codes NaN for FP8, scales NaN: unused slots poisoned) and their scales."""
    quant = FORMATS[name]
    fill = 0x7F if quant.fp8 is not None and poison else 0  # 0x7F: NaN in both FP8 formats
    codes = [torch.full((nb, bs, hkv, d), fill, dtype=quant.storage) for _ in range(2)]
    scales = [torch.full((nb, bs, hkv), float("nan") if poison else 0.0,
                         dtype=torch.float16) for _ in range(2)]
    return codes, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", MODES)
def test_store_kv_quantizes_bit_for_bit_as_torch(name, dtype):
    """Random K/V over nine orders of magnitude, an all-zero head, −0, padding slots: the same codes
    and scales."""
    g = torch.Generator().manual_seed(0)
    (kc, vc), (ks, vs) = _pools(name, nb=6, hkv=3, d=40, poison=False)
    want = [t.clone() for t in (kc, vc, ks, vs)]
    n = 9
    k = (torch.randn(n, 3, 40, generator=g) * torch.logspace(-6, 3, n)[:, None, None]).to(dtype)
    v = (torch.randn(n, 3, 40, generator=g) * 3).to(dtype)
    k[0, 0], k[1, 1, :7] = 0.0, -0.0
    slots = torch.tensor([0, 5, -1, 19, 7, 8, 2, -1, 23])
    store_kv(k, v, kc, vc, slots, k_scale=ks, v_scale=vs, kv_cache_dtype=name)
    store_kv_ref(k, v, *want[:2], slots, k_scale=want[2], v_scale=want[3], kv_cache_dtype=name)
    for got, ref in zip((kc, vc, ks, vs), want):
        assert torch.equal(got, ref)
    assert torch.equal(ks.view(-1, 3)[slots[slots >= 0]], FORMATS[name].quantize(k[slots >= 0])[1])


def _quantized_context(name, lens, hkv=2, d=24, bs=4, seed=0):
    """Pools holding `lens` tokens of quantized random K/V per sequence at shuffled blocks, the rest
    poisoned; with the fp32 dequantized pools (the reference reads those) and the block tables."""
    g = torch.Generator().manual_seed(seed)
    quant = FORMATS[name]
    need = [-(-n // bs) for n in lens]
    # every table entry a distinct block: padding entries stay poisoned
    nb = len(lens) * (max(need) + 1) + 2
    (kc, vc), (ks, vs) = _pools(name, nb, bs, hkv, d)
    table = torch.randperm(nb, generator=g)[:len(lens) * (max(need) + 1)].view(len(lens), -1)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[b, pos // bs] * bs + pos % bs
        for codes, scales, outlier in ((kc, ks, 8.0), (vc, vs, 1.0)):
            x = torch.randn(n, hkv, d, generator=g) * torch.rand(n, hkv, 1, generator=g) * 2
            x[..., 3] *= outlier  # an outlier channel in K, as real models have
            c, s = quant.quantize(x)
            codes.view(-1, hkv, d)[slots], scales.view(-1, hkv)[slots] = c, s
    deq = [quant.dequantize(c, s.nan_to_num(0.0), torch.float32) for c, s in ((kc, ks), (vc, vs))]
    return (kc, vc, ks, vs), deq, table.int(), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("name", MODES)
@pytest.mark.parametrize("num_splits,window,softcap",
                         [(1, None, None), (3, None, None), (1, 6, None), (3, 5, 8.0)])
def test_paged_decode_over_a_quantized_pool_equals_the_dequantized_reference(
    name, num_splits, window, softcap
):
    (kc, vc, ks, vs), (kd, vd), table, lens = _quantized_context(name, [1, 3, 4, 5, 19])
    # GQA: 4 query heads on 2 kv heads
    q = torch.randn(5, 4, 24, generator=torch.Generator().manual_seed(1))
    got = paged_attention(q, kc, vc, table, lens, num_splits=num_splits, window=window,
                          softcap=softcap,
                          k_scale=ks, v_scale=vs, kv_cache_dtype=name)
    want = paged_attention_ref(q, kd, vd, table, lens, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", MODES)
@pytest.mark.parametrize("new_keys", [True, False])
@pytest.mark.parametrize("window", [None, 5])
def test_flash_prefill_over_a_quantized_prefix_equals_the_dequantized_reference(
    name, new_keys, window
):
    """Chunks of 3, 9 and 1 queries after their prefixes; new_keys=False is the engine's path for a
    quantized
    pool: every key, this chunk's too, read back from the pool (context_lens = prefix + chunk, no
    new keys)."""
    lens = [5, 19, 4]
    (kc, vc, ks, vs), (kd, vd), table, ctx = _quantized_context(name, lens, seed=2)
    g = torch.Generator().manual_seed(3)
    chunk = torch.tensor([3, 9, 1])
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), chunk.cumsum(0)]).int()
    q = torch.randn(int(chunk.sum()), 4, 24, generator=g)
    if new_keys:  # the prefix is what comes before each chunk; the chunk's keys come unquantized
        k = torch.randn(int(chunk.sum()), 2, 24, generator=g)
        v, cu_k, prefix = torch.randn_like(k), cu_q, ctx - chunk.int()
    else:
        k = v = torch.zeros(0, 2, 24)
        cu_k, prefix = torch.zeros_like(cu_q), ctx
    got = flash_attention(q, k, v, cu_q, cu_k, True, None, table, kc, vc, prefix, window=window,
                          k_scale=ks, v_scale=vs, kv_cache_dtype=name, block_m=4, block_n=4)
    want = flash_attention_ref(q, k, v, cu_q, cu_k, True, None, table, kd, vd, prefix,
                               window=window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_negative_control_scales_one_slot_off_are_caught():
    """The comparison above sees a scale read from the wrong slot: the reference with shifted scales
    misses."""
    (kc, vc, ks, vs), _, table, lens = _quantized_context("int8", [1, 3, 4, 5, 19])
    q = torch.randn(5, 4, 24, generator=torch.Generator().manual_seed(1))
    got = paged_attention(q, kc, vc, table, lens, k_scale=ks, v_scale=vs, kv_cache_dtype="int8")
    shifted = [FORMATS["int8"].dequantize(c, s.nan_to_num(0.0).flatten(0, 1).roll(1, 0).view_as(s),
                                          torch.float32)
               for c, s in ((kc, ks), (vc, vs))]
    assert (got - paged_attention_ref(q, *shifted, table, lens)).abs().max() > 1e-2


def test_bad_quantized_inputs_are_refused_by_name():
    (kc, vc), (ks, vs) = _pools("int8", poison=False)
    q = torch.randn(1, 4, 24)
    table = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError,
                       match="kv_cache_dtype must be one of auto, int8, fp8_e4m3, fp8_e5m2, int4, "
                             "got 'int2'"):
        paged_attention(q, kc, vc, table, lens, k_scale=ks, v_scale=vs, kv_cache_dtype="int2")
    with pytest.raises(ValueError,
                       match="kv_cache_dtype='fp8_e4m3' pools hold torch.uint8, got torch.int8"):
        paged_attention(q, kc, vc, table, lens, k_scale=ks, v_scale=vs, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match=r"v_scale must be a contiguous float16 \[40, 4, 2\]"):
        paged_attention(q, kc, vc, table, lens, k_scale=ks, v_scale=vs.float(),
                        kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="k_scale must be"):
        store_kv(torch.randn(1, 2, 24), torch.randn(1, 2, 24), kc, vc, torch.zeros(1),
                 kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="k_scale, v_scale belong to a quantized pool"):
        paged_attention(
            q, q.new_zeros(40, 4, 2, 24), q.new_zeros(40, 4, 2, 24), table, lens, k_scale=ks
        )
    with pytest.raises(ValueError, match="pools must share one of"):
        paged_attention(q, kc, vc, table, lens)  # int8 codes without kv_cache_dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", MODES)
def test_compiled_kernels_on_cuda(name):
    """Compiled, not interpreted: the codes still equal torch's bit for bit (div_rn, the rint trick
    and the fp16 bit paths survive the compiler), and bf16 decode over the pool matches the
    dequantized reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    (kc, vc), (ks, vs) = (
        tuple(t.cuda() for t in pair)
        for pair in _pools(name, nb=64, bs=16, hkv=8, d=128, poison=False)
    )
    want = [t.clone() for t in (kc, vc, ks, vs)]
    k = torch.randn(700, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16) * 3
    v = torch.randn(700, 8, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, generator=g, device="cuda")[:700]
    store_kv(k, v, kc, vc, slots, k_scale=ks, v_scale=vs, kv_cache_dtype=name)
    store_kv_ref(k, v, *want[:2], slots, k_scale=want[2], v_scale=want[3], kv_cache_dtype=name)
    for got, ref in zip((kc, vc, ks, vs), want):
        assert torch.equal(got, ref)
    table = torch.randperm(64, generator=g, device="cuda").view(4, 16).int()
    lens = torch.tensor([1, 100, 255, 256], dtype=torch.int32, device="cuda")
    q = torch.randn(4, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    kd, vd = (FORMATS[name].dequantize(c, s, torch.bfloat16) for c, s in ((kc, ks), (vc, vs)))
    for splits in (1, 4):
        got = paged_attention(q, kc, vc, table, lens, num_splits=splits, k_scale=ks, v_scale=vs,
                              kv_cache_dtype=name)
        torch.testing.assert_close(
            got.float(), paged_attention_ref(q, kd, vd, table, lens).float(), atol=2e-2, rtol=2e-2
        )
