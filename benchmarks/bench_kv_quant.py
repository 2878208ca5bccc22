"""KV-cache quantization: what int8 / FP8 / int4 blocks cost in quality and buy in capacity.

    python benchmarks/bench_kv_quant.py                  # demo and (with ../shared) stories260K
    python benchmarks/bench_kv_quant.py --quick --out X  # tiny (tested)

Quality (fp32 model, each kv_cache_dtype vs "auto" = fp32 K/V): held-out text scored through the
engine with prompt logprobs, in chunks of 16 tokens (`max_num_batched_tokens=16`), so almost every
key a query reads comes from the paged pool, quantized; mean NLL per token and its change from fp32.
Windows: the demo on tinyshakespeare's last 10 % (windows of 128 bytes), stories260K on the
TinyStories validation sample (windows of 500 characters, ~250 tokens). Greedy agreement: 16 prompts
× 64 greedy tokens, the share of positions equal to the fp32 cache's tokens.
Capacity (the demo in bfloat16, so "auto" is a 2-byte cache): one `kv_cache_memory` (the bytes of 8
full-context bf16 sequences) for every mode; 128 requests at once, prompts U[8, 64], outputs U[16,
64] (seed 0, EOS ignored); KV blocks in the pool, running sequences while requests still queue (the
pool-bound phase: this is the capacity), peak and mean over the whole run (the mean includes the
drain at the end, a larger share of a faster run), output tok/s.
int4's design (the demo, same windows): the shipped format (asymmetric, a scale and a minimum per 64
values) against symmetric groups of 32 and 64 (`SymmetricInt4` below, a scale per group, codes ±7),
all at ≤ 4.5 bits a value: NLL change and the relative RMS error of real K/V (one Shakespeare
window's keys and values, every layer).
JSON in benchmarks/kv_quant_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared"
MODES = ["auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4"]
FULL = dict(windows=40, prompts=16, new=64, requests=128)
QUICK = dict(windows=2, prompts=2, new=8, requests=8)


def texts(model: str, p: dict) -> list:
    if model == "demo":
        text = (SHARED / "corpora" / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
        held = text[int(len(text) * 0.9):]
        return [held[i * 127:i * 127 + 127] for i in range(p["windows"])]
    text = (SHARED / "corpora" / "tinystories" / "tinystories_val_sample.txt").read_text(
        encoding="utf-8"
    )
    return [text[i * 500:i * 500 + 500] for i in range(p["windows"])]


def nll(llm, windows: list, max_len: int) -> float:
    """Mean negative log-likelihood per token of the windows, scored by the engine (prompt
    logprobs)."""
    from nanoserve import SamplingParams

    total = count = 0.0
    for w in windows:
        ids = llm.encode_prompt(w)[:max_len - 1]
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        total -= sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids)))
        count += len(ids) - 1
    return total / count


def quality(model: str, p: dict) -> dict:
    from nanoserve import LLM, SamplingParams

    windows, res, ref_tokens = texts(model, p), {}, None
    prompts = [w[:24] for w in texts(model, dict(windows=p["prompts"]))]
    greedy = SamplingParams(temperature=0, max_tokens=p["new"], ignore_eos=True)
    for mode in MODES:
        llm = LLM(model, dtype="float32", kv_cache_dtype=mode, max_num_batched_tokens=16)
        row = dict(nll=nll(llm, windows, min(llm.max_model_len, 257)))
        tokens = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        if mode == "auto":
            ref_tokens = tokens
        row["greedy_agreement"] = sum(
            a == b for t, r in zip(tokens, ref_tokens) for a, b in zip(t, r)
        ) / sum(len(r) for r in ref_tokens)
        res[mode] = row
    for row in res.values():
        row["nll_change"] = row["nll"] / res["auto"]["nll"] - 1
    return res


def symmetric_int4(group_size: int):
    """The design alternative to the shipped int4: one fp16 scale max|x| / 7 per group, codes ±7
    stored + 8 (the pool's layout otherwise the same: kv/quant.py's pack_nibbles)."""
    from dataclasses import dataclass

    import torch

    from nanoserve.kv import quant

    @dataclass(frozen=True)
    class SymmetricInt4(quant.KVQuantInt4):
        def pool_shapes(self, shape):
            D = shape[-1]
            return (*shape[:-1], D // 2), (*shape[:-1], D // self.group(D))

        def quantize(self, x):
            G = self.group(x.shape[-1])
            groups = x.float().unflatten(-1, (-1, G))  # ..., D/G, G
            scale = (groups.abs().amax(-1) / 7).clamp(min=quant.MIN_SCALE).half()  # ..., D/G
            codes = (groups / scale.float()[..., None]).round().clamp(-7, 7) + 8
            return quant.pack_nibbles(codes.to(torch.uint8).flatten(-2)), scale

        def dequantize(self, q, scale, dtype, out=None):
            codes = quant.unpack_nibbles(q).unflatten(-1, (scale.shape[-1], -1)).to(dtype) - 8
            deq = (codes * scale.to(dtype)[..., None]).flatten(-2)
            return deq if out is None else out.copy_(deq)

    return SymmetricInt4("int4", group_size)


def int4_designs(p: dict) -> dict:
    """NLL change and K/V relative RMS error of int4 variants on the demo (torch backend: the
    variant replaces kv/quant.py's INT4 for the run)."""
    import torch

    from nanoserve import LLM, SamplingParams
    from nanoserve.kv import quant

    shipped = quant.INT4
    designs = {"asymmetric g64 (shipped)": shipped, "symmetric g32": symmetric_int4(32),
               "symmetric g64": symmetric_int4(64)}
    windows, res = texts("demo", p), {}
    base = LLM("demo", dtype="float32", kv_cache_dtype="auto", max_num_batched_tokens=16)
    ref = nll(base, windows, 128)
    ids = base.encode_prompt(windows[0])
    base.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    kv = base.engine.runner.kv  # a fresh engine's first sequence: blocks 0, 1, ... in order
    try:
        for name, fmt in designs.items():
            quant.INT4 = fmt
            llm = LLM("demo", dtype="float32", kv_cache_dtype="int4", max_num_batched_tokens=16)
            row = dict(bits_per_value=8 * quant.kv_element_bytes("int4", 64),
                       nll_change=nll(llm, windows, 128) / ref - 1)
            for which, pool in (("k", kv.k), ("v", kv.v)):
                x = pool.flatten(1, 2)[:, :len(ids)]  # L, T, Hkv, D
                err = fmt.dequantize(*fmt.quantize(x), torch.float32) - x
                row[f"{which}_rel_rms_error"] = (err.norm() / x.norm()).item()
            res[name] = row
    finally:
        quant.INT4 = shipped
    return res


def capacity(p: dict) -> dict:
    import torch

    from nanoserve import LLM, SamplingParams
    from nanoserve.kv import kv_bytes_per_token

    res, budget = {}, None
    for mode in MODES:  # "auto" first: its config gives the budget every mode gets
        llm = LLM("demo", dtype="bfloat16", kv_cache_dtype=mode, max_num_seqs=64,
                  kv_cache_memory=budget)
        budget = budget or 8 * kv_bytes_per_token(llm.config, torch.bfloat16) * llm.max_model_len
        engine, rng = llm.engine, random.Random(0)
        total = 0
        for _ in range(p["requests"]):
            ids = [rng.randrange(32, 127) for _ in range(rng.randint(8, 64))]
            n = rng.randint(16, 64)
            engine.add_request(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            total += n
        running, saturated, start = [], [], time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.stats()
            running.append(stats.num_running)
            # requests still queue: the pool, not the workload, bounds the batch
            if stats.num_waiting:
                saturated.append(stats.num_running)
        seconds = time.perf_counter() - start
        res[mode] = dict(num_blocks=engine.block_allocator.num_blocks,
                         kv_bytes=llm.engine.runner.kv.nbytes,
                         peak_running=max(running), mean_running=statistics.mean(running),
                         saturated_running=statistics.mean(saturated) if saturated else None,
                         tok_s=total / seconds,
                         preemptions=engine.scheduler.num_preemptions)
    for row in res.values():
        row["blocks_vs_auto"] = row["num_blocks"] / res["auto"]["num_blocks"]
        row["peak_vs_auto"] = row["peak_running"] / res["auto"]["peak_running"]
        # None: the queue never backed up
        saturated = row["saturated_running"], res["auto"]["saturated_running"]
        row["saturated_vs_auto"] = saturated[0] / saturated[1] if None not in saturated else None
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "kv_quant_cpu.json"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    p = QUICK if args.quick else FULL
    res = dict(
        date=datetime.now().isoformat(timespec="seconds"), device=f"cpu ({platform.machine()})",
        threads=args.threads, torch=torch.__version__, workload=p,
        command="python benchmarks/bench_kv_quant.py" + (" --quick" if args.quick else ""),
        quality={},
    )
    models = ["demo"]
    stories = SHARED / "models" / "stories260K" / "stories260K.bin"
    if stories.is_file() and not args.quick:
        models.append(str(stories))
    print(f"{'model':12} {'kv_cache_dtype':15} {'NLL/token':>10} {'vs fp32':>8} "
          f"{'greedy agreement':>17}")
    for model in models:
        name = "demo" if model == "demo" else "stories260K"
        res["quality"][name] = q = quality(model, p)
        for mode, row in q.items():
            print(f"{name:12} {mode:15} {row['nll']:>10.4f} {row['nll_change']:>+8.2%} "
                  f"{row['greedy_agreement']:>17.1%}")
    res["int4_designs"] = designs = int4_designs(p)
    print(f"\n{'int4 design (demo)':26} {'bits/value':>10} {'NLL vs fp32':>12} {'K rel err':>10} "
          f"{'V rel err':>10}")
    for name, row in designs.items():
        print(f"{name:26} {row['bits_per_value']:>10.2f} {row['nll_change']:>+12.3%} "
              f"{row['k_rel_rms_error']:>10.4f} {row['v_rel_rms_error']:>10.4f}")
    res["capacity"] = cap = capacity(p)
    print(f"\n{'kv_cache_dtype':15} {'KV blocks':>10} {'running while queued':>21} "
          f"{'peak running':>13} {'mean running':>13} {'tok/s':>8}")
    for mode, row in cap.items():
        queued = "-" if row["saturated_running"] is None else \
            f"{row['saturated_running']:.1f} ({row['saturated_vs_auto']:.2f}x)"
        print(f"{mode:15} {row['num_blocks']:>10} {queued:>21} "
              f"{row['peak_running']:>13} {row['mean_running']:>13.1f} {row['tok_s']:>8.1f}")
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
