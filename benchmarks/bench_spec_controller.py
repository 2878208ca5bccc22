"""The speculative controller that measures its cost, against the target alone and the old pinned
controller.

    python benchmarks/bench_spec_controller.py [--prompts 6] [--max-tokens 80] [--reps 9]

Batch 1, greedy (the tokens are the target's in every row, so only time differs), 6 prompts × 80
tokens (the demo's context is 128), the demo model as target. Drafts: demo-draft (trained, 11×
smaller), and a *useless* draft: demo-draft's shape and tokenizer with random weights (α ≈ 0).
Controllers: `measured` (the default: c and v timed on the engine's own steps, spec/controller.py)
and `pinned` at the parameter ratio (what the controller assumed before: c = 0.09, v = 1). Each
row's seconds are the median of `reps` runs after a warm-up, interleaved with the target alone's;
the speedup is the median over reps of target seconds / row seconds in the same rep (spec_steps and
tokens count the last rep). The goal (issue 25): with the useless draft the
measured controller switches off and stays ≥ 0.95× the target.
Saves benchmarks/spec_controller_cpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
from datetime import date
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nanoserve import LLM, SamplingParams
from nanoserve.models.loader import resolve_model_path
from nanoserve.tools.bench import SPEC_PROMPTS, _timed_generate, text_table

HERE = Path(__file__).resolve().parent


def useless_draft(where: Path) -> Path:
    """demo-draft's files with every weight redrawn (normal, the tensor's own std; norms kept): same
    shape, same tokenizer, nothing learned."""
    src = Path(resolve_model_path("demo-draft"))
    dst = where / "useless-draft"
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(0)
    weights = load_file(str(src / "model.safetensors"))
    for name, w in weights.items():
        if w.dim() >= 2:
            weights[name] = (torch.randn(w.shape, generator=g) * w.float().std()).to(w.dtype)
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=str(HERE / "spec_controller_cpu.json"))
    args = ap.parse_args()
    prompts = list(SPEC_PROMPTS[: args.prompts])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        drafts = {"demo-draft": "demo-draft", "useless": str(useless_draft(Path(tmp)))}
        engines = {"target alone": LLM("demo")}
        for name, path in drafts.items():
            for ctl, cost in (("measured", None), ("pinned 0.09", 0.09)):
                engines[f"{name}, {ctl}"] = LLM("demo", speculative_model=path,
                                                num_speculative_tokens=4,
                                                speculative_cost=cost)
        times = {k: [] for k in engines}
        outs = {}
        for llm in engines.values():
            # warm-up; the controller's first estimates
            _timed_generate(llm, prompts[:1], params, repeats=1)
        for _ in range(args.reps):
            for name, llm in engines.items():
                seconds, outs[name] = _timed_generate(llm, prompts, params, repeats=1)  # batch 1
                times[name].append(seconds)
        rows = []
        for name, llm in engines.items():
            stats = [o.spec_stats for o in outs[name]]
            stats = [s for s in stats if s is not None]
            steps = sum(s.num_steps for s in stats)
            emitted = sum(s.num_emitted_tokens for s in stats)
            total = sum(len(o.token_ids) for o in outs[name])
            same = [o.token_ids for o in outs[name]] == [o.token_ids for o in outs["target alone"]]
            costs = (
                llm.engine.spec.controller.costs.as_dict() if llm.engine.spec is not None else {}
            )
            # per rep: drift cancels
            paired = [t / x for t, x in zip(times["target alone"], times[name])]
            rows.append(dict(engine=name, seconds=statistics.median(times[name]), runs=times[name],
                             speedup=statistics.median(paired),
                             speedup_range=[min(paired), max(paired)],
                             spec_steps=steps,
                             tokens_from_spec_steps=emitted, tokens=total,
                             same_tokens_as_target=same,
                             draft_cost_c=costs.get("draft_cost"),
                             verify_cost_v=costs.get("verify_cost")))
    res = {"benchmark": "spec_controller", "prompts": len(prompts), "max_tokens": args.max_tokens,
           "reps": args.reps,
           "gamma": 4, "rows": rows, "date": date.today().isoformat(), "torch": torch.__version__,
           "device": f"CPU ({platform.machine()}), {torch.get_num_threads()} threads",
           "goal": "useless draft, measured controller: >= 0.95x the target alone"}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    cols = ["engine", "seconds", "speedup", "spec_steps", "tokens_from_spec_steps", "tokens",
            "draft_cost_c",
            "verify_cost_v", "same_tokens_as_target"]
    print(text_table(rows, cols))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
