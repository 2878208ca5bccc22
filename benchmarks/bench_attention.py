"""Attention kernel speed on a GPU: nanoserve.kernels against torch's SDPA and against themselves.

    python benchmarks/bench_attention.py                 # CUDA: the three measurements of issue 6
    python benchmarks/bench_attention.py --smoke         # CPU: tiny shapes in Triton's interpreter

1. Prefill: `flash_attention` (packed varlen, causal) vs `F.scaled_dot_product_attention` with
   the flash backend, N ∈ {1k, 2k, 4k, 8k} tokens per sequence, head dim 64 and 128, fp16 and
   bf16, 16k tokens per launch (batch = 16384 / N) and 2048 / d heads (the FlashAttention papers'
   setting). TFLOP/s counts the causal half: 4 · B · H · N² · d / 2.
2. Paged decode: `paged_attention` over shuffled block tables vs the same kernel over a
   contiguous cache (block table = arange), batch 32, 32 query / 8 kv heads, d = 128, bf16.
3. Split-KV: batch-1 decode latency from 1k to 32k context with `choose_num_splits`, and with one
   split for contrast.
4. 8-bit KV: `paged_attention` over int8 and fp8_e4m3 pools (codes + a scale per token and head,
   dequantized in registers) vs the same bf16 pool, the shape of 2., 1k-8k context. Decode reads the
   whole cache every step: half the bytes bounds the gain at 2x.

Timings are medians from `triton.testing.do_bench` (CUDA events, warm-up, L2 flushed). `--smoke`
runs tiny shapes on CPU through the interpreter to check that the script works: its timings mean
nothing. Saves JSON beside this file and prints tables.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

import nanoserve  # noqa: F401  (switches Triton's interpreter on without CUDA, before Triton loads)

HERE = Path(__file__).resolve().parent


def bench(fn, smoke: bool) -> float:
    """Median milliseconds per call."""
    if smoke:
        fn()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def random_pool(lens, n_kv, d, block_size, dtype, device, shuffle, gen):
    """A KV pool holding len tokens per sequence; block tables shuffled across the pool or
    arange."""
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq)
    k = torch.randn(num_blocks, block_size, n_kv, d, generator=gen, device=device).to(dtype)
    v = torch.randn(num_blocks, block_size, n_kv, d, generator=gen, device=device).to(dtype)
    order = (
        torch.randperm(num_blocks, generator=gen, device=device) if shuffle
        else torch.arange(num_blocks, device=device)
    )
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[start:start + n]
        start += n
    return k, v, tables, torch.tensor(lens, dtype=torch.int32, device=device)


def prefill(args, device, gen):
    import torch.nn.functional as F
    from nanoserve.kernels.flash_attention import flash_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    lengths = [64, 96] if args.smoke else [1024, 2048, 4096, 8192]
    dims = [16] if args.smoke else [64, 128]
    dtypes = [torch.float32] if args.smoke else [torch.float16, torch.bfloat16]
    total_tokens = 128 if args.smoke else 16384
    for dtype in dtypes:
        for d in dims:
            H = 2 if args.smoke else 2048 // d
            for N in lengths:
                B = max(1, total_tokens // N)
                q, k, v = (torch.randn(B * N, H, d, generator=gen,
                                       device=device).to(dtype) for _ in range(3))
                cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device=device)  # B+1
                ours = bench(lambda: flash_attention(q, k, v, cu, cu, causal=True), args.smoke)  # noqa: B023
                qs, ks, vs = (t.view(B, N, H, d).transpose(1, 2) for t in (q, k, v))  # B, H, N, d
                if device == "cuda":
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        ref = bench(
                            lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True),  # noqa: B023
                            args.smoke,
                        )
                else:
                    ref = bench(
                        lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True),  # noqa: B023
                        args.smoke,
                    )
                flops = 4 * B * H * N * N * d / 2
                rows.append(dict(dtype=str(dtype).removeprefix("torch."), d=d, N=N, batch=B, heads=H,
                                 ours_ms=ours, sdpa_ms=ref, ours_tflops=flops / ours / 1e9,
                                 sdpa_tflops=flops / ref / 1e9, ratio=ref / ours))
    return rows


def paged_vs_contiguous(args, device, gen):
    from nanoserve.kernels.paged_attention import paged_attention

    rows = []
    B, H, Hkv, d = (4, 4, 2, 16) if args.smoke else (32, 32, 8, 128)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    for ctx in ([40] if args.smoke else [1024, 4096, 8192]):
        q = torch.randn(B, H, d, generator=gen, device=device).to(dtype)
        res = {}
        for shuffle in (False, True):
            k, v, tables, lens = random_pool([ctx] * B, Hkv, d, 16, dtype, device, shuffle, gen)
            res[shuffle] = bench(lambda: paged_attention(q, k, v, tables, lens), args.smoke)  # noqa: B023
        rows.append(dict(batch=B, heads=H, kv_heads=Hkv, d=d, context=ctx, contiguous_ms=res[False],
                         paged_ms=res[True], ratio=res[True] / res[False]))
    return rows


def split_kv(args, device, gen):
    from nanoserve.kernels.paged_attention import choose_num_splits, paged_attention

    rows = []
    H, Hkv, d = (4, 2, 16) if args.smoke else (32, 8, 128)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    contexts = [32, 128] if args.smoke else [1024, 2048, 4096, 8192, 16384, 32768]
    for ctx in contexts:
        q = torch.randn(1, H, d, generator=gen, device=device).to(dtype)
        k, v, tables, lens = random_pool([ctx], Hkv, d, 16, dtype, device, True, gen)
        splits = choose_num_splits(1, Hkv, ctx, num_sms=4 if args.smoke else None)
        one = bench(lambda: paged_attention(q, k, v, tables, lens, num_splits=1), args.smoke)  # noqa: B023
        many = bench(lambda: paged_attention(q, k, v, tables, lens, num_splits=splits), args.smoke)  # noqa: B023
        rows.append(dict(context=ctx, num_splits=splits, split_ms=many, one_split_ms=one))
    base = rows[0]["split_ms"]
    for r in rows:
        r["growth_vs_first"] = r["split_ms"] / base
    return rows


def kv8_decode(args, device, gen):
    from nanoserve.kernels.paged_attention import paged_attention

    from nanoserve.kv.quant import FORMATS

    rows = []
    B, H, Hkv, d = (4, 4, 2, 16) if args.smoke else (32, 32, 8, 128)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    for ctx in ([40] if args.smoke else [1024, 4096, 8192]):
        q = torch.randn(B, H, d, generator=gen, device=device).to(dtype)
        k, v, tables, lens = random_pool([ctx] * B, Hkv, d, 16, dtype, device, True, gen)
        row = dict(
            batch=B, heads=H, kv_heads=Hkv, d=d, context=ctx,
            bf16_ms=bench(lambda: paged_attention(q, k, v, tables, lens), args.smoke),  # noqa: B023
        )
        for name in ("int8", "fp8_e4m3"):
            (kc, ks), (vc, vs) = FORMATS[name].quantize(k), FORMATS[name].quantize(v)
            kv = dict(k_scale=ks, v_scale=vs, kv_cache_dtype=name)
            row[f"{name}_ms"] = bench(
                lambda: paged_attention(q, kc, vc, tables, lens, **kv), args.smoke  # noqa: B023
            )
            row[f"{name}_speedup"] = row["bf16_ms"] / row[f"{name}_ms"]
        rows.append(row)
    return rows


def table(title, rows, cols):
    print(f"\n{title}")
    print(" | ".join(f"{c:>12s}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:12.3f}" if isinstance(r[c],
                                                       float) else f"{r[c]!s:>12s}" for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on CPU (interpreter): checks the script only")
    ap.add_argument("--out", help="JSON path (default: benchmarks/attention_<device>.json)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise SystemExit("bench_attention measures GPU kernels: no CUDA device here (use --smoke "
                         "to check the script)")
    gen = torch.Generator(device=device).manual_seed(0)
    import triton

    res = dict(date=date.today().isoformat(),
               device=torch.cuda.get_device_name() if device == "cuda" else
               f"CPU ({platform.machine()}), Triton interpreter", torch=torch.__version__,
               triton=triton.__version__,
               smoke=args.smoke,
               command="python benchmarks/bench_attention.py" + (" --smoke" if args.smoke else ""))
    res["prefill"] = prefill(args, device, gen)
    table("prefill: flash_attention vs SDPA (flash backend), causal", res["prefill"],
          ["dtype", "d", "N", "ours_tflops", "sdpa_tflops", "ratio"])
    res["paged_decode"] = paged_vs_contiguous(args, device, gen)
    table("decode: paged (shuffled blocks) vs contiguous, same kernel", res["paged_decode"],
          ["context", "contiguous_ms", "paged_ms", "ratio"])
    res["split_kv"] = split_kv(args, device, gen)
    table("batch-1 decode, split-KV", res["split_kv"],
          ["context", "num_splits", "split_ms", "one_split_ms", "growth_vs_first"])
    res["kv8_decode"] = kv8_decode(args, device, gen)
    table("decode over 8-bit KV pools vs bf16 (same kernel, shuffled blocks)", res["kv8_decode"],
          ["context", "bf16_ms", "int8_ms", "fp8_e4m3_ms", "int8_speedup", "fp8_e4m3_speedup"])
    if not math.isfinite(sum(r["ratio"] for r in res["prefill"])):
        raise SystemExit("non-finite timing")
    out = (
        Path(args.out) if args.out else HERE / f"attention_{'smoke' if args.smoke else 'gpu'}.json"
    )
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nsaved {out}")


if __name__ == "__main__":
    main()
