"""Figures a-d, i, k and l of `gpu_check.py`: the GPU tests, and the Triton kernels against their
torch peers.

b and c are benchmarks/bench_attention.py's measurements, called as they are (its `--smoke` shapes
in a dry run); d is the W4A16 kernel against fp16 cuBLAS on the same (dequantized) weights; i is
RMSNorm as one kernel against the torch module it replaces on the triton path (issue 43); k is a
2:4-pruned weight on sparse tensor cores (torch's semi-structured tensors) against the same weight
dense (issue 48); l is MLA's decode kernel over the latent pool against the ordinary paged decode
kernel over the caches the same attention would need without it (expanded heads, GQA-8), and the
cost of attention sinks in the latter.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]

TABLES = {
    "a": [("pytest -m gpu", "summary",
           ["passed", "failed", "errors", "skipped", "collection_errors", "returncode"])],
    "b": [("prefill: flash_attention vs SDPA (flash backend), causal, TFLOP/s", "rows",
           ["dtype", "d", "N", "batch", "heads", "ours_tflops", "sdpa_tflops", "ratio"])],
    "c": [("decode: paged (shuffled blocks) vs contiguous, same kernel", "paged_decode",
           ["context", "batch", "contiguous_ms", "paged_ms", "ratio"]),
          ("batch-1 decode, split-KV", "split_kv",
           ["context", "num_splits", "split_ms", "one_split_ms",
                                                    "growth_vs_first"]),
          ("decode over 8-bit KV pools vs bf16", "kv8_decode",
           ["context", "bf16_ms", "int8_ms", "fp8_e4m3_ms",
                                                                "int8_speedup",
            "fp8_e4m3_speedup"])],
    "d": [("W4A16 (group 128) vs fp16 cuBLAS, microseconds", "rows",
           ["K", "N", "M", "cublas_fp16_us", "w4a16_us", "kernel", "split_k", "gemm_kernel_us",
            "dot_gemv_us", "act_order_us",
            "speedup_vs_fp16", "w4a16_tbps"])],
    "i": [("RMSNorm: one kernel vs the torch module (six launches), microseconds", "rows",
           ["dtype", "rows", "width", "torch_us", "kernel_us", "speedup", "max_abs_diff"])],
    "k": [("2:4 weights: semi-structured sparse vs dense F.linear, microseconds", "rows",
           ["N", "K", "M", "dense_us", "sparse_us", "speedup", "max_abs_diff", "problem"])],
    "l": [("decode over the KV cache, microseconds: mla_decode over the latent pool (r 512 + "
           "rope 64) vs paged_attention over mha (H KV heads of head_dim 128, standing in for the "
           "expanded MLA's keys of 192 and values of 128) and gqa8 (8 heads a KV head, d 128)",
           "rows", ["heads", "batch", "context", "mla_us", "mha_us", "gqa8_us", "mla_vs_mha",
                    "mla_vs_gqa8"]),
          ("cache bytes read per call (MB, each counted once) and GB/s achieved", "rows",
           ["heads", "batch", "context", "mla_mb", "mha_mb", "gqa8_mb", "mla_gbps", "mha_gbps",
            "gqa8_gbps"]),
          ("checks before timing: relative error against the torch references, first 64 keys",
           "rows", ["heads", "batch", "context", "mla_rel_error", "mha_rel_error",
                    "gqa8_rel_error"]),
          ("attention sinks: paged_attention with and without sinks=, microseconds", "sinks",
           ["heads", "kv_heads", "head_dim", "batch", "context", "plain_us", "sinks_us",
            "overhead_pct", "sinks_rel_error"])],
}


def fig_pytest_gpu(ctx) -> dict:
    """a. `pytest -m gpu` in a subprocess; pass / fail counts from its JUnit XML."""
    # dry: CPU, every GPU test skips anyway
    paths = ["tests/test_kernels_paged.py"] if ctx.dry else ["tests"]
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        # a test module that cannot be imported (an optional package missing from the image) must
        # not stop the rest with pytest-xdist, 4 workers: the tests compile their kernels in
        # parallel (one GPU serves them all)
        workers = ["-n", "4"] if ctx.device == "cuda" and importlib.util.find_spec("xdist") else []
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}",
               "--continue-on-collection-errors", *workers, *paths]
        env = dict(os.environ)
        if ctx.device == "cuda":
            # tests/conftest.py sets TRITON_INTERPRET=1 unless it is set: on a GPU the kernels must
            # compile
            env["TRITON_INTERPRET"] = "0"
        res = {"command": ("TRITON_INTERPRET=0 " if ctx.device == "cuda" else "")
                   + f"pytest -m gpu {' '.join(workers + paths)}",
               "summary": []}
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=max(10.0, ctx.left()))
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"pytest -m gpu ran past its budget of {ctx.budget:.0f} s") from e
        res["output_tail"] = (proc.stdout + proc.stderr)[-3000:]
        if not xml.is_file():
            hint = (
                " (is pytest installed? pip install pytest)"
                if "No module named pytest" in proc.stderr else ""
            )
            raise RuntimeError(f"pytest exited with {proc.returncode} and wrote no report{hint}: "
                               f"{(proc.stdout + proc.stderr)[-500:]}")
        root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    bad = {"failed": [], "errors": [], "collection_errors": []}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None:
            bad["failed"].append(name)
        elif (err := case.find("error")) is not None:
            bad[
                "collection_errors" if "collection failure" in (err.get("message") or "")
                else "errors"
            ].append(name)
    res["summary"] = [
        {
            "passed": count["tests"] - count["failures"] - count["errors"] - count["skipped"],
            "failed": len(bad["failed"]), "errors": len(bad["errors"]), "skipped": count["skipped"],
            "collection_errors": len(bad["collection_errors"]), "returncode": proc.returncode,
        }
    ]
    res.update({f"{k}_tests": v for k, v in bad.items()})
    # a module that could not be imported (listed) is the image's missing package, not a failed GPU
    # test; on a GPU the GPU tests must run (skipped ones there would mean they did not see the
    # device)
    ran = res["summary"][0]["passed"] + (count["skipped"] if ctx.device != "cuda" else 0)
    res["ok"] = not bad["failed"] and not bad["errors"] and ran > 0
    return res


def _attention_args(ctx):
    import bench_attention

    gen = torch.Generator(device=ctx.device).manual_seed(0)
    return bench_attention, SimpleNamespace(smoke=ctx.dry), gen


def fig_flash_prefill(ctx) -> dict:
    """b. bench_attention.prefill: N 1k-8k, d 64 / 128, fp16 / bf16, 16k tokens per launch, 2048 / d
    heads."""
    ba, args, gen = _attention_args(ctx)
    rows = ba.prefill(args, ctx.device, gen)
    ratios = sorted(r["ratio"] for r in rows)
    return {"goal": "flash_attention / SDPA-flash TFLOP/s >= 0.9", "rows": rows,
            "min_ratio": ratios[0], "median_ratio": ratios[len(ratios) // 2],
            "note": "TFLOP/s counts the causal half: 4 B H N^2 d / 2; median of "
                    "triton.testing.do_bench"}


def fig_paged_decode(ctx) -> dict:
    """c. bench_attention.paged_vs_contiguous (batch 32, 32/8 heads, d 128, bf16, 1k-8k), split_kv
    (1k-32k) and kv8_decode (the shape of paged_vs_contiguous over int8 / fp8_e4m3 pools)."""
    ba, args, gen = _attention_args(ctx)
    res = {"goals": "paged / contiguous <= 1.2x; split-KV latency growth 1k -> 32k <= 2x; "
                    "8-bit KV decode >= 1.3x bf16 at 8k"}
    ctx.save(res)
    res["paged_decode"] = ba.paged_vs_contiguous(args, ctx.device, gen)
    ctx.save(res)
    if ctx.over():
        res["truncated"] = "budget spent before the split-KV sweep"
        return res
    res["split_kv"] = ba.split_kv(args, ctx.device, gen)
    res["max_paged_ratio"] = max(r["ratio"] for r in res["paged_decode"])
    res["growth_to_longest"] = res["split_kv"][-1]["growth_vs_first"]
    ctx.save(res)
    if ctx.over():
        res["truncated"] = "budget spent before the 8-bit KV sweep"
        return res
    # issue 23: half the bytes read per decode step
    res["kv8_decode"] = ba.kv8_decode(args, ctx.device, gen)
    res["kv8_speedup_longest"] = min(
        res["kv8_decode"][-1][f"{n}_speedup"] for n in ("int8", "fp8_e4m3")
    )
    return res


def _random_gptq(K: int, N: int, group: int, device: str, seed: int):
    """Random weights quantized with RTN (symmetric 4-bit) and packed as GPTQ v1; and the same
    weights dequantized to fp16 for cuBLAS, so both sides multiply the same numbers."""
    from nanoserve.quant.packing import pack_gptq
    from nanoserve.quant.rtn import quantize_rtn

    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(N, K, generator=g, device=device) * 0.02  # N, K
    qw = quantize_rtn(w, bits=4, group_size=group)
    packed = pack_gptq(qw.codes, qw.zeros, qw.scales, qw.g_idx, 4)
    return packed, qw.dequantize().to(torch.float16)  # W [N, K] for F.linear


def fig_w4a16(ctx) -> dict:
    """d. GEMV (M <= 16, split-K) and GEMM kernels vs fp16 cuBLAS; 4096^2 and 8192^2, group 128. The
    weights have sorted groups (no act-order), so the kernels take the grouped path, as QuantLinear
    calls them; act_order_us times the row-by-row gather path on the same weights."""
    import torch.nn.functional as F
    from bench_attention import bench
    from nanoserve.kernels import dequant_matmul as dm
    from nanoserve.kernels.dequant_matmul import choose_split_k, dequant_gemm, dequant_matmul

    fma_max_m = getattr(dm, "FMA_MAX_M", 0)  # M <= this: the GEMV by multiply-adds
    try:  # codes in the MMA layout (issue 43): absent from older checkouts
        from nanoserve.kernels.int4_tiles import to_mma_layout
    except ImportError:
        to_mma_layout = None

    shapes = [(128, 128)] if ctx.dry else [(4096, 4096), (8192, 8192)]
    small_m = [1] if ctx.dry else [1, 2, 4, 8, 16]
    large_m = [32] if ctx.dry else [64, 256, 1024]
    group = 128
    # the interpreter: fp32 keeps the dry run quick and exact
    dtype = torch.float32 if ctx.dry else torch.float16
    from gpu_check_models import peak_bandwidth

    peak = (
        peak_bandwidth(torch.cuda.get_device_name()) if ctx.device == "cuda" else (None, "dry run")
    )
    res = {"group_size": group, "activation_dtype": str(dtype).removeprefix("torch."), "rows": [],
           "peak_tbps": peak[0], "peak_source": peak[1],
           "note": "w4a16_us: dequant_matmul as the engine calls it (M <= 16: split-K GEMV; 16 < "
                   "M < 64: the GEMM kernel; M >= 64 on CUDA: dequantize + cuBLAS), with "
                   "group_size=128 (the grouped path); act_order_us: the same call through the "
                   "act-order (row-by-row gather) path; gemm_kernel_us: the tiled GEMM kernel "
                   "alone; dot_gemv_us (M <= FMA_MAX_M): the GEMV through tl.dot over 16 rows "
                   "instead of its multiply-adds; mma_us: dequant_matmul with the codes in the "
                   "MMA layout (kernels/int4_tiles.py), as QuantLinear holds them on a GPU; "
                   "w4a16_tbps: bytes of packed weights + scales + zeros + activations / time"}
    for K, N in shapes:
        if ctx.over():
            res["truncated"] = f"budget spent before {K}x{N}"
            break
        packed, w16 = _random_gptq(K, N, group, ctx.device, seed=K)
        mma = None if to_mma_layout is None else {**packed,
                                                  "qweight": to_mma_layout(packed["qweight"])}
        wbytes = sum(v.numel() * v.element_size() for v in packed.values())
        for M in small_m + large_m:
            a = (torch.randn(M, K, device=ctx.device) * 0.5).to(dtype)
            w = w16.to(dtype)
            ref = bench(lambda: F.linear(a, w), ctx.dry)  # noqa: B023
            ours = bench(lambda: dequant_matmul(a, **packed, group_size=group), ctx.dry)  # noqa: B023
            gather = bench(lambda: dequant_matmul(a, **packed), ctx.dry)  # noqa: B023
            gemm = bench(lambda: dequant_gemm(a, **packed, group_size=group), ctx.dry)  # noqa: B023
            dot = None
            if M <= fma_max_m:  # the same GEMV through tl.dot: what the multiply-adds replace
                dot = 1e3 * bench(lambda: dm.dequant_gemv(a, **packed, group_size=group,  # noqa: B023
                                                          fma=False), ctx.dry)
            mma_us = mma_err = None
            want = F.linear(a, w).float()
            if mma is not None:
                mma_us = 1e3 * bench(lambda: dequant_matmul(a, **mma, group_size=group,  # noqa: B023
                                                            mma_layout=True), ctx.dry)
                got = dequant_matmul(a, **mma, group_size=group, mma_layout=True).float()
                mma_err = float((got - want).norm() / want.norm())
            err = (dequant_matmul(a, **packed,
                                  group_size=group).float() - want).norm() / want.norm()
            kernel = (
                "gemv" if M <= 16 else ("torch" if M >= 64 and ctx.device == "cuda" else "gemm")
            )
            if M <= fma_max_m:
                kernel = "gemv fma"
            res["rows"].append(dict(K=K, N=N, M=M, cublas_fp16_us=1e3 * ref, w4a16_us=1e3 * ours,
                                    kernel=kernel,
                                    act_order_us=1e3 * gather,
                                    split_k=choose_split_k(N, K) if M <= 16 else None,
                                    gemm_kernel_us=1e3 * gemm, dot_gemv_us=dot, mma_us=mma_us,
                                    mma_rel_error=mma_err,
                                    speedup_vs_fp16=ref / ours, rel_error=float(err),
                                    w4a16_tbps=(wbytes + a.numel() * a.element_size()) / (ours * 1e-3) / 1e12))
            ctx.save(res)
    gemv = [r["speedup_vs_fp16"] for r in res["rows"] if r["M"] == 1]
    res["batch1_speedup"] = gemv
    res["batch1_mma_speedup"] = [r["cublas_fp16_us"] / r["mma_us"] for r in res["rows"]
                                 if r["M"] == 1 and r["mma_us"]]
    return res


def fig_rms_norm(ctx) -> dict:
    """i. kernels/rms_norm.py against layers.RMSNorm (what the triton path swaps it for): bf16 rows
    of 2048 and 4096 (the 1B and 8B widths), 1 to 256 rows (a decode batch), Llama's convention."""
    from bench_attention import bench
    from nanoserve.kernels.rms_norm import rms_norm

    from nanoserve.models.layers import RMSNorm

    dtype = torch.float32 if ctx.dry else torch.bfloat16
    widths = [64] if ctx.dry else [2048, 4096]
    batches = [1, 4] if ctx.dry else [1, 16, 64, 256]
    res = {"goal": "one launch instead of six; kernel faster than the torch module", "rows": []}
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    for width in widths:
        norm = RMSNorm(width, 1e-5).to(ctx.device, dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(width, generator=gen, device=ctx.device) + 0.5)
        for rows in batches:
            x = torch.randn(rows, width, generator=gen, device=ctx.device).to(dtype)
            with torch.no_grad():
                ref = bench(lambda: norm(x), ctx.dry)  # noqa: B023
                ours = bench(lambda: rms_norm(x, norm.weight, norm.eps), ctx.dry)  # noqa: B023
                diff = (rms_norm(x, norm.weight, norm.eps).float() - norm(x).float()).abs().max()
            res["rows"].append(dict(dtype=str(dtype).removeprefix("torch."), rows=rows,
                                    width=width, torch_us=1e3 * ref, kernel_us=1e3 * ours,
                                    speedup=ref / ours, max_abs_diff=float(diff)))
            ctx.save(res)
    res["min_speedup"] = min(r["speedup"] for r in res["rows"])
    return res


