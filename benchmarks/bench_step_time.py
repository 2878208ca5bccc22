"""Where the time goes as the batch and the context grow: the time of one decode step, on CPU.

    python benchmarks/bench_step_time.py --label after --peers vllm               # this tree, and vLLM-CPU
    python benchmarks/bench_step_time.py --label before --nanoserve-rev 1a5a3a4   # a commit, for before/after
    python benchmarks/bench_step_time.py --label torch --attention-backend torch  # one backend of this tree
    python benchmarks/bench_step_time.py --quick --out X                          # tiny, nanoserve only (tested)

Each run adds its series under its label to the JSON (benchmarks/step_time_cpu.json by default: the
plot in notebooks/03_batching.ipynb reads it) and prints a table. Model: bench_peers.py's random
GPT-2 6 × 384 (vocab 50257, context 1024), fp32, --threads threads, greedy, EOS ignored, random
token ids.

Two sweeps: batch B ∈ {1, 4, 16, 64, 256} at prompt 256, and prompt C ∈ {64, 128, 256, 512, 960} at
B = 32. A point is B requests of C prompt tokens and 1 + K generated (K = 32).
- nanoserve (in this process): the engine is stepped by hand, with a token budget that holds every
  prompt (all prefills in one step: no request is decoding, or done, before the last one starts);
  once every request has its first token, each of the next K steps is a decode step over B rows at
  context C + 1 .. C + K, timed one by one; the point is their median.
- vLLM (its own venv, bench_peers' runner): its steps are not ours to time, so a point is
  (time to generate 1 + K tokens − time to generate 1) / K, each the median of --reps runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import bench_peers
from peer_protocol import Peer

HERE = Path(__file__).resolve().parent
BATCHES, CONTEXTS, K = (1, 4, 16, 64, 256), (64, 128, 256, 512, 960), 32
QUICK = dict(model="gpt2-tiny", batches=(1, 3), contexts=(8, 16), k=4, batch_at=2, context_at=8)


def points(q: bool):
    b_at, c_at = (QUICK["batch_at"], QUICK["context_at"]) if q else (32, 256)
    return ([("batch", b, c_at) for b in (QUICK["batches"] if q else BATCHES)]
            + [("context", b_at, c) for c in (QUICK["contexts"] if q else CONTEXTS)])


def prompts_for(batch: int, context: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]


def nanoserve_point(path, batch, context, k, threads, lora_requests=None, setup=None,
                    **llm_kwargs) -> dict:
    """`lora_requests`: one LoRARequest (or None) per request; `setup(llm)` runs once its requests
    are added."""
    from nanoserve import LLM, SamplingParams

    blocks = batch * (-(-(context + k + 1) // 16)) + 16
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=blocks, block_size=16,
              max_num_seqs=batch,
              # one prefill step
              max_num_batched_tokens=max(512, batch * context), enable_prefix_caching=False,
              **llm_kwargs)
    eng, vocab = llm.engine, llm.engine.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1 + k, ignore_eos=True)
    loras = lora_requests or [None] * batch
    ids = [
        eng.add_request(p, params, lora_request=r)
        for p, r in zip(prompts_for(batch, context, vocab), loras)
    ]
    if setup is not None:
        setup(llm)
    made = lambda: min(len(eng.requests[i].output.outputs[0].token_ids) for i in ids)  # noqa: E731
    while made() < 1:  # prefill (chunked under the token budget), untimed
        eng.step()
    times = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return {"step_ms": 1e3 * statistics.median(times), "steps": len(times),
            "step_ms_all": [round(1e3 * t, 3) for t in times]}


def vllm_point(path, batch, context, k, threads, cache, reps) -> dict:
    cfg = json.loads((Path(path) / "config.json").read_text())
    spec = {"model_dir": str(path), "ctx": cfg["n_positions"], "threads": threads,
            "prompts": prompts_for(batch, context, cfg["vocab_size"]),
            "max_tokens": [1 + k] * batch}
    peer = Peer("vllm", HERE, spec, cache)
    try:
        peer.run(n=min(batch, 4), cap=2)  # warm-up
        one = [peer.run(cap=1)["seconds"] for _ in range(reps)]
        full = [peer.run()["seconds"] for _ in range(reps)]
    finally:
        peer.close()
    return {"step_ms": 1e3 * (statistics.median(full) - statistics.median(one)) / k,
            "prefill_s": one, "total_s": full, "version": peer.info.get("version")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="after", help="the nanoserve series' name in the JSON")
    ap.add_argument("--nanoserve-rev", help="measure nanoserve as committed at this git revision")
    ap.add_argument("--peers", nargs="*", choices=["vllm"], default=[])
    ap.add_argument("--reps", type=int, default=3, help="vLLM: runs per point (medians)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention-backend",
                    help="nanoserve's attention backend (default: the CPU's default)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "step_time_cpu.json"))
    ap.add_argument("--cache-dir", default=str(HERE / ".peers_cache"))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    rev = bench_peers.use_nanoserve_rev(args.nanoserve_rev,
                                        cache) if args.nanoserve_rev else "working tree"
    path = bench_peers.model_dir(QUICK["model"] if args.quick else "gpt2-6x384", cache)
    k = QUICK["k"] if args.quick else K
    out = Path(args.out)
    res = (
        json.loads(out.read_text()) if out.exists()
        else {"benchmark": "decode step time on CPU", "series": {}}
    )
    res.update(model=str(path.name), k=k, threads=args.threads, cores=os.cpu_count(),
               torch=torch.__version__)
    series = {args.label: {"engine": "nanoserve", "rev": rev,
                           "attention_backend": args.attention_backend,
                           "malloc": bench_peers.malloc_of_this_process()},
              **{p: {"engine": p} for p in args.peers}}
    for name, s in series.items():
        s.update(
            date=datetime.now().isoformat(timespec="seconds"), loadavg_before=os.getloadavg()[0],
            command=" ".join(["python", "benchmarks/bench_step_time.py", *sys.argv[1:]]), points=[],
        )
        for sweep, b, c in points(args.quick):
            backend = (
                {"attention_backend": args.attention_backend} if args.attention_backend else {}
            )
            pt = (nanoserve_point(path, b, c, k, args.threads,
                                  **backend) if s["engine"] == "nanoserve"
                  else vllm_point(path, b, c, k, args.threads, cache, args.reps))
            s["points"].append({"sweep": sweep, "batch": b, "context": c, **pt})
            print(f"{name:<10}{sweep:<8} B={b:<4} C={c:<5}{pt['step_ms']:>9.2f} "
                  "ms/step", flush=True)
        s["loadavg_after"] = os.getloadavg()[0]
        res["series"][name] = s
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
