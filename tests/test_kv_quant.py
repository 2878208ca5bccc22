"""KV-cache quantization (kv/quant.py): int8 and FP8 blocks with a scale per token and head.

Round-trip bounds from the formats' definitions, on random K/V with an outlier channel and on real
K/V of the demo model (a scale along the wrong axis, the negative control, breaks them); attention
over a quantized pool equals attention over the dequantized tensors; the pool holds ~2x (fp16) / ~4x
(fp32) the tokens in the same bytes; prefix hits, copy-on-write, preemption and speculative rollback
run unchanged."""

from __future__ import annotations

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.errors import NanoserveError
from nanoserve.kv import PagedKVCache, num_blocks_for_budget
from nanoserve.kv.quant import FORMATS, kv_quant
from nanoserve.models.layers import attention as sdpa_attention

MODES = list(FORMATS)
# the smallest normal of each FP8 format (below it values are subnormal: absolute, not relative,
# error)
MIN_NORMAL = {"fp8_e4m3": 2.0 ** -6, "fp8_e5m2": 2.0 ** -14}
# half a unit in the last place: 3 and 2 mantissa bits
REL = {"fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}


def outlier_kv(seed=0, n=400, heads=4, d=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, d, generator=g) * torch.rand(n, heads, 1, generator=g) * 8
    x[..., 5] *= 25  # an outlier channel, as K has
    return x


def check_bounds(name: str, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """The stated bounds, per element, for x [..., D] quantized to (codes, scale [...])."""
    q = FORMATS[name]
    err = (q.dequantize(codes, scale, torch.float32) - x).abs()
    s = scale.float()[..., None]
    if name == "int8":  # round to nearest: half a step; the step is the stored scale ≈ max|x| / 127
        assert (err <= 0.5 * s * (1 + 1e-3)).all() and (
            s <= x.abs().amax(-1, keepdim=True) / 127 * (1 + 1e-3) + 2.0**-14
        ).all()
    else:
        normal = x.abs() >= MIN_NORMAL[name] * s
        assert (err[normal] <= REL[name] * x.abs()[normal] * (1 + 1e-3)).all()
        assert (
            err[~normal]
            <= MIN_NORMAL[name] * 2.0 ** -(3 if name == "fp8_e4m3" else 2) * s.expand_as(x)[~normal]
            + 1e-12
        ).all()


@pytest.mark.parametrize("name", MODES)
def test_round_trip_bounds_on_random_kv_with_an_outlier_channel(name):
    x = outlier_kv()
    codes, scale = FORMATS[name].quantize(x)
    assert codes.dtype == FORMATS[name].storage and scale.shape == x.shape[:-1]
    check_bounds(name, x, codes, scale)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_negative_control_a_scale_along_the_wrong_axis_breaks_the_bounds(name):
    """One scale per (head, channel) over the tokens — the axis a paged cache cannot wait for — is
    too coarse for the tokens with small values: the per-token bound fails. (FP8 e5m2 spans 2^30 of
    range, so even this scale leaves its values normal and the relative bound holds: why a
    per-tensor FP8 scale can do.)"""
    x = outlier_kv()
    q = FORMATS[name]
    wrong = (x.abs().amax(0, keepdim=True) / q.qmax).clamp(min=2.0 ** -14)  # 1, H, D
    y = (x / wrong).clamp(-q.qmax, q.qmax)
    codes = y.round().to(torch.int8) if q.fp8 is None else y.to(q.fp8).view(torch.uint8)
    deq = (codes.view(q.fp8) if q.fp8 is not None else codes).float() * wrong  # as stored
    # the right scale, for the bound
    per_token = x.abs().amax(-1, keepdim=True).to(torch.float16).float() / q.qmax
    with pytest.raises(AssertionError):
        err = (deq - x).abs()
        if name == "int8":
            assert (err <= 0.5 * per_token * (1 + 1e-3)).all()
        else:
            normal = x.abs() >= MIN_NORMAL[name] * per_token
            assert (err[normal] <= REL[name] * x.abs()[normal] * (1 + 1e-3)).all()


def _demo_kv():
    """Real K and V of the demo model on a Shakespeare line: [T, Hkv, D] per layer, from a paged
    forward."""
    llm = LLM("demo")
    kv = llm.engine.runner.kv
    ids = llm.encode_prompt("ROMEO: But soft, what light through yonder window breaks? It is the "
                            "east.")
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    # the run used the pool's first blocks, in order (a fresh engine)
    seq_blocks = list(range(kv.num_blocks))
    out = []
    for layer in range(kv.k.shape[0]):
        k = kv.k[layer, seq_blocks].flatten(0, 1)[:len(ids)]
        v = kv.v[layer, seq_blocks].flatten(0, 1)[:len(ids)]
        out.append((k, v))
    return out


@pytest.mark.parametrize("name", MODES)
def test_round_trip_bounds_on_the_demo_models_kv(name):
    kvs = _demo_kv()
    # real activations, not the zeros of an empty pool
    assert max(k.abs().max().item() for k, _ in kvs) > 1
    for k, v in kvs:
        for x in (k, v):
            check_bounds(name, x, *FORMATS[name].quantize(x))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", MODES)
def test_attention_over_a_quantized_pool_equals_attention_over_the_dequantized_kv(name, backend):
    """Three rows of different lengths written through a view, then attention: equal (fp32, ≤ 1e-5)
    to SDPA over K/V quantized and dequantized by hand, with either backend (triton: store_kv
    quantizes, flash attention dequantizes the pool in registers)."""
    from nanoserve.models.config import ModelConfig

    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=64, n_layers=1, n_heads=4,
                      n_kv_heads=2,
                      intermediate_size=8, max_position_embeddings=64)
    cache = PagedKVCache(cfg, num_blocks=16, block_size=4, dtype=torch.float32, kv_cache_dtype=name,
                         attention_backend=backend)
    g = torch.Generator().manual_seed(1)
    B, T, lens = 3, 9, [9, 5, 7]
    q, k, v = (torch.randn(B, T, h, 16, generator=g) * 3 for h in (4, 2, 2))
    tables = torch.tensor([[0, 1, 2], [5, 6, 15], [9, 3, 4]])
    slots = torch.tensor(
        [[tables[b, t // 4] * 4 + t % 4 if t < lens[b] else -1 for t in range(T)] for b in range(B)]
    )
    positions = torch.arange(T).expand(B, T)
    view = cache.view(slots, tables, torch.tensor(lens))
    got = view.attention(0, q, k, v, positions)
    quant = FORMATS[name]
    deq = [quant.dequantize(*quant.quantize(x), torch.float32) for x in (k, v)]  # B, T, Hkv, D
    for b in range(B):
        n = lens[b]
        want = sdpa_attention(q[b:b + 1, :n], deq[0][b:b + 1, :n], deq[1][b:b + 1, :n],
                              positions[b:b + 1, :n])
        torch.testing.assert_close(got[b:b + 1, :n], want, atol=1e-5, rtol=0)


def test_the_same_bytes_hold_about_twice_the_tokens_of_fp16_and_four_times_fp32():
    from nanoserve.models.loader import load_model

    _, cfg, _ = load_model("demo")
    budget = 64 * 2**20
    fp16 = num_blocks_for_budget(cfg, budget, 16, torch.float16)
    fp32 = num_blocks_for_budget(cfg, budget, 16, torch.float32)
    for name in MODES:
        n = num_blocks_for_budget(cfg, budget, 16, torch.float16, name)
        assert 1.9 <= n / fp16 <= 2.0 and 3.8 <= n / fp32 <= 4.0, (name, n, fp16, fp32)
    cache = PagedKVCache(cfg, 100, 16, torch.float32, kv_cache_dtype="int8")
    # codes + fp16 scales
    assert cache.nbytes == 2 * 100 * 16 * cfg.n_layers * cfg.n_kv_heads * (cfg.head_dim + 2)


@pytest.mark.parametrize("name", MODES)
def test_prefix_hits_copy_on_write_and_preemption_on_a_quantized_pool(name):
    """Codes depend on each token alone (its own scale), so reusing cached blocks (a prefix hit),
    copying them (n = 2 forks), or recomputing them after preemption gives the tokens a fresh run
    gives."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = "JULIET: O Romeo, Romeo! wherefore art thou Romeo? Deny thy father"
    big = LLM("demo", kv_cache_dtype=name)
    want = big.generate([prompt], params)[0].token_ids
    again = big.generate([prompt], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == want  # prefix hit
    forked = big.generate([prompt],
                          SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2))[0]
    # copy-on-write of the shared last block
    assert [c.token_ids for c in forked.outputs] == [want, want]
    small = LLM("demo", kv_cache_dtype=name, num_blocks=20, block_size=8,
                enable_prefix_caching=False)
    outs = small.generate([prompt] * 3, params)
    assert small.engine.scheduler.num_preemptions > 0, "the pool must be small enough to preempt"
    assert all(o.token_ids == want for o in outs)


def test_speculative_decoding_on_a_quantized_pool():
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM("demo", kv_cache_dtype="int8").generate(["ROMEO:"], params)[0]
    spec = LLM("demo", kv_cache_dtype="int8", speculative_model="demo-draft",
               # pinned: speculates on any machine
               speculative_cost=0.1).generate(["ROMEO:"], params)[0]
    assert spec.token_ids == plain.token_ids and spec.outputs[0].spec_stats.num_accepted_tokens > 0


def test_bad_settings_are_refused_by_name():
    with pytest.raises(NanoserveError,
                       match="kv_cache_dtype='int2'; allowed: auto, int8, fp8_e4m3, fp8_e5m2, "
                             "int4"):
        LLM("demo", kv_cache_dtype="int2")
    assert kv_quant("auto") is None


def test_the_server_and_the_cli_take_kv_cache_dtype():
    pytest.importorskip("fastapi")
    from live_server import LiveServer, _post

    from nanoserve.cli import build_parser
    from nanoserve.engine import LLMEngine
    from nanoserve.serving.async_engine import AsyncLLMEngine
    from nanoserve.serving.server import create_app

    assert build_parser().parse_args(["serve", "--kv-cache-dtype",
                                      "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    assert build_parser().parse_args(["generate", "--prompt", "x"]).kv_cache_dtype == "auto"
    core = LLMEngine.from_kwargs("demo", kv_cache_dtype="int8")
    want = LLM("demo", kv_cache_dtype="int8").generate(
        ["ROMEO:"], SamplingParams(temperature=0, max_tokens=12)
    )[0]
    srv = LiveServer(create_app(AsyncLLMEngine(core), "demo"))
    try:
        status, _, body = _post(srv.port, "/v1/completions",
                                {"model": "demo", "prompt": "ROMEO:", "max_tokens": 12,
                                                               "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == want.text
    finally:
        srv.stop()
