"""int4 KV cache (kv/quant.py `KVQuantInt4`, kernels/kv_quant.py INT4): two codes a byte, a scale
and a minimum per group of 64 values along head_dim.

The oracle for the bits is `reference_quantize` below, written here from the format's definition one
group at a time (Python's round-half-even on each value, the nibbles packed by arithmetic): the
package's torch quantizer and `store_kv`'s kernel must give its bytes and fp16 scales exactly, edge
cases included (an all-zero group, one huge outlier, negative values, −0, head_dims with groups of
32 and 8). Attention over an int4 pool — the torch backend, the CPU backend (which serves a
quantized pool through the torch path) and the Triton kernels in the interpreter (paged decode with
split-KV, window and soft-cap; flash prefill over a paged prefix) — must equal fp32 attention over
the reference's dequantized K/V (≤ 1e-5). Negative controls: the same comparison with the nibbles
read in the other order, or scale and minimum swapped, misses by far. The engine generates on the
demo model with prompt logprobs within a stated bound of the fp32 cache's, and one `kv_cache_memory`
holds ≥ 3.5× the blocks of bf16.
"""

from __future__ import annotations

import pytest
import torch
from nanoserve.kernels.flash_attention import flash_attention, flash_attention_ref
from nanoserve.kernels.paged_attention import paged_attention, paged_attention_ref
from nanoserve.kernels.store_kv import store_kv, store_kv_ref

from nanoserve import LLM, SamplingParams
from nanoserve.errors import NanoserveError
from nanoserve.kv import PagedKVCache, kv_bytes_per_token, num_blocks_for_budget
from nanoserve.kv.quant import INT4, kv_element_bytes, kv_quant
from nanoserve.models.config import ModelConfig
from nanoserve.models.layers import attention as sdpa_attention


# ----------------------------------------------------------------------------- the oracle
def reference_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (bytes [..., D/2], fp16 scales [..., 2·D/group]), one group at a time, in fp32:
    m = fp16(min), s = fp16(max((max − m) / 15, 2⁻¹⁴)), code = round-half-even((x − m) / s) clamped
    to 0..15, byte j = code(2j) + 16 · code(2j + 1); the scales hold s, m for each group in turn."""
    rows = x.float().reshape(-1, x.shape[-1])
    D = rows.shape[1]
    packed = torch.zeros(rows.shape[0], D // 2, dtype=torch.uint8)
    scales = torch.zeros(rows.shape[0], 2 * (D // group), dtype=torch.float16)
    for r in range(rows.shape[0]):
        codes = []
        for g in range(D // group):
            values = rows[r, g * group:(g + 1) * group]
            m = values.min().to(torch.float16)
            s = ((values.max() - m.float()) / 15).clamp(min=2.0 ** -14).to(torch.float16)
            scales[r, 2 * g], scales[r, 2 * g + 1] = s, m
            y = (values - m.float()) / s.float()  # fp32, as torch and div_rn divide
            codes += [min(max(round(v), 0), 15) for v in y.tolist()]
        packed[r] = torch.tensor([lo + 16 * hi for lo, hi in zip(codes[0::2], codes[1::2])])
    return packed.view(*x.shape[:-1], D // 2), scales.view(*x.shape[:-1], 2 * (D // group))


def reference_dequantize(packed: torch.Tensor, scales: torch.Tensor,
                         swap_nibbles: bool = False) -> torch.Tensor:
    """bytes [..., D/2], scales [..., 2·D/group] -> code · s + m in fp32 [..., D]. swap_nibbles: the
    wrong order (a negative control)."""
    low, high = (packed & 15).long(), (packed >> 4).long()
    if swap_nibbles:
        low, high = high, low
    codes = torch.stack((low, high), -1).flatten(-2).float()  # ..., D
    group = 2 * codes.shape[-1] // scales.shape[-1]
    s = scales[..., 0::2].float().repeat_interleave(group, -1)  # ..., D
    m = scales[..., 1::2].float().repeat_interleave(group, -1)
    return codes * s + m


def edge_case_kv(n=6, heads=3, d=64, seed=0):
    """Random K/V with an all-zero group, a group with one huge outlier, all-negative values, −0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, d, generator=g) * torch.logspace(-3, 2, n)[:, None, None]
    x[0, 0] = 0.0  # all-zero groups: scale 2⁻¹⁴, minimum 0, every code 0
    x[1, 1, d - 3] = 1e4  # one outlier: its group's others round to 0; other groups are spared
    x[2, 2] = -x[2, 2].abs()  # negative values only
    x[3, 0, :5] = -0.0
    return x