def _two_four_weight(N: int, K: int, device: str, dtype: torch.dtype, gen) -> torch.Tensor:
    """A random [N, K] weight pruned 2:4 by magnitude (nanoserve/sparsity/pruning.py)."""
    from nanoserve.sparsity.pruning import magnitude_mask

    w = torch.randn(N, K, generator=gen, device=device) * 0.02
    return (w * magnitude_mask(w, "2:4")).to(dtype)


def fig_sparse_2_4(ctx) -> dict:
    """k. A 2:4 weight through torch's semi-structured sparse tensors (sparse tensor cores, sm_80+)
    against the same weight dense: bf16, a Llama-8B MLP's shapes, 1 to 512 rows. Where the sparse
    path cannot run (the dry run's CPU), the row says why and times the dense product only."""
    from bench_attention import bench
    from torch.nn.functional import linear

    from nanoserve.sparsity.semi_structured import semi_structured_problem, to_semi_structured

    dtype = torch.float32 if ctx.dry else torch.bfloat16
    shapes = [(64, 128)] if ctx.dry else [(4096, 4096), (14336, 4096), (4096, 14336)]
    batches = [1, 4] if ctx.dry else [1, 16, 128, 512]
    res = {"goal": "2:4 faster than dense from some batch size on (up to 2x)", "rows": []}
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    for N, K in shapes:
        w = _two_four_weight(N, K, ctx.device, dtype, gen)
        problem = semi_structured_problem(w)
        sparse = to_semi_structured(w) if problem is None else None
        for M in batches:
            x = torch.randn(M, K, generator=gen, device=ctx.device).to(dtype)
            with torch.no_grad():
                dense_ms = bench(lambda: linear(x, w), ctx.dry)  # noqa: B023
                row = dict(N=N, K=K, M=M, dense_us=1e3 * dense_ms, sparse_us=None, speedup=None,
                           max_abs_diff=None, problem=problem)
                if sparse is not None:
                    sparse_ms = bench(lambda: linear(x, sparse), ctx.dry)  # noqa: B023
                    diff = (linear(x, sparse).float() - linear(x, w).float()).abs().max()
                    row.update(sparse_us=1e3 * sparse_ms, speedup=dense_ms / sparse_ms,
                               max_abs_diff=float(diff))
            res["rows"].append(row)
            ctx.save(res)
    speedups = [r["speedup"] for r in res["rows"] if r["speedup"] is not None]
    res["best_speedup"] = max(speedups) if speedups else None
    return res



