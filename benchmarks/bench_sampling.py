"""Batched sampling vs one call per row: the engine's `sample_batch` against `sample_next` in a
loop.

    python benchmarks/bench_sampling.py [--batch 64] [--reps 30]

One engine step at batch B samples B rows. Per row (`sample_next`), each call ends in `int(...)`,
one device→host transfer per row; `sample_batch` does every row's work as batched tensor ops and
transfers once. Workloads: vocabularies of 257 (the demo models) and 32,000 (Llama-2), and four
mixes of settings (all greedy; all temperature 0.8 with a seed each; top-k 40 + top-p 0.9 with a
seed each; a quarter of each kind plus repetition penalty 1.2). Both sides draw the same tokens
(tests/test_sampling.py); the timings are medians over `reps` runs, interleaved. On a CPU there
is no transfer to save, so this measures the Python and per-op overhead only; on a GPU each
saved sync is a stall of the whole device. Saves benchmarks/sampling_cpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from nanoserve.engine.sampler import SamplingParams, make_generator, sample_batch, sample_next

HERE = Path(__file__).resolve().parent


def mixes(batch: int) -> dict[str, list[SamplingParams]]:
    seeded = lambda **kw: [SamplingParams(seed=i, **kw) for i in range(batch)]  # noqa: E731
    quarter = batch // 4
    mixed = ([SamplingParams(temperature=0)] * quarter + seeded(temperature=0.8)[:quarter]
             + seeded(top_k=40, top_p=0.9)[:quarter]
             + seeded(temperature=0.7, repetition_penalty=1.2)[:batch - 3 * quarter])
    return {"greedy": [SamplingParams(temperature=0)] * batch,
            "temperature": seeded(temperature=0.8),
            "top-k + top-p": seeded(top_k=40, top_p=0.9), "mixed + penalty": mixed}


def time_both(logits, params, seen, reps: int) -> tuple[float, float, bool]:
    def per_row():
        gens = [make_generator(p.seed) for p in params]
        return [sample_next(row, p, s, g) for row, p, s, g in zip(logits, params, seen, gens)]

    def batched():
        gens = [make_generator(p.seed) for p in params]
        return sample_batch(logits, params, seen, gens)[0]

    same = per_row() == batched()
    t_row, t_batch = [], []
    for _ in range(reps):  # interleaved, so drift on a busy machine hits both alike
        for fn, out in ((per_row, t_row), (batched, t_batch)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(t_row), statistics.median(t_batch), same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=str(HERE / "sampling_cpu.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for vocab in (257, 32000):
        logits = torch.randn(args.batch, vocab) * 3
        seen = [torch.randint(0, vocab, (64,)) for _ in range(args.batch)]
        for name, params in mixes(args.batch).items():
            row_s, batch_s, same = time_both(logits, params, seen, args.reps)
            rows.append(dict(vocab=vocab, mix=name, batch=args.batch, per_row_ms=1e3 * row_s,
                             batched_ms=1e3 * batch_s, speedup=row_s / batch_s, same_tokens=same))
    result = dict(device=f"cpu ({platform.processor() or platform.machine()}), "
                         f"{torch.get_num_threads()} threads",
                  torch=torch.__version__, date=str(date.today()),
                  command=f"python benchmarks/bench_sampling.py --batch {args.batch} --reps "
                          f"{args.reps}", rows=rows)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['device']}, torch {result['torch']}, batch {args.batch}, median of {args.reps}")
    print(f"{'vocab':>6} {'mix':<16} {'per row (ms)':>13} {'batched (ms)':>13} {'speed-up':>9} "
          f"{'same tokens':>12}")
    for r in rows:
        print(f"{r['vocab']:>6} {r['mix']:<16} {r['per_row_ms']:>13.2f} {r['batched_ms']:>13.2f} "
              f"{r['speedup']:>8.1f}x {str(r['same_tokens']):>12}")


if __name__ == "__main__":
    main()
