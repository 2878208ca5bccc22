"""Speculative decoding by proposer: a draft model, n-gram lookup, Medusa heads and EAGLE's head,
against the target alone.

    python benchmarks/bench_spec_methods.py [--reps 5] [--out benchmarks/spec_methods_cpu.json]
    python benchmarks/bench_spec_methods.py --quick --out X   # tiny, for the test that keeps it running

The demo model as target, batch 1, greedy (every row's tokens are the target's: only time differs),
the six prompts of `nanoserve bench speculative` × 80 tokens. Proposers: demo-draft (a trained model
11× smaller, its own paged cache), n-gram lookup (prompt lookup, no model), Medusa heads (3 heads
trained on the demo's own samples by tools/train_medusa.py, cached under benchmarks/.peers_cache).
Each at a fixed γ (3: the heads' count) with the controller off, which shows what the proposer is
worth, and with the default controller (measured costs, adaptive γ), which is what a user gets. Per
row: acceptance (kept / drafted), tokens per target forward over the speculative steps, and the
wall-clock speedup over the target alone (the median over reps of the paired ratio, interleaved
runs). "Medusa tree": the same heads with speculative_tree="default" (8 candidates to depth 3,
verified as one token tree); its acceptance is kept / drafted nodes, low by design (most branches
are alternatives): compare tokens per forward. "EAGLE": a one-layer head drafting the demo's next
features (tools/train_eagle.py's defaults, cached too), γ calls of it per step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from datetime import date
from pathlib import Path

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.tools.bench import SPEC_PROMPTS, _timed_generate, text_table

HERE = Path(__file__).resolve().parent


def medusa_heads(cache: Path, quick: bool) -> Path:
    """The demo's Medusa heads, trained once (tools/train_medusa.py's defaults) and kept in the
    cache."""
    from nanoserve.spec.medusa import save_medusa
    from nanoserve.tools.train_medusa import self_distill_data, train_medusa

    path = cache / ("medusa-demo-quick" if quick else "medusa-demo")
    if not (path / "medusa_lm_head.safetensors").is_file():
        llm = LLM("demo", dtype="float32")
        seqs, steps = (32, 20) if quick else (256, 400)
        heads = train_medusa(llm.model, self_distill_data(llm, seqs, 96, seed=0), num_heads=3,
                             steps=steps)
        save_medusa(heads, path, "demo")
    return path


def eagle_head(cache: Path, quick: bool) -> Path:
    """The demo's EAGLE head, trained once (tools/train_eagle.py's defaults) and kept in the
    cache."""
    from nanoserve.spec.eagle import save_eagle
    from nanoserve.tools.train_eagle import train_eagle
    from nanoserve.tools.train_medusa import self_distill_data

    path = cache / ("eagle-demo-quick" if quick else "eagle-demo")
    if not (path / "eagle.safetensors").is_file():
        seqs, steps = (8, 2) if quick else (256, 400)
        llm = LLM("demo", dtype="float32")
        save_eagle(train_eagle(llm.model, self_distill_data(llm, seqs, 96, seed=0), steps=steps),
                   path, "demo")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "spec_methods_cpu.json"))
    ap.add_argument("--cache-dir", default=str(HERE / ".peers_cache"))
    args = ap.parse_args()
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    n_prompts, max_tokens, reps = (2, 12, 1) if args.quick else (len(SPEC_PROMPTS), 80, args.reps)
    prompts = list(SPEC_PROMPTS[:n_prompts])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    methods = {"draft model": dict(speculative_model="demo-draft"),
               "n-gram": dict(speculative="ngram"),
               "Medusa": dict(speculative="medusa",
                              speculative_model=str(medusa_heads(cache, args.quick))),
               "EAGLE": dict(speculative="eagle",
                             speculative_model=str(eagle_head(cache, args.quick)))}
    methods["Medusa tree"] = dict(methods["Medusa"], speculative_tree="default")
    engines = {"target alone": LLM("demo")}
    for name, kw in methods.items():
        engines[f"{name}, γ = 3"] = LLM("demo", num_speculative_tokens=3,
                                        speculative_adaptive=False, **kw)
        engines[f"{name}, controller"] = LLM("demo", num_speculative_tokens=3, **kw)
    times, outs = {k: [] for k in engines}, {}
    for llm in engines.values():
        _timed_generate(llm, prompts[:1], params, repeats=1)  # warm-up
    for _ in range(reps):
        for name, llm in engines.items():
            seconds, outs[name] = _timed_generate(llm, prompts, params, repeats=1)
            times[name].append(seconds)
    rows = []
    for name in engines:
        stats = [o.spec_stats for o in outs[name] if o.spec_stats is not None]
        drafted = sum(s.num_draft_tokens for s in stats)
        kept = sum(s.num_accepted_tokens for s in stats)
        steps, emitted = sum(s.num_steps for s in stats), sum(s.num_emitted_tokens for s in stats)
        paired = [t / x for t, x in zip(times["target alone"], times[name])]
        rows.append(dict(engine=name, seconds=statistics.median(times[name]),
                         speedup=statistics.median(paired),
                         acceptance=kept / drafted if drafted else None, spec_steps=steps,
                         tokens_per_forward=emitted / steps if steps else None,
                         same_tokens_as_target=[o.token_ids for o in outs[name]] == [
                             o.token_ids for o in outs["target alone"]]))
    res = {"benchmark": "speculative decoding by proposer", "prompts": n_prompts,
           "max_tokens": max_tokens,
           "reps": reps, "rows": rows, "date": date.today().isoformat(), "torch": torch.__version__,
           "device": f"CPU ({platform.machine()}), {torch.get_num_threads()} threads",
           "command": "python "
                      "benchmarks/bench_spec_methods.py" + (" --quick" if args.quick else "")}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(text_table(rows,
                     ["engine", "seconds", "speedup", "acceptance", "tokens_per_forward",
                      "spec_steps",
                            "same_tokens_as_target"]))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