# l. decode attention over three caches of one DeepSeek-V3-like attention layer
# DeepSeek-V3's MLA (HF config names) and the paged caches it is set against; every launch timed
# is a row of benchmarks/kernels_compile.json (sm_80, sm_90; tests/test_gpu_check.py checks)
MLA_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, paged_head_dim=128,
                gqa_group=8)
MLA_HEADS = (16, 128)  # DeepSeek-V2-Lite, V3
# gpt-oss's head_dim 64, with 4 query heads a KV head (the compile matrix's sinks rows; gpt-oss: 8)
SINKS_SHAPE = dict(heads=64, kv_heads=16, head_dim=64, batch=32, context=4096)
PAGE = 16  # tokens per block: the engine's default and the compile matrix's
CHECK_CONTEXT = 64  # keys each correctness check reads (the references loop in torch)


def _paged_tables(batch: int, context: int, gen, device: str):
    """Block tables over a pool of batch · ⌈context / PAGE⌉ blocks, shuffled across it (as a
    serving engine's pool ends up), and context_lens; int32, as the engine passes them."""
    per_seq = -(-context // PAGE)
    order = torch.randperm(batch * per_seq, generator=gen, device=device)
    tables = order.view(batch, per_seq).to(torch.int32)  # B, max_blocks
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)  # B
    return tables, lens


