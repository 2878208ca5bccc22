"""A few rows through a linear layer on the CPU: MKL (F.linear) against oneDNN with a prepacked
weight.

    python benchmarks/bench_cpu_linear.py [--reps 200] [--rows 1 2 3 4]

Where GEMV_MAX_BYTES and GEMV_MAX_ROWS in nanoserve/models/onednn.py come from. A single-stream
decode step multiplies one row by every weight of the model, in order; each weight is read from
memory once per token. The shapes: GPT-2 6 x 384's four layer linears (in the order a block calls
them, six times over) and its LM head (50257 x 384), then larger ones (Qwen2-0.5B's, Llama's
4096-wide layers, the 32000- and 151936-row heads). Every pass runs all shapes of a group in order,
once with each library (alternating which goes first), and times each call; the medians over `reps`
passes are reported with the read speed they imply (weight bytes / time). Saves
benchmarks/cpu_linear.json and prints a table.

    python benchmarks/bench_cpu_linear.py --engine-rounds 6 --out benchmarks/cpu_linear_epyc.json

adds the engine's view: greedy decoding on a random GPT-2 6 x 384 (1 and 3 sequences, 128 tokens
each), with the few-rows rule at 3 rows (MKL) and at 0 (oneDNN for every shape), alternating round
by round in one process; output tokens/s per round, their medians and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.models.onednn import (
    GEMV_MAX_BYTES,
    GEMV_MAX_ROWS,
    OneDNNLinear,
    cpu_vendor,
    onednn_linear,
)

HERE = Path(__file__).resolve().parent
GROUPS = {  # (out, in) in the order one forward reads them
    "gpt2-6x384": [(1152, 384), (384, 384), (1536, 384), (384, 1536)] * 6 + [(50257, 384)],
    "larger": [(896, 896), (4864, 896), (4096, 1024), (1024, 4096), (4096, 4096), (11008, 4096),
               (32000, 512),
               (151936, 896)],
}


def measure(shapes, rows: int, reps: int) -> dict:
    torch.manual_seed(0)
    layers = {s: OneDNNLinear.from_linear(nn.Linear(s[1], s[0])) for s in dict.fromkeys(shapes)}
    xs = {s: torch.randn(rows, s[1]) for s in layers}
    impls = {"mkl": lambda m, x: F.linear(x, m.weight, m.bias),
             "onednn": lambda m, x: onednn_linear(x, m.packed_weight(), m.bias)}
    times = defaultdict(list)
    with torch.inference_mode():
        for r in range(reps):
            for name in (("mkl", "onednn") if r % 2 else ("onednn", "mkl")):
                for s in shapes:
                    t = time.perf_counter()
                    impls[name](layers[s], xs[s])
                    times[name, s].append(time.perf_counter() - t)
    out = {}
    for s in layers:
        mb = s[0] * s[1] * 4 / 1e6
        med = {name: statistics.median(times[name, s]) * 1e6 for name in impls}  # µs per call
        out[f"{s[0]}x{s[1]}"] = {"weight_mb": mb, **{f"{n}_us": v for n, v in med.items()},
                                 **{f"{n}_gb_s": mb / v * 1e3 for n, v in med.items()},
                                 "calls_per_pass": shapes.count(s)}
    return out


def engine_pairs(rounds: int) -> dict:
    """Output tokens/s of greedy decoding with GEMV_MAX_ROWS = 3 and = 0, alternating each round."""
    import tempfile

    from bench_peers import model_dir

    from nanoserve import LLM, SamplingParams
    from nanoserve.models import onednn

    llm = LLM(str(model_dir("gpt2-6x384", Path(tempfile.gettempdir()) / "nanoserve-bench")))
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, detokenize=False)
    out = {}
    for n in (1, 3):
        prompts = [[11 + i] * 16 for i in range(n)]
        tok_s = {3: [], 0: []}
        for r in range(rounds):
            for rule in ((3, 0) if r % 2 else (0, 3)):
                onednn.GEMV_MAX_ROWS = rule
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                tok_s[rule].append(n * 128 / (time.perf_counter() - start))
        med = {rule: statistics.median(v) for rule, v in tok_s.items()}
        out[f"{n}_seq"] = {"mkl_3_rows_tok_s": tok_s[3], "onednn_only_tok_s": tok_s[0],
                           "median_mkl_3_rows": med[3], "median_onednn_only": med[0],
                           "onednn_only_over_mkl": med[0] / med[3]}
        print(f"engine, {n} sequence(s): MKL for ≤ 3 rows {med[3]:.1f} tok/s, oneDNN only "
              f"{med[0]:.1f} tok/s ({med[0] / med[3]:.2f}x)")
    return out


def cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    names = (
        [
            ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines()
            if ln.startswith("model name")
        ]
        if info.exists()
        else []
    )
    return f"{platform.machine()}, {names[0] if names else platform.processor()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "cpu_linear.json"))
    ap.add_argument("--engine-rounds", type=int, default=0,
                    help="also the engine, this many paired rounds")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"benchmark": "one row through a linear layer: MKL GEMV vs oneDNN (prepacked)",
              "date": str(date.today()),
              "machine": {"cpu": cpu_name(), "threads": args.threads,
                          "loadavg_before": os.getloadavg()},
              "torch": torch.__version__, "gemv_max_bytes": GEMV_MAX_BYTES, "reps": args.reps,
              "groups": {}}
    print(
        f"{'group':<11}{'rows':>5}  {'weight':>12}{'MB':>8}{'MKL µs':>10}{'oneDNN µs':>11}{'MKL GB/s':>10}"
        f"{'oneDNN GB/s':>13}  faster"
    )
    for group, shapes in GROUPS.items():
        for rows in args.rows:
            res = measure(shapes, rows,
                          args.reps if group == "gpt2-6x384" else max(args.reps // 5, 5))
            result["groups"][f"{group}/{rows}"] = res
            for name, d in res.items():
                faster = "MKL" if d["mkl_us"] < d["onednn_us"] else "oneDNN"
                print(
                    f"{group:<11}{rows:>5}  {name:>12}{d['weight_mb']:>8.1f}{d['mkl_us']:>10.1f}"
                    f"{d['onednn_us']:>11.1f}{d['mkl_gb_s']:>10.1f}{d['onednn_gb_s']:>13.1f}  {faster}"
                )
    gpt2 = result["groups"].get("gpt2-6x384/1")
    if gpt2 is None:  # (no one-row run: no summary)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return print(f"saved {args.out}")
    per_pass = {
        n: sum(d[f"{n}_us"] * d["calls_per_pass"] for d in gpt2.values()) / 1e3
        for n in ("mkl", "onednn")
    }
    # the Intel rule
    rule = sum(d["mkl_us"] if d["weight_mb"] * 1e6 < GEMV_MAX_BYTES else d["onednn_us"]
               for d in gpt2.values() for _ in range(d["calls_per_pass"])) / 1e3
    result["gpt2_one_token_ms"] = {**per_pass, "rule": rule}
    result["vendor"], result["gemv_max_rows"] = cpu_vendor(), GEMV_MAX_ROWS
    if args.engine_rounds:
        result["engine"] = engine_pairs(args.engine_rounds)
    result["machine"]["loadavg_after"] = os.getloadavg()
    print(f"GPT-2 6x384, one row, all 25 linears: MKL {per_pass['mkl']:.2f} ms, oneDNN "
          f"{per_pass['onednn']:.2f} ms, the Intel rule (MKL for up to 3 rows under "
          f"{GEMV_MAX_BYTES >> 20} MB) {rule:.2f} ms")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
