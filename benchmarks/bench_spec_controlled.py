"""Speculative decoding at controlled acceptance rates, on the CPU: what the machinery gains or
costs at a given α, against plain greedy decoding in the same run.

    python benchmarks/bench_spec_controlled.py [--out benchmarks/spec_controlled_cpu.json]

The proposer is nanoserve/tools/controlled_draft.py: the target's own greedy continuation, recorded
in a first plain run, each drafted token kept with probability α (0: a useless draft). Drafting
costs nothing, so a row measures verification and acceptance alone: γ + 1 tokens a row in one
forward, the sampler's comparison, the KV rollback. The demo model (GPT-2 6 × 256, fp32), batch 1,
4 prompts × 96 new tokens, γ = 4 fixed and adaptive; each row times the plain engine and the
speculative one in turns, 5 runs each (the median), so the machine's slow spells fall on both.
Saves JSON and prints a table (speedup = plain seconds / speculative seconds).
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

from nanoserve import LLM, SamplingParams
from nanoserve.tools.bench import SPEC_PROMPTS
from nanoserve.tools.controlled_draft import record_continuations, use_controlled_draft

HERE = Path(__file__).resolve().parent
ALPHAS = (0.9, 0.8, 0.6, 0.0)
NEW_TOKENS = 96  # a request's tokens
REPS = 5  # timed runs of each engine, in turns
GAMMA = 4


def _timed(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]  # batch 1
    return time.perf_counter() - start, outs


def _paired(plain, llm, prompts) -> tuple[float, float, list]:
    """Median seconds of the plain engine and of `llm` over REPS runs taken in turns (so a slow
    spell of the machine slows both), and `llm`'s last outputs."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([prompts[0]], params, use_tqdm=False)  # warm-up
    plain_times, times = [], []
    for _ in range(REPS):
        plain_times.append(_timed(plain, prompts, params)[0])
        seconds, outs = _timed(llm, prompts, params)
        times.append(seconds)
    return statistics.median(plain_times), statistics.median(times), outs


def _row(alpha, adaptive, plain_s, seconds, outs) -> dict:
    stats = [o.spec_stats for o in outs if o.spec_stats is not None]  # None: never speculated
    accepted = sum(s.num_accepted_tokens for s in stats)
    checked = accepted + sum(s.num_rejections for s in stats)
    steps = sum(s.num_steps for s in stats)
    emitted = sum(s.num_emitted_tokens for s in stats)
    return {"alpha_set": alpha, "adaptive": adaptive, "plain_seconds": plain_s,
            "seconds": seconds, "speedup": plain_s / seconds,
            "alpha_measured": accepted / checked if checked else None,
            "verification_steps": steps,
            "tokens_per_step": emitted / steps if steps else None}


def run() -> dict:
    torch.manual_seed(0)
    plain = LLM("demo", dtype="float32")
    prompts = [plain.engine.tokenizer.encode(p) for p in SPEC_PROMPTS[:4]]
    recorded = record_continuations(plain, prompts, NEW_TOKENS)
    rows = []
    for adaptive in (False, True):
        llm = LLM("demo", dtype="float32", speculative="ngram", num_speculative_tokens=GAMMA,
                  speculative_adaptive=adaptive)
        for alpha in ALPHAS:
            use_controlled_draft(llm, recorded, alpha)
            rows.append(_row(alpha, adaptive, *_paired(plain, llm, prompts)))
    return {"gamma": GAMMA, "new_tokens": NEW_TOKENS, "prompts": len(prompts), "reps": REPS,
            "rows": rows}


def table(result: dict) -> str:
    lines = [f"{'alpha':>6}{'adaptive':>10}{'measured':>10}{'tok/step':>10}{'plain s':>9}"
             f"{'spec s':>9}{'speedup':>9}"]
    for r in result["rows"]:
        measured = "-" if r["alpha_measured"] is None else f"{r['alpha_measured']:.2f}"
        per_step = "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
        lines.append(f"{r['alpha_set']:>6.1f}{str(r['adaptive']):>10}{measured:>10}"
                     f"{per_step:>10}{r['plain_seconds']:>9.3f}{r['seconds']:>9.3f}"
                     f"{r['speedup']:>8.2f}×")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "spec_controlled_cpu.json"))
    args = ap.parse_args()
    result = run()
    record = {"date": date.today().isoformat(),
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads(),
              "command": "python benchmarks/bench_spec_controlled.py", **result}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(table(result))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