def _randn(shape, dtype, gen, device: str) -> torch.Tensor:
    """Normal values drawn in `dtype` itself: an fp32 draw of the largest pool (17 GB of bf16)
    would need twice its memory."""
    return torch.randn(shape, generator=gen, device=device, dtype=dtype)


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _mla_case(B, H, ctx, dims, dtype, gen, device):
    """MLA: q_lat, q_pe and the latent pool [blocks, PAGE, 1, r + d_rope]; the call, its
    reference on the first CHECK_CONTEXT keys, and the cache bytes one call reads."""
    from nanoserve.kernels.mla_decode import mla_decode
    from nanoserve.kernels.mla_decode_ref import mla_decode_ref

    r, d_rope = dims["kv_lora_rank"], dims["qk_rope_head_dim"]
    tables, lens = _paged_tables(B, ctx, gen, device)
    pool = _randn((tables.numel(), PAGE, 1, r + d_rope), dtype, gen, device)
    q_lat = _randn((B, H, r), dtype, gen, device)  # B, H, r
    q_pe = _randn((B, H, d_rope), dtype, gen, device)  # B, H, d_rope
    scale = (dims["qk_nope_head_dim"] + d_rope) ** -0.5  # the expanded head's 1/√(d_nope + d_rope)
    short = torch.full_like(lens, min(ctx, CHECK_CONTEXT))
    err = _rel_error(mla_decode(q_lat, q_pe, pool, tables, short, scale),
                     mla_decode_ref(q_lat, q_pe, pool, tables, short, scale))
    kv_bytes = B * ctx * (r + d_rope) * pool.element_size()
    return (lambda: mla_decode(q_lat, q_pe, pool, tables, lens, scale)), err, kv_bytes


