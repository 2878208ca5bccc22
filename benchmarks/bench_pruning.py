"""Perplexity against sparsity: magnitude, Wanda and SparseGPT at 0 / 25 / 50 / 70 % unstructured
and 2:4, on the demo model and stories260K; then a short recovery fine-tune of one pruned model.

    python benchmarks/bench_pruning.py --out benchmarks/pruning_cpu.json

Data as in bench_quant_ppl.py: demo calibrated on windows of the first 90 % of tinyshakespeare
(its training split) and evaluated on the held-out last 10 % (first 20,000 bytes of it);
stories260K calibrated on the first half of the TinyStories sample and evaluated on 40,000
tokens of the second half. Every linear of every block is pruned; embeddings, norms, biases and
the LM head stay dense. Recovery (demo only: it is byte-level, which tools/train.py's data loader
reads): `--recover-steps` AdamW steps on the training split with the masks re-applied after each.

These models have 0.26 M (stories260K) and 4.8 M (demo) parameters. The published Wanda and
SparseGPT results (OPT and LLaMA at 7 B parameters and more, where 50 % costs well under one
perplexity point) are not comparable: small models have little redundancy to remove.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch

from nanoserve.models.loader import load_model
from nanoserve.sparsity import SparsityConfig, calibration_for, prune_model
from nanoserve.sparsity.recovery import recover
from nanoserve.tools.evaluate import perplexity
from nanoserve.tools.train import PRESETS

SHARED = Path(__file__).resolve().parents[2] / "shared"
SHAKESPEARE = SHARED / "corpora/tinyshakespeare/input.txt"
# name: (model, corpus, calibration split, eval tokens)
MODELS = {
    "demo": ("demo", SHAKESPEARE, 0.9, 20_000),
    "stories260K": (str(SHARED / "models/stories260K/stories260K.bin"),
                    SHARED / "corpora/tinystories/tinystories_val_sample.txt", 0.5, 40_000),
}
METHODS = ("magnitude", "wanda", "sparsegpt")
SPARSITIES = (0.25, 0.5, 0.7, "2:4")


def _ppl(model, tok, text: str, max_tokens: int) -> float:
    return perplexity(model, tok, text, max_tokens=max_tokens, progress=False).perplexity


def run_model(name: str, nsamples: int, seqlen: int, eval_cap: int) -> dict:
    path, corpus, split, max_tokens = MODELS[name]
    max_tokens = min(max_tokens, eval_cap)
    text = corpus.read_text()
    calib_text = text[: int(len(text) * split)]
    eval_text = text[int(len(text) * split):]
    model, cfg, tok = load_model(path, dtype="float32", device="cpu")
    seqlen = min(seqlen, cfg.max_position_embeddings)
    rows = {"dense": {"ppl": _ppl(model, tok, eval_text, max_tokens), "sparsity": 0.0}}
    for method in METHODS:
        for sparsity in SPARSITIES:
            config = SparsityConfig(method=method, sparsity=sparsity, nsamples=nsamples,
                                    seqlen=seqlen)
            model, _, _ = load_model(path, dtype="float32", device="cpu")
            calib = calibration_for(tok, calib_text[:300_000], config)
            start = time.perf_counter()
            res = prune_model(model, config, calib)
            seconds = time.perf_counter() - start
            rows[f"{method}-{sparsity}"] = {"ppl": _ppl(model, tok, eval_text, max_tokens),
                                            "sparsity": res.sparsity(), "seconds": seconds}
            print(f"  {name} {method} {sparsity}: {rows[f'{method}-{sparsity}']['ppl']:.3f}",
                  flush=True)
    return {"model": name, "params": sum(p.numel() for p in model.parameters()),
            "eval_tokens": max_tokens, "rows": rows}


def run_recovery(method: str, sparsity, steps: int, nsamples: int, seqlen: int,
                 eval_cap: int) -> dict:
    """Prune the demo model, fine-tune it `steps` steps with the masks fixed; perplexity before
    and after on the held-out text."""
    path, corpus, split, max_tokens = MODELS["demo"]
    max_tokens = min(max_tokens, eval_cap)
    text = corpus.read_text()
    eval_text = text[int(len(text) * split):]
    model, _, tok = load_model(path, dtype="float32", device="cpu")
    config = SparsityConfig(method=method, sparsity=sparsity, nsamples=nsamples, seqlen=seqlen)
    res = prune_model(model, config, calibration_for(tok, text[: int(len(text) * split)],
                                                     config))
    before = _ppl(model, tok, eval_text, max_tokens)
    _, tc = PRESETS["demo"]
    tc = replace(tc, steps=steps, batch_size=16, lr=3e-4, min_lr=3e-5, warmup=10,
                 eval_batches=4)
    log = recover(model, res.masks, corpus, tc)
    after = _ppl(model, tok, eval_text, max_tokens)
    kept = all(bool((model.get_submodule(n).weight[~m] == 0).all()) for n, m in res.masks.items())
    return {"method": method, "sparsity": sparsity, "steps": steps, "batch_size": tc.batch_size,
            "lr": tc.lr, "ppl_before": before, "ppl_after": after,
            "train_seconds": log["seconds"], "masks_held": kept}


def print_table(out: dict) -> None:
    for res in out["results"]:
        rows = res["rows"]
        dense = rows["dense"]["ppl"]
        print(f"{res['model']} ({res['params']:,} parameters, {res['eval_tokens']} eval tokens); "
              f"dense perplexity {dense:.3f}")
        print(f"  {'method':<11}" + "".join(f"{str(s):>10}" for s in SPARSITIES))
        for method in METHODS:
            cells = "".join(f"{rows[f'{method}-{s}']['ppl']:>10.3f}" for s in SPARSITIES)
            print(f"  {method:<11}{cells}")
    rec = out.get("recovery")
    if rec:
        print(f"recovery (demo, {rec['method']} {rec['sparsity']}, {rec['steps']} steps, "
              f"{rec['train_seconds']:.0f} s): perplexity {rec['ppl_before']:.3f} → "
              f"{rec['ppl_after']:.3f} (masks held: {rec['masks_held']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--eval-tokens", type=int, default=40_000,
                    help="cap on the evaluation tokens (default: bench_quant_ppl.py's counts)")
    ap.add_argument("--recover-steps", type=int, default=200)
    ap.add_argument("--recover-method", default="wanda", choices=METHODS)
    ap.add_argument("--out")
    ap.add_argument("--table", metavar="JSON", help="only print the table of a saved run")
    args = ap.parse_args()
    if args.table:
        print_table(json.loads(Path(args.table).read_text()))
        return
    torch.manual_seed(0)
    out = {"date": date.today().isoformat(),
           "device": f"CPU ({platform.machine()}), {torch.get_num_threads()} threads",
           "torch": torch.__version__,
           "command": "python benchmarks/bench_pruning.py " + " ".join(
               f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items() if v),
           "results": [run_model(m, args.nsamples, args.seqlen, args.eval_tokens)
                       for m in args.models]}
    if args.recover_steps:
        out["recovery"] = run_recovery(args.recover_method, "2:4", args.recover_steps,
                                       args.nsamples, args.seqlen, args.eval_tokens)
    print_table(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
