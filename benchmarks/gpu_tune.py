"""Launch-config sweeps and a step profile on a GPU: what gpu_check's figures leave open, in one
short run.

    python benchmarks/gpu_tune.py [--only w4a16,flash,splitkv,profile] [--out gpu_tune.json] [--workdir DIR]

- w4a16: the W4A16 GEMV / GEMM at K = N = 4096 and 8192, M = 1 and 16, against fp16 cuBLAS on the
  same (dequantized) weights: the act-order path (zero and scale gathered row by row), the grouped
  path (one scale row per tile, `group_size=`) at the configs.py tiles, and a few other GEMV tiles;
  each also checked against the torch reference (relative error).
- flash: flash_attention prefill (bf16, causal, N = 4096, 16k tokens a launch) at several tiles /
  warps / stages for head_dim 64 and 128, against SDPA's flash backend, with the error against it.
- splitkv: batch-1 paged decode (32 heads, 8 kv heads, d 128, bf16) at 1k and 32k context for
  num_splits = one wave of programs and 2, 4, 8 waves.
- profile: one 1B Llama (gpu_check_models' "target", random bf16 weights) decoding at batch 1,
  eager and with CUDA graphs, under torch.profiler: wall time per step, GPU kernel time per step,
  kernel launches per step, and the host functions and GPU kernels that cost most.

Each part runs alone (an error keeps the others), saves what it has, and prints a table. Every
timing is the median of triton.testing.do_bench (CUDA events) after warm-up. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # ms


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def w4a16() -> list[dict]:
    from nanoserve.kernels import configs
    from nanoserve.kernels import dequant_matmul as dm

    from nanoserve.quant.packing import pack_gptq

    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    gemv_tiles = [None, (16, 128, 64, 4, 3), (16, 64, 128, 4, 3), (16, 32, 128, 4, 4),
                  (16, 128, 128, 8, 3),
                  (16, 64, 64, 4, 4)]
    for KN in (4096, 8192):
        K = N = KN
        codes = torch.randint(0, 16, (N, K), device="cuda", generator=gen)
        zeros = torch.randint(1, 16, (N, K // 128), device="cuda", generator=gen)
        scales = torch.rand(N, K // 128, device="cuda", generator=gen) * 0.02 + 0.001
        g_idx = torch.arange(K, device="cuda") // 128
        p = pack_gptq(codes, zeros, scales, g_idx, 4)
        qw, qz, s, gi = p["qweight"], p["qzeros"], p["scales"].half(), p["g_idx"]
        w = dm.dequantize_int4(qw, qz, s, gi, dtype=torch.float16)  # N, K
        for M in (1, 16):
            a = torch.randn(M, K, device="cuda", generator=gen).half()
            ref = a.float() @ w.float().t()
            cublas = bench(lambda: a @ w.t())  # noqa: B023
            base = dict(K=K, N=N, M=M, cublas_fp16_us=1e3 * cublas)
            out = dm.dequant_matmul(a, qw, qz, s, gi)
            t = bench(lambda: dm.dequant_matmul(a, qw, qz, s, gi))  # noqa: B023
            rows.append(dict(base, path="act-order (gather)", tiles="configs", us=1e3 * t,
                             speedup=cublas / t,
                             rel_err=rel_err(out, ref)))
            old = configs.DEQUANT[("gemv", 80, 2)]
            for tiles in gemv_tiles:
                if tiles is not None:
                    configs.DEQUANT[("gemv", 80, 2)] = configs.Launch(
                        tiles[:3], tiles[3], tiles[4], smem_kb=0
                    )
                try:
                    out = dm.dequant_matmul(a, qw, qz, s, gi, group_size=128)
                    t = bench(lambda: dm.dequant_matmul(a, qw, qz, s, gi, group_size=128))  # noqa: B023
                    rows.append(dict(base, path="grouped "
                                                "g128", tiles=str(tiles or "configs"), us=1e3 * t,
                                     speedup=cublas / t, rel_err=rel_err(out, ref),
                                     tbps=(qw.numel() * 4 + s.numel() * 2) / (t * 1e-3) / 1e12))
                except Exception as e:  # a tile that does not compile: its row says so
                    rows.append(dict(base, path="grouped g128", tiles=str(tiles),
                                     error=f"{type(e).__name__}: {e}"))
                finally:
                    configs.DEQUANT[("gemv", 80, 2)] = old
    return rows


def flash() -> list[dict]:
    import torch.nn.functional as F
    from nanoserve.kernels import configs
    from nanoserve.kernels.flash_attention import flash_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    tiles = [None, (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
             (128, 32, 4, 3),
             (64, 128, 4, 3)]
    N, dtype = 4096, torch.bfloat16
    for d in (64, 128):
        H, B = 2048 // d, 16384 // N
        q, k, v = (torch.randn(B * N, H, d, device="cuda",
                               generator=gen).to(dtype) for _ in range(3))
        cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device="cuda")
        qs, ks, vs = (t.view(B, N, H, d).transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = (
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=True) .transpose(1, 2)
                .reshape(B * N, H, d)
            )
            t_ref = bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))  # noqa: B023
        flops = 4 * B * H * N * N * d / 2
        key = (90, 2, d)
        old = configs.FLASH[key]
        for tile in tiles:
            if tile is not None:
                configs.FLASH[key] = configs.Launch(tile[:2], tile[2], tile[3], smem_kb=0)
            label = str(tile or f"configs {old.tiles} w{old.num_warps} s{old.num_stages}")
            try:
                out = flash_attention(q, k, v, cu, cu, causal=True, max_seqlen_q=N)
                t = bench(lambda: flash_attention(q, k, v, cu, cu, causal=True, max_seqlen_q=N))  # noqa: B023
                rows.append(dict(d=d, N=N, tiles=label, ours_tflops=flops / t / 1e9,
                                 sdpa_tflops=flops / t_ref / 1e9,
                                 ratio=t_ref / t, rel_err=rel_err(out, ref)))
            except Exception as e:
                rows.append(dict(d=d, N=N, tiles=label, error=f"{type(e).__name__}: {e}"))
            finally:
                configs.FLASH[key] = old
    return rows


def splitkv() -> list[dict]:
    from bench_attention import random_pool
    from nanoserve.kernels import split_kv
    from nanoserve.kernels.paged_attention import paged_attention

    rows, gen = [], torch.Generator(device="cuda").manual_seed(0)
    H, Hkv, d, dtype = 32, 8, 128, torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wave = -(-sms // Hkv)
    split_kv.MAX_SPLITS = 8 * wave
    for ctx in (1024, 32768):
        q = torch.randn(1, H, d, device="cuda", generator=gen).to(dtype)
        k, v, tables, lens = random_pool([ctx], Hkv, d, 16, dtype, "cuda", True, gen)
        ref = paged_attention(q, k, v, tables, lens, num_splits=1)
        for waves in (1, 2, 4, 8):
            S = wave * waves
            out = paged_attention(q, k, v, tables, lens, num_splits=S)
            t = bench(lambda: paged_attention(q, k, v, tables, lens, num_splits=S))  # noqa: B023
            rows.append(dict(context=ctx, waves=waves, num_splits=S, ms=t,
                             rel_err=rel_err(out, ref)))
    return rows


def profile(workdir: Path) -> list[dict]:
    from gpu_check_models import ensure_checkpoint, llama_config, random_prompt
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from nanoserve import LLM, SamplingParams

    cfg = llama_config("target", False)
    path = ensure_checkpoint(workdir, "target", cfg, "cuda", torch.bfloat16)
    rows, steps = [], 32
    prompt = random_prompt(128, seed=1)
    for mode, eager in (("eager", True), ("cuda_graphs", False)):
        llm = LLM(str(path), dtype=torch.bfloat16, device="cuda", max_num_seqs=8,
                  enforce_eager=eager)
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        llm.generate([prompt], params, use_tqdm=False)  # warm-up
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        events = prof.key_averages()
        gpu_us = sum(
            e.self_device_time_total for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA
        )
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                             "cudaLaunchKernelExC", "cudaGraphLaunch"))
        top = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                     key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
        top_gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.self_device_time_total, reverse=True)[:12]
        host_ops_us = sum(
            e.self_cpu_time_total for e in events if e.device_type == torch.autograd.DeviceType.CPU
        )
        rows.append(dict(mode=mode, steps=steps, wall_ms_per_step=1e3 * wall / steps,
                         gpu_ms_per_step=gpu_us / 1e3 / steps, launches_per_step=launches / steps,
                         host_ops_ms_per_step=host_ops_us / 1e3 / steps,
                         top_host=[(e.key, round(e.self_cpu_time_total / 1e3 / steps, 3),
                                    e.count // steps)
                                   for e in top],
                         top_gpu=[(e.key[:80], round(e.self_device_time_total / 1e3 / steps, 4),
                                   e.count / steps)
                                  for e in top_gpu]))
        del llm
        torch.cuda.empty_cache()
    return rows


PARTS = {"w4a16": w4a16, "flash": flash, "splitkv": splitkv, "profile": profile}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PARTS))
    ap.add_argument("--out", default=str(HERE / "gpu_tune.json"))
    ap.add_argument("--workdir", default="/tmp/gpu_tune",
                    help="where the profile's 1B checkpoint is built")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_tune needs a CUDA GPU", file=sys.stderr)
        return 2
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "parts": {}}
    for name in args.only.split(","):
        start = time.perf_counter()
        try:
            rows = PARTS[name](Path(args.workdir)) if name == "profile" else PARTS[name]()
            res["parts"][name] = {"rows": rows}
        except Exception as e:
            res["parts"][name] = {"error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()[-3000:]}
        res["parts"][name]["seconds"] = time.perf_counter() - start
        Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"\n== {name} ({res['parts'][name]['seconds']:.0f} s)")
        for r in res["parts"][name].get("rows", []):
            print(
                "  "
                + "  ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                )
            )
        if "error" in res["parts"][name]:
            print(res["parts"][name]["traceback"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