def _paged_case(B, H, Hkv, D, ctx, dtype, gen, device, sinks=None):
    """Ordinary paged decode: q [B, H, D] over K, V pools [blocks, PAGE, Hkv, D], one split (as
    mla_decode, which has no split-KV); the call, its check against paged_attention_ref on the
    first CHECK_CONTEXT keys, and the K + V bytes one call reads."""
    from nanoserve.kernels.paged_attention import paged_attention, paged_attention_ref

    tables, lens = _paged_tables(B, ctx, gen, device)
    k = _randn((tables.numel(), PAGE, Hkv, D), dtype, gen, device)
    v = _randn((tables.numel(), PAGE, Hkv, D), dtype, gen, device)
    q = _randn((B, H, D), dtype, gen, device)  # B, H, D
    short = torch.full_like(lens, min(ctx, CHECK_CONTEXT))
    err = _rel_error(paged_attention(q, k, v, tables, short, sinks=sinks),
                     paged_attention_ref(q, k, v, tables, short, sinks=sinks))
    kv_bytes = 2 * B * ctx * Hkv * D * k.element_size()
    return (lambda: paged_attention(q, k, v, tables, lens, sinks=sinks)), err, kv_bytes


def _time_case(case, prefix: str, row: dict, dry: bool) -> None:
    """Time a (call, error, bytes) case with bench (median of triton's do_bench, after its
    warm-up) and fill row's <prefix>_us, _mb, _gbps and _rel_error."""
    from bench_attention import bench

    call, err, kv_bytes = case
    ms = bench(call, dry)
    row.update({f"{prefix}_us": 1e3 * ms, f"{prefix}_mb": kv_bytes / 1e6,
                f"{prefix}_gbps": kv_bytes / (ms * 1e-3) / 1e9, f"{prefix}_rel_error": err})


