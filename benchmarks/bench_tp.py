"""Tensor parallelism on this CPU: a forward on 1 process against the same model split over 2
(gloo).

    python benchmarks/bench_tp.py                  # -> benchmarks/tp_cpu.json, and a table
    python benchmarks/bench_tp.py --quick --out X  # tiny, for the test that keeps it running

Model: bench_peers.py's random GPT-2 6 × 384 (vocab 50257, padded to 50258 over 2 ranks), fp32. A
point is a full forward (no KV cache: the sharded engine is not built yet) of T tokens, T = 1 (a
decode step's arithmetic, without the history) and T = 128 (a prefill), the median of --reps after a
warm-up. The machine has 2 cores: one process gets 2 threads, each of 2 processes 1, so both runs
use the whole machine.
Communication: every all-reduce and all-gather is wrapped to count its bytes and time. Computed per
token and rank: an all-reduce of the embedding and 2 per block of C floats, and an all-gather of
⌈V/N⌉ logits from each of the N ranks: ((1 + 2L)·C + N·⌈V/N⌉)·4 bytes.
Expected: TP = 2 slower here. Splitting a layer halves each rank's arithmetic but not the machine's
(the same 2 cores do it), and adds the exchanges, which on one host are memory copies through gloo's
TCP loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


def _worker(rank, world, path, tokens, reps, out):
    """One rank (launch.spawn_ranks owns the gloo group)."""
    from nanoserve.models.loader import load_model
    from nanoserve.parallel.tensor_parallel import shard_model

    comm = {"bytes": 0, "seconds": 0.0, "calls": 0}
    for name in ("all_reduce", "all_gather"):
        op = getattr(dist, name)

        def counted(x, *args, _op=op, _name=name, **kw):
            t = time.perf_counter()
            r = _op(x, *args, **kw)
            comm["seconds"] += time.perf_counter() - t
            comm["calls"] += 1
            if _name == "all_reduce":  # the reduced tensor
                comm["bytes"] += x.numel() * x.element_size()
            else:  # all_gather(parts, local): every rank's part
                comm["bytes"] += len(x) * args[0].numel() * args[0].element_size()
            return r
        setattr(dist, name, counted)
    model = load_model(path, dtype="float32", device="cpu")[0]
    if world > 1:
        shard_model(model, rank, world)
    res = {}
    with torch.no_grad():
        for T in tokens:
            x = torch.randint(0, model.config.vocab_size, (1, T),
                              generator=torch.Generator().manual_seed(T))
            model(x)  # warm-up
            times, before = [], dict(comm)
            for _ in range(reps):
                dist.barrier()
                t = time.perf_counter()
                model(x)
                times.append(time.perf_counter() - t)
            res[T] = {"ms": 1e3 * statistics.median(times),
                      "comm_bytes_per_token": (comm["bytes"] - before["bytes"]) / reps / T,
                      "comm_ms": 1e3 * (comm["seconds"] - before["seconds"]) / reps,
                      "comm_calls": (comm["calls"] - before["calls"]) / reps}
    if rank == 0:
        Path(out).write_text(json.dumps(res))


def main() -> None:
    import bench_peers

    from nanoserve.parallel.launch import spawn_ranks

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=str(HERE / "tp_cpu.json"))
    ap.add_argument("--cache-dir", default=str(HERE / ".peers_cache"))
    args = ap.parse_args()
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    path = bench_peers.model_dir("gpt2-tiny" if args.quick else "gpt2-6x384", cache)
    cfg = json.loads((path / "config.json").read_text())
    C, L, V = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    tokens, reps = ((1, 8), 2) if args.quick else ((1, 128), args.reps)
    rows = []
    for world in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "res.json")
            spawn_ranks(_worker, world, str(path), tokens, reps, out, threads=max(1, 2 // world))
            res = json.loads(Path(out).read_text())
        for T in tokens:
            r = res[str(T)]
            computed = 0 if world == 1 else ((1 + 2 * L) * C + world * -(-V // world)) * 4
            rows.append({"tp": world, "tokens": T, "forward_ms": r["ms"], "comm_ms": r["comm_ms"],
                         "comm_bytes_per_token_measured": r["comm_bytes_per_token"],
                         "comm_bytes_per_token_computed": computed, "comm_calls": r["comm_calls"]})
    base = {r["tokens"]: r["forward_ms"] for r in rows if r["tp"] == 1}
    result = {"benchmark": "tensor parallelism on CPU (gloo)", "model": path.name, "hidden": C,
              "layers": L,
              "vocab": V, "cores": os.cpu_count(), "torch": torch.__version__, "reps": reps,
              "date": datetime.now().isoformat(timespec="seconds"), "rows": rows,
              "command": " ".join(["python", "benchmarks/bench_tp.py", *sys.argv[1:]])}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{'TP':>3}{'T':>6}{'forward ms':>12}{'÷ TP=1':>8}{'comm ms':>9}{'comm B/token (measured)':>25}"
        f"{'(computed)':>12}"
    )
    for r in rows:
        print(
            f"{r['tp']:>3}{r['tokens']:>6}{r['forward_ms']:>12.2f}{r['forward_ms'] / base[r['tokens']]:>7.2f}×"
            f"{r['comm_ms']:>9.2f}{r['comm_bytes_per_token_measured']:>25.0f}{r['comm_bytes_per_token_computed']:>12}"
        )
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