# ----------------------------------------------------------------------------- the bits
@pytest.mark.parametrize("d,group", [(64, 64), (128, 64), (96, 32), (40, 8), (8, 8)])
def test_quantize_matches_the_reference_bit_for_bit_with_edge_cases(d, group):
    x = edge_case_kv(d=d)
    assert INT4.group(d) == group
    packed, scales = INT4.quantize(x)
    want_packed, want_scales = reference_quantize(x, group)
    assert packed.dtype == torch.uint8 and packed.shape == (*x.shape[:-1], d // 2)
    assert torch.equal(packed, want_packed) and torch.equal(scales, want_scales)
    deq = INT4.dequantize(packed, scales, torch.float32)
    assert torch.equal(deq, reference_dequantize(packed, scales))
    # round to nearest: within half a step, plus what fp16 rounding of s and m moves the ends by
    step = scales[..., 0::2].float().repeat_interleave(group, -1)
    low = scales[..., 1::2].float().repeat_interleave(group, -1)
    bound = 0.5 * step * (1 + 1e-3) + 15 * step * 2.0 ** -11 + low.abs() * 2.0 ** -11
    assert ((deq - x).abs() <= bound).all()


def test_edge_cases_decode_as_the_format_says():
    x = edge_case_kv()
    x[1, 1, 10] = 1e4  # an outlier in the first group of a head
    x = torch.cat([x, x[..., :32] * 0.01], -1)  # head_dim 96: groups of 32, the last ones small
    packed, scales = INT4.quantize(x)
    assert scales[0, 0].tolist() == [2.0 ** -14, 0.0] * 3 and (packed[0, 0] == 0).all()
    deq = INT4.dequantize(packed, scales, torch.float32)
    assert deq[0, 0].eq(0).all()  # the zero groups come back exactly
    assert deq[1, 1, 10] == pytest.approx(1e4, rel=2e-3)  # the outlier itself survives
    rest = torch.cat([packed[1, 1, :5], packed[1, 1, 6:16]])  # its group's other codes: 0 or 1
    assert ((rest & 15) <= 1).all() and ((rest >> 4) <= 1).all()
    # the head's other groups keep their own scales: within half their own step
    assert ((deq[1, 1, 32:] - x[1, 1, 32:]).abs() <= scales[1, 1, 2::2].float().repeat_interleave(
        32) * 0.51).all()
    assert ((deq[2, 2] - x[2, 2]).abs() <= scales[2, 2, 0::2].float().repeat_interleave(
        32) * 0.51).all()  # negative values only


def test_negative_control_the_reference_catches_a_wrong_nibble_order():
    x = edge_case_kv()
    packed, scales = INT4.quantize(x)
    right = reference_dequantize(packed, scales)
    wrong = reference_dequantize(packed, scales, swap_nibbles=True)
    assert (right - wrong).abs().max() > 1.0


@pytest.mark.parametrize("d", [64, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_writes_the_references_bytes_and_scales(dtype, d):
    """The kernel (interpreter) and store_kv_ref write exactly the reference's bytes and scales
    into the slots; padding slots (−1) and untouched slots keep their fill."""
    g = torch.Generator().manual_seed(0)
    nb, bs, hkv, n = 6, 4, 3, 9
    group = INT4.group(d)
    kc, vc = (torch.full((nb, bs, hkv, d // 2), 0x5A, dtype=torch.uint8) for _ in range(2))
    ks, vs = (torch.full((nb, bs, hkv, 2 * d // group), 7.0, dtype=torch.float16)
              for _ in range(2))
    want = [t.clone() for t in (kc, vc, ks, vs)]
    k = (edge_case_kv(n, hkv, d, seed=1)).to(dtype)
    v = (torch.randn(n, hkv, d, generator=g) * 3).to(dtype)
    slots = torch.tensor([0, 5, -1, 19, 7, 8, 2, -1, 23])
    store_kv(k, v, kc, vc, slots, k_scale=ks, v_scale=vs, kv_cache_dtype="int4")
    store_kv_ref(k, v, *want[:2], slots, k_scale=want[2], v_scale=want[3], kv_cache_dtype="int4")
    for got, ref in zip((kc, vc, ks, vs), want):
        assert torch.equal(got, ref)
    real = slots >= 0
    for x, codes, scales in ((k, kc, ks), (v, vc, vs)):
        ref_codes, ref_scales = reference_quantize(x[real], group)
        assert torch.equal(codes.view(-1, hkv, d // 2)[slots[real]], ref_codes)
        assert torch.equal(scales.view(-1, hkv, 2 * d // group)[slots[real]], ref_scales)
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[real]] = False
    assert (kc.view(nb * bs, -1)[untouched] == 0x5A).all()


# ----------------------------------------------------------------------------- the kernels
def _int4_context(lens, hkv=2, d=64, bs=4, seed=0):
    """Pools holding `lens` tokens of int4 random K/V per sequence at shuffled blocks, unused
    scales NaN (a read past a context shows); the reference's fp32 dequantized pools; tables."""
    g = torch.Generator().manual_seed(seed)
    group = INT4.group(d)
    need = [-(-n // bs) for n in lens]
    nb = len(lens) * (max(need) + 1) + 2
    kc, vc = (torch.zeros(nb, bs, hkv, d // 2, dtype=torch.uint8) for _ in range(2))
    ks, vs = (torch.full((nb, bs, hkv, 2 * d // group), float("nan"), dtype=torch.float16)
              for _ in range(2))
    table = torch.randperm(nb, generator=g)[:len(lens) * (max(need) + 1)].view(len(lens), -1)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[b, pos // bs] * bs + pos % bs
        for codes, scales, outlier in ((kc, ks, 8.0), (vc, vs, 1.0)):
            x = torch.randn(n, hkv, d, generator=g) * torch.rand(n, hkv, 1, generator=g) * 2
            x[..., 3] *= outlier  # an outlier channel in K, as real models have
            c, s = reference_quantize(x, group)
            codes.view(-1, hkv, d // 2)[slots] = c
            scales.view(-1, hkv, 2 * d // group)[slots] = s
    pools = (kc, vc, ks, vs)
    return pools, table.int(), torch.tensor(lens, dtype=torch.int32)


def _dequantized(pools, **wrong):
    kc, vc, ks, vs = pools
    return [reference_dequantize(c, s.nan_to_num(0.0), **wrong) for c, s in ((kc, ks), (vc, vs))]


@pytest.mark.parametrize("d", [64, 40])
@pytest.mark.parametrize("num_splits,window,softcap",
                         [(1, None, None), (3, None, None), (1, 6, None), (3, 5, 8.0)])
def test_paged_decode_over_an_int4_pool_equals_the_dequantized_reference(
    num_splits, window, softcap, d
):
    pools, table, lens = _int4_context([1, 3, 4, 5, 19], d=d)
    q = torch.randn(5, 4, d, generator=torch.Generator().manual_seed(1))  # GQA: 4 on 2 kv heads
    kc, vc, ks, vs = pools
    got = paged_attention(q, kc, vc, table, lens, num_splits=num_splits, window=window,
                          softcap=softcap, k_scale=ks, v_scale=vs, kv_cache_dtype="int4")
    want = paged_attention_ref(q, *_dequantized(pools), table, lens, window=window,
                               softcap=softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("new_keys", [True, False])
@pytest.mark.parametrize("window", [None, 5])
def test_flash_prefill_over_an_int4_prefix_equals_the_dequantized_reference(new_keys, window):
    """Chunks of 3, 9 and 1 queries after their prefixes; new_keys=False is the engine's path for a
    quantized pool (every key read back from the pool)."""
    lens = [5, 19, 4]
    pools, table, ctx = _int4_context(lens, seed=2)
    kc, vc, ks, vs = pools
    g = torch.Generator().manual_seed(3)
    chunk = torch.tensor([3, 9, 1])
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), chunk.cumsum(0)]).int()
    q = torch.randn(int(chunk.sum()), 4, 64, generator=g)
    if new_keys:
        k = torch.randn(int(chunk.sum()), 2, 64, generator=g)
        v, cu_k, prefix = torch.randn_like(k), cu_q, ctx - chunk.int()
    else:
        k = v = torch.zeros(0, 2, 64)
        cu_k, prefix = torch.zeros_like(cu_q), ctx
    got = flash_attention(q, k, v, cu_q, cu_k, True, None, table, kc, vc, prefix, window=window,
                          k_scale=ks, v_scale=vs, kv_cache_dtype="int4", block_m=4, block_n=4)
    want = flash_attention_ref(q, k, v, cu_q, cu_k, True, None, table, *_dequantized(pools),
                               prefix, window=window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_negative_controls_wrong_nibble_order_or_scale_and_minimum_swapped_miss():
    pools, table, lens = _int4_context([1, 3, 4, 5, 19])
    kc, vc, ks, vs = pools
    q = torch.randn(5, 4, 64, generator=torch.Generator().manual_seed(1))
    got = paged_attention(q, kc, vc, table, lens, k_scale=ks, v_scale=vs, kv_cache_dtype="int4")
    right = paged_attention_ref(q, *_dequantized(pools), table, lens)
    swapped = paged_attention_ref(q, *_dequantized(pools, swap_nibbles=True), table, lens)
    swapped_pairs = (kc, vc, *(s.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) for s in (ks, vs)))
    off = paged_attention_ref(q, *_dequantized(swapped_pairs), table, lens)
    assert (got - right).abs().max() <= 1e-5
    assert (got - swapped).abs().max() > 1e-2 and (got - off).abs().max() > 1e-2


# ----------------------------------------------------------------------------- the backends
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_each_backend_over_an_int4_pool_equals_attention_over_the_dequantized_kv(backend):
    """Three rows written through a view, then attention (fp32, ≤ 1e-5 against SDPA over the
    reference's dequantized K/V): torch gathers and dequantizes, cpu serves a quantized pool through
    the torch path, triton quantizes in store_kv and dequantizes in the flash kernel."""
    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=128, n_layers=1, n_heads=4,
                      n_kv_heads=2, intermediate_size=8, max_position_embeddings=64)
    cache = PagedKVCache(cfg, num_blocks=16, block_size=4, dtype=torch.float32,
                         kv_cache_dtype="int4", attention_backend=backend)
    assert cache.k.shape[-1] == 16 and cache.k_scale.shape[-1] == 2  # D = 32: one group
    g = torch.Generator().manual_seed(1)
    B, T, lens = 3, 9, [9, 5, 7]
    q, k, v = (torch.randn(B, T, h, 32, generator=g) * 3 for h in (4, 2, 2))
    tables = torch.tensor([[0, 1, 2], [5, 6, 15], [9, 3, 4]])
    slots = torch.tensor(
        [[tables[b, t // 4] * 4 + t % 4 if t < lens[b] else -1 for t in range(T)] for b in range(B)]
    )
    positions = torch.arange(T).expand(B, T)
    got = cache.view(slots, tables, torch.tensor(lens)).attention(0, q, k, v, positions)
    deq = [reference_dequantize(*reference_quantize(x, 32)) for x in (k, v)]  # B, T, Hkv, D
    for b in range(B):
        n = lens[b]
        want = sdpa_attention(q[b:b + 1, :n], deq[0][b:b + 1, :n], deq[1][b:b + 1, :n],
                              positions[b:b + 1, :n])
        torch.testing.assert_close(got[b:b + 1, :n], want, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- the engine
# Measured (prompt logprobs of the demo, fp32 model, these 4 Shakespeare lines, 2026-11-29): mean
# |Δ logprob| vs the fp32 cache 0.057, max 0.72 (int8: 0.0041, 0.054); the bounds leave ~2x room.
MEAN_BOUND = 0.1
MAX_BOUND = 1.5


def _prompt_logprobs(llm, texts):
    out = []
    for text in texts:
        ids = llm.encode_prompt(text)
        res = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        out += [res.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    return torch.tensor(out)


def test_the_engine_generates_on_an_int4_cache_within_a_bound_of_fp32():
    texts = ["ROMEO: But soft, what light through yonder window breaks? It is the east, and",
             "JULIET: O Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse",
             "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak.",
             "KING RICHARD III: Now is the winter of our discontent made glorious summer by"]
    kw = dict(dtype="float32", max_num_batched_tokens=16)  # chunks: most keys come from the pool
    full = _prompt_logprobs(LLM("demo", kv_cache_dtype="auto", **kw), texts)
    int4 = LLM("demo", kv_cache_dtype="int4", **kw)
    assert int4.engine.runner.kv.k.dtype == torch.uint8
    got = _prompt_logprobs(int4, texts)
    diff = (got - full).abs()
    assert diff.mean() <= MEAN_BOUND and diff.max() <= MAX_BOUND, (diff.mean(), diff.max())
    assert diff.max() > 0  # the cache really is quantized
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert len(int4.generate(["ROMEO:"], params)[0].token_ids) == 24


def test_one_kv_cache_memory_holds_at_least_3_5x_the_bf16_blocks():
    from nanoserve.models.loader import load_model

    _, cfg, _ = load_model("demo")  # head_dim 64: one group, 4.5 bits a value
    budget = 64 * 2**20
    bf16 = num_blocks_for_budget(cfg, budget, 16, torch.bfloat16)
    int4 = num_blocks_for_budget(cfg, budget, 16, torch.bfloat16, "int4")
    int8 = num_blocks_for_budget(cfg, budget, 16, torch.bfloat16, "int8")
    assert int4 / bf16 >= 3.5 and int4 / int8 >= 1.8, (int4, int8, bf16)
    cache = PagedKVCache(cfg, 100, 16, torch.float32, kv_cache_dtype="int4")
    values = 2 * 100 * 16 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    assert cache.nbytes == values // 2 + values // 64 * 4  # half a byte + 4 bytes a group
    # the sizing counts what is allocated
    assert cache.nbytes == 100 * 16 * kv_bytes_per_token(cfg, torch.bfloat16, "int4")


def test_bad_int4_settings_are_refused_by_name():
    for refused in (lambda: INT4.pool_shapes((4, 4, 2, 7)), lambda: kv_element_bytes("int4", 7)):
        with pytest.raises(NanoserveError, match="kv_cache_dtype='int4' packs two values per "
                                                 "byte: head_dim must be even, got 7"):
            refused()
    assert kv_quant("int4") is INT4
    kc = torch.zeros(4, 4, 2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"k_scale must be a contiguous float16 \[4, 4, 2, 2\]"):
        store_kv(torch.randn(1, 2, 64), torch.randn(1, 2, 64), kc, kc.clone(), torch.zeros(1),
                 k_scale=torch.zeros(4, 4, 2, dtype=torch.float16),
                 v_scale=torch.zeros(4, 4, 2, dtype=torch.float16), kv_cache_dtype="int4")