def _sinks_row(ctx, dtype, gen) -> dict:
    """paged_attention with and without sinks= at SINKS_SHAPE (tiny in a dry run)."""
    from bench_attention import bench

    tiny = dict(heads=4, kv_heads=2, head_dim=16, batch=2, context=40)
    row = dict(tiny if ctx.dry else SINKS_SHAPE)
    B, H, Hkv, D, n = (row[k] for k in ("batch", "heads", "kv_heads", "head_dim", "context"))
    sinks = _randn((H,), torch.float32, gen, ctx.device)  # one logit per query head
    plain, plain_err, _ = _paged_case(B, H, Hkv, D, n, dtype, gen, ctx.device)
    sunk, sink_err, kv_bytes = _paged_case(B, H, Hkv, D, n, dtype, gen, ctx.device, sinks)
    row.update(plain_us=1e3 * bench(plain, ctx.dry), sinks_us=1e3 * bench(sunk, ctx.dry),
               kv_mb=kv_bytes / 1e6, plain_rel_error=plain_err, sinks_rel_error=sink_err)
    row["overhead_pct"] = 100 * (row["sinks_us"] / row["plain_us"] - 1)
    return row


def fig_mla_decode(ctx) -> dict:
    """l. Decode attention over the KV cache at DeepSeek-V3-like shapes (16 and 128 query heads,
    r = 512, d_rope = 64, bf16, batch 1 and 32, context 1k-16k): mla_decode over the latent pool
    against paged_attention over an expanded cache of H KV heads and over a GQA-8 cache, both of
    head_dim 128; microseconds, cache bytes read, GB/s; and the cost of attention sinks."""
    from gpu_check_models import peak_bandwidth

    dtype = torch.float32 if ctx.dry else torch.bfloat16
    tiny = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, paged_head_dim=16,
                gqa_group=2)
    dims = tiny if ctx.dry else MLA_DIMS
    heads = [4] if ctx.dry else list(MLA_HEADS)
    batches = [1, 2] if ctx.dry else [1, 32]
    contexts = [40] if ctx.dry else [1024, 4096, 16384]
    peak = (
        peak_bandwidth(torch.cuda.get_device_name()) if ctx.device == "cuda" else (None, "dry run")
    )
    res = {"goal": "time follows bytes: MLA reads 576 values a token, mha 256 · H (1/57 of it at "
                   "H 128), gqa8 32 · H (7x MLA's at H 128, 0.9x at H 16): mla_decode faster than "
                   "mha everywhere and than gqa8 at H 128",
           "dtype": str(dtype).removeprefix("torch."), **dims,
           "page_size": PAGE, "check_context": CHECK_CONTEXT, "peak_tbps": peak[0],
           "peak_source": peak[1], "rows": [], "sinks": [],
           "note": "mla: kernels/mla_decode.py over [blocks, 16, 1, r + d_rope]; mha: "
                   "paged_attention over H KV heads of head_dim 128 (the expanded MLA has keys of "
                   "192 and values of 128, which one head_dim cannot hold: its true cache is 1.25x "
                   "mha_mb); gqa8: paged_attention, 8 query heads per KV head, head_dim 128. One "
                   "split each (mla_decode has no split-KV: batch 1 leaves most SMs idle). *_mb: "
                   "cache bytes one call reads, counted once (mla_decode re-reads the latents "
                   "once per block of 32 heads, from L2 or HBM); *_gbps = *_mb / time; "
                   "*_rel_error: against the torch reference on the first check_context keys; "
                   "median of triton.testing.do_bench"}
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    for H in heads:
        for B in batches:
            for n in contexts:
                if ctx.over():
                    res["truncated"] = f"budget spent before H {H}, batch {B}, context {n}"
                    return _mla_summary(res)
                row = dict(heads=H, batch=B, context=n)
                # one cache at a time: the largest (H 128, batch 32, 16k) is 34 GB of bf16
                _time_case(_mla_case(B, H, n, dims, dtype, gen, ctx.device), "mla", row, ctx.dry)
                D, group = dims["paged_head_dim"], dims["gqa_group"]
                _time_case(_paged_case(B, H, H, D, n, dtype, gen, ctx.device), "mha", row,
                           ctx.dry)
                _time_case(_paged_case(B, H, H // group, D, n, dtype, gen, ctx.device), "gqa8",
                           row, ctx.dry)
                row["mla_vs_mha"] = row["mha_us"] / row["mla_us"]
                row["mla_vs_gqa8"] = row["gqa8_us"] / row["mla_us"]
                res["rows"].append(row)
                ctx.save(res)
    if ctx.over():
        res["truncated"] = "budget spent before the sinks row"
    else:
        res["sinks"].append(_sinks_row(ctx, dtype, gen))
    return _mla_summary(res)


def _mla_summary(res: dict) -> dict:
    """The worst correctness error over every call checked, and ok when it is within bf16's
    rounding (2e-2; fp32 in a dry run is far inside)."""
    errors = [v for r in res["rows"] + res["sinks"] for k, v in r.items()
              if k.endswith("rel_error")]
    res["max_rel_error"] = max(errors) if errors else None
    res["ok"] = bool(errors) and max(errors) < 2e-2
    return res
