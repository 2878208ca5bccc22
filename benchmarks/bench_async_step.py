"""The host's share of a decode step, and what async scheduling does to it on this machine.

    python benchmarks/bench_async_step.py                 # benchmarks/async_step_cpu.json + a table
    python benchmarks/bench_async_step.py --quick --out X # tiny (tested)

For each batch size B, B greedy requests (random byte-level prompts, EOS ignored) run to the end
twice in this process: with the synchronous step and with async scheduling (engine/async_step.py).
Each steady decode step (every row decoding) is timed, and so is the forward inside it
(`ModelRunner.execute`); the rest of the step is the host's work: scheduling, building the inputs,
sampling, emitting the text. On a GPU that work is what async scheduling runs under the device's
(the GPU figure: `gpu_check.py` figure j). On a CPU torch runs each operation before it returns, so
nothing can overlap: the two modes should take the same time, and the tokens must be the same.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime
from pathlib import Path

import torch

from nanoserve import SamplingParams
from nanoserve.engine.llm_engine import LLMEngine

HERE = Path(__file__).resolve().parent


def run(batch: int, prompt_len: int, new_tokens: int, overlap: bool, model: str) -> dict:
    """One batch to the end: the median steady step and forward times, and the token ids."""
    blocks = batch * (-(-(prompt_len + new_tokens) // 16) + 1)  # room for all: no preemption
    engine = LLMEngine.from_kwargs(model, max_num_seqs=batch, async_scheduling=overlap,
                                   max_num_batched_tokens=max(512, batch * prompt_len),
                                   num_blocks=blocks, block_size=16)
    forward_s: list[float] = []
    execute = engine.runner.execute

    def timed(inputs):
        start = time.perf_counter()
        logits = execute(inputs)
        forward_s.append(time.perf_counter() - start)
        return logits

    engine.runner.execute = timed
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(32, 127, (prompt_len,), generator=g).tolist()
        engine.add_request(prompt, params, request_id=str(i))
    steps, outs = [], {}
    while engine.has_unfinished_requests():
        decoding = all(s.num_computed_tokens == len(s) - 1 for s in engine.scheduler.running)
        full = len(engine.scheduler.running) == batch and decoding
        forward_s.clear()
        start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        if full and len(forward_s) == 1:  # a steady decode step: one forward over every row
            steps.append((time.perf_counter() - start, forward_s[0]))
    steady = steps[2:]  # the first ones still warm up
    step_ms = 1e3 * statistics.median(s for s, _ in steady)
    forward_ms = 1e3 * statistics.median(f for _, f in steady)
    return {"batch": batch, "mode": "async" if overlap else "sync", "steady_steps": len(steady),
            "step_ms": step_ms, "forward_ms": forward_ms, "host_ms": step_ms - forward_ms,
            "host_share": 1 - forward_ms / step_ms,
            "token_ids": [outs[str(i)].outputs[0].token_ids for i in range(batch)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the test runs this)")
    ap.add_argument("--out", type=Path, default=HERE / "async_step_cpu.json")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches, prompt_len, new_tokens = ((1, 3), 8, 8) if args.quick else ((1, 8, 32), 64, 48)
    rows = []
    for batch in batches:
        pair = [run(batch, prompt_len, new_tokens, overlap, "demo") for overlap in (False, True)]
        same = pair[0].pop("token_ids") == pair[1].pop("token_ids")
        for row in pair:
            row["same_tokens"] = same
            row["async_vs_sync"] = pair[0]["step_ms"] / row["step_ms"]
        rows += pair
    command = "python benchmarks/bench_async_step.py" + (" --quick" if args.quick else "")
    result = {"date": datetime.now().isoformat(timespec="seconds"), "command": command,
              "machine": platform.processor() or platform.machine(), "threads": args.threads,
              "torch": torch.__version__, "model": "demo", "prompt_tokens": prompt_len,
              "new_tokens": new_tokens, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    cols = ["batch", "mode", "steady_steps", "step_ms", "forward_ms", "host_ms", "host_share",
            "async_vs_sync", "same_tokens"]
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c])
                         for c in cols))


if __name__ == "__main__":
    main()
