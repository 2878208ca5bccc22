"""Perplexity of quantized models: fp32, int8, RTN4, GPTQ4, AWQ4 on the demo model and stories260K.

    python benchmarks/bench_quant_ppl.py --out benchmarks/quant_ppl_cpu.json

demo: calibration windows from the first 90 % of tinyshakespeare (its training split), evaluated
on the held-out last 10 % (first 20,000 bytes of it). stories260K: calibration from the first half
of the TinyStories sample, evaluation on the second half. Weights are fake-quantized (Ŵ in
float), which is what a QuantLinear computes with up to fp16 scales. "gap closed" = how much of
RTN4's NLL increase over fp32 the method removes (GPTQ's paper: 43–64 % on OPT-125M / BLOOM-560M).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch

from nanoserve.evaluate import perplexity
from nanoserve.loader import load_model
from nanoserve.quant.model import QuantizeConfig, calibration_ids, quantize_model

SHARED = Path(__file__).resolve().parents[2] / "shared"
MODELS = {
    "demo": ("demo", SHARED / "corpora/tinyshakespeare/input.txt", 0.9, 20_000, [128]),
    "stories260K": (str(SHARED / "models/stories260K/stories260K.bin"),
                    SHARED / "corpora/tinystories/tinystories_val_sample.txt", 0.5, 20_000, [32, 64]),
}
SETTINGS = [("int8", dict(method="rtn", bits=8, group_size=-1)), ("rtn4", dict(method="rtn", bits=4)),
            ("gptq4", dict(method="gptq", bits=4)), ("awq4", dict(method="awq", bits=4))]


def run(name: str, nsamples: int, seqlen: int) -> dict:
    path, corpus, split, max_tokens, groups = MODELS[name]
    text = corpus.read_text()
    calib_text, eval_text = text[: int(len(text) * split)], text[int(len(text) * split):]
    model, cfg, tok = load_model(path)
    seqlen = min(seqlen, cfg.max_position_embeddings)
    calib = calibration_ids(tok, calib_text[:300_000], nsamples, seqlen, seed=0)
    fp = perplexity(model, tok, eval_text, max_tokens=max_tokens, progress=False)
    rows = {"fp32": {"nll": fp.nll_sum / fp.n_tokens}}
    for g in groups:
        for label, kw in SETTINGS:
            if label == "int8" and g != groups[0]:
                continue
            model, _, _ = load_model(path)
            kw = dict(kw) | ({"group_size": g} if kw.get("group_size") != -1 else {})
            t0 = time.perf_counter()
            res = quantize_model(model, calib, QuantizeConfig(sym=True, **kw), progress=False)
            r = perplexity(model, tok, eval_text, max_tokens=max_tokens, progress=False)
            key = label if label == "int8" else f"{label}-g{g}"
            rows[key] = {"nll": r.nll_sum / r.n_tokens, "seconds": time.perf_counter() - t0,
                         "per_row_layers": [x.name for x in res.layers if x.group_size != res.config.group_size]}
    base = rows["fp32"]["nll"]
    for key, r in rows.items():
        r["ppl"] = float(torch.tensor(r["nll"]).exp())
        r["nll_increase_pct"] = 100 * (r["nll"] - base) / base
        rtn = rows.get("rtn4-" + key.split("-")[-1]) if "-" in key else None
        if rtn and key.startswith(("gptq4", "awq4")) and rtn["nll"] > base:
            r["rtn_gap_closed_pct"] = 100 * (rtn["nll"] - r["nll"]) / (rtn["nll"] - base)
    return {"model": name, "eval_tokens": fp.n_tokens, "nsamples": nsamples, "seqlen": seqlen, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    out = {"date": date.today().isoformat(), "device": f"CPU ({platform.machine()}), {torch.get_num_threads()} threads",
           "torch": torch.__version__, "results": [run(m, args.nsamples, args.seqlen) for m in MODELS]}
    for res in out["results"]:
        print(f"{res['model']} ({res['eval_tokens']} eval tokens)")
        print(f"  {'setting':<12}{'ppl':>9}{'NLL +%':>9}{'RTN gap closed':>16}")
        for key, r in res["rows"].items():
            closed = f"{r['rtn_gap_closed_pct']:.0f} %" if "rtn_gap_closed_pct" in r else "-"
            print(f"  {key:<12}{r['ppl']:>9.4f}{r['nll_increase_pct']:>9.2f}{closed:>16}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
