"""The engine over N ranks against one process: LLM(model, tensor_parallel_size=N) and
pipeline_parallel_size=N on this CPU (gloo).

    python benchmarks/bench_tp_engine.py                  # -> benchmarks/tp_engine_cpu.json, and a table
    python benchmarks/bench_tp_engine.py --quick --out X  # tiny, for the test that keeps it running

The demo model, 16 prompts of 32 token ids × 64 greedy tokens (EOS ignored), median of --reps after
a warm-up. Rank 0 is this process: one process runs 2 threads; with N = 2 each rank runs 1 (rank 0
set here, the worker by parallel/workers.py), so both use the machine's 2 cores, no more. Each row
also says whether its tokens are one process's, and counts the exchanges of one decode step of the
16 rows (tensor: the step's message, 2 collectives, then 2 all-reduces per block, the embedding's
and the logits' gather; pipeline: the message, then per micro-batch one send of activations and one
of logits). bench_tp.py times the sharded forward alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.tools.bench import text_table

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "tp_engine_cpu.json"))
    args = ap.parse_args()
    n, length, new, reps = (2, 8, 4, 1) if args.quick else (16, 32, 64, args.reps)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(length)] for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    rows, tokens = [], {}
    threads = torch.get_num_threads()
    blocks = LLM("demo").config.n_layers
    # 2 micro-batches of 8 rows
    exchanges = {"none": 0, "tensor": 2 + 2 * blocks + 2, "pipeline": 2 + 2 * 2}
    for split, world in (("none", 1), ("tensor", 2), ("pipeline", 2)):
        torch.set_num_threads(max(1, threads // world))
        llm = LLM("demo", dtype="float32", **{f"{split}_parallel_size": world} if world > 1 else {})
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        tokens[split] = [o.outputs[0].token_ids for o in outs]
        rows.append(dict(split=split, ranks=world, threads_per_rank=torch.get_num_threads(),
                         exchanges_per_decode_step=exchanges[split],
                         seconds=statistics.median(times),
                         out_tokens_per_s=n * new / statistics.median(times),
                         same_tokens_as_one_process=tokens[split] == tokens["none"]))
        del llm, outs
        gc.collect()  # the workers stop with their engine
    torch.set_num_threads(threads)
    for r in rows:
        r["slowdown"] = r["seconds"] / rows[0]["seconds"]
    res = {"benchmark": "the engine over N ranks", "model": "demo", "prompts": n,
           "prompt_len": length,
           "max_tokens": new, "reps": reps, "rows": rows, "date": date.today().isoformat(),
           "torch": torch.__version__,
           "device": f"CPU ({platform.machine()}), {threads} threads in all",
           "command": "python benchmarks/bench_tp_engine.py" + (" --quick" if args.quick else "")}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(text_table(rows,
                     ["split", "ranks", "threads_per_rank", "exchanges_per_decode_step", "seconds",
                            "out_tokens_per_s", "slowdown", "same_tokens_as_one_process"]))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
