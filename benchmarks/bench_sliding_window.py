"""KV blocks held and throughput on long generations, a sliding window's blocks given back vs kept.

    python benchmarks/bench_sliding_window.py                  # the full run (a few minutes on 2 CPU cores)
    python benchmarks/bench_sliding_window.py --quick --out X  # tiny (tested)

Model: a random Mistral (transformers' MistralConfig, saved offline): hidden 256, 4 layers, 8 heads
over 4 kv heads, vocab 4096, a window of 128 in every layer, fp32. Workload: --n requests of 16
random prompt tokens each generating --tokens tokens (greedy, EOS ignored), all submitted at once,
block size 16.
Three engines on the same weights:
- `freed` (the default): blocks out of every layer's window go back to the pool
  (BlockAllocator.free_out_of_window), and attention gathers only the blocks the window reaches
  (torch_backend.CacheView._window_tables);
- `kept`: the allocator's window switched off, every block stays (the same windowed gather);
- `whole table`: blocks freed, but every row's whole table gathered (the gather before the windowed
  one).
Per engine: the most KV blocks held at once and per sequence, output tok/s (median of --reps), and
whether the tokens are the same. Interleaved runs; JSON in benchmarks/sliding_window_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
FULL = dict(hidden=256, layers=4, vocab=4096, window=128, n=8, tokens=1024, reps=3)
QUICK = dict(hidden=32, layers=2, vocab=257, window=8, n=2, tokens=40, reps=1)


def make_model(path: Path, p: dict) -> Path:
    import torch
    import transformers

    from nanoserve.tokenizers import byte_level_tokenizer, save_tiktoken

    cfg = transformers.MistralConfig(hidden_size=p["hidden"], intermediate_size=4 * p["hidden"],
                                     num_hidden_layers=p["layers"], num_attention_heads=8,
                                     num_key_value_heads=4,
                                     vocab_size=p["vocab"], max_position_embeddings=4096,
                                     sliding_window=p["window"],
                                     pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    if p["vocab"] == 257:  # (a bigger vocabulary: no tokenizer, token ids only)
        save_tiktoken(byte_level_tokenizer(), path)
    return path


def run(path: Path, name: str, p: dict, seed: int = 0) -> dict:
    import random

    from nanoserve import LLM
    from nanoserve.kv.torch_backend import CacheView

    windowed = CacheView._window_tables
    if name == "whole table":  # the gather of every row's whole table, as before the windowed one
        CacheView._window_tables = lambda self, window, positions: None
    try:
        llm = LLM(str(path), dtype="float32", device="cpu", block_size=16, max_num_seqs=p["n"])
        if name == "kept":
            llm.block_allocator.sliding_window = None
        return generate(llm, p, random.Random(seed))
    finally:
        CacheView._window_tables = windowed


def generate(llm, p: dict, rng) -> dict:
    """Submit every request at once, step to the end; blocks held (most at once, most per sequence),
    tok/s, tokens."""
    from nanoserve import SamplingParams

    engine, bm = llm.engine, llm.block_allocator
    params = SamplingParams(temperature=0, max_tokens=p["tokens"], ignore_eos=True)
    ids = [engine.add_request([rng.randrange(p["vocab"]) for _ in range(16)],
                              params) for _ in range(p["n"])]
    most, most_per_seq, outs, start = 0, 0, {}, time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        most = max(most, bm.num_blocks - bm.num_free_blocks())
        most_per_seq = max(
            [most_per_seq] + [sum(b >= 0 for b in s.block_table) for s in engine.scheduler.running]
        )
    seconds = time.perf_counter() - start
    return dict(blocks_held=most, blocks_per_seq=most_per_seq, tok_s=p["n"] * p["tokens"] / seconds,
                tokens=[outs[i] for i in ids])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "sliding_window_cpu.json"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    p = QUICK if args.quick else FULL
    runs = {"freed": [], "kept": [], "whole table": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "mistral", p)
        for _ in range(p["reps"]):  # interleaved
            for name in runs:
                runs[name].append(run(path, name, p))
    res = dict(date=datetime.now().isoformat(timespec="seconds"),
               device=f"cpu ({platform.machine()})",
               threads=args.threads, torch=torch.__version__, workload=p, block_size=16,
               command="python "
                       "benchmarks/bench_sliding_window.py" + (" --quick" if args.quick else ""),
               same_tokens=runs["freed"][0]["tokens"] == runs["kept"][0]["tokens"] == runs["whole table"][0]["tokens"],
               bound_per_seq=-(-p["window"] // 16) + 1, engines={})
    print(f"{'engine':12} {'blocks held (max)':>18} {'per sequence':>13} {'output tok/s':>13}")
    for name, rs in runs.items():
        row = dict(blocks_held=max(r["blocks_held"] for r in rs),
                   blocks_per_seq=max(r["blocks_per_seq"] for r in rs),
                   tok_s=statistics.median(r["tok_s"] for r in rs),
                   tok_s_runs=[round(r["tok_s"], 1) for r in rs])
        res["engines"][name] = row
        print(f"{name:12} {row['blocks_held']:>18} {row['blocks_per_seq']:>13} "
              f"{row['tok_s']:>13.1f}")
    f, k, w = res["engines"]["freed"], res["engines"]["kept"], res["engines"]["whole table"]
    res["ratios"] = dict(blocks=k["blocks_held"] / f["blocks_held"], tok_s=f["tok_s"] / k["tok_s"],
                         windowed_gather=f["tok_s"] / w["tok_s"])
    print(f"kept / freed blocks: {res['ratios']['blocks']:.1f}×; freed / kept tok/s: "
          f"{res['ratios']['tok_s']:.2f}; windowed / whole-table gather tok/s: "
          f"{res['ratios']['windowed_gather']:.2f}; same tokens: {res['same_tokens']}; bound per "
          f"sequence ⌈window / 16⌉ + 1 = {res['bound_per_seq']}")
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
