"""Perplexity of quantized models: fp32, int8, RTN, GPTQ (± act-order) and AWQ on the demo model and
stories260K, with the spread over calibration sets.

    python benchmarks/bench_quant_ppl.py --out benchmarks/quant_ppl_cpu.json [--seeds 5]

demo: calibration windows from the first 90 % of tinyshakespeare (its training split), evaluated on
the held-out last 10 % (first 20,000 bytes of it). stories260K: calibration from the first half of
the TinyStories sample, evaluation on 40,000 tokens of the second half. Weights are fake-quantized
(Ŵ in float), which is what a QuantLinear computes with up to fp16 scales. Symmetric grids (what
GPTQ v1 checkpoints store).

"gap closed" = how much of RTN's NLL increase over fp32 the method removes, at the same bits and
group size (GPTQ's paper: 43–64 % on OPT-125M / BLOOM-560M at 4 bits). GPTQ and AWQ depend on the
calibration windows drawn, so each runs with `--seeds` different draws (seed s picks the windows)
and the table gives the mean ± standard deviation over them; RTN and int8 use no calibration.
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

from nanoserve.models.loader import load_model
from nanoserve.quant.model import QuantizeConfig, calibration_ids, quantize_model
from nanoserve.tools.evaluate import perplexity

SHARED = Path(__file__).resolve().parents[2] / "shared"
# name: (model, corpus, calibration split, eval tokens, [(bits, group size), ...])
MODELS = {
    "demo": ("demo", SHARED / "corpora/tinyshakespeare/input.txt", 0.9, 20_000, [(4, 128)]),
    # K = 64 for most layers: g64 is one group per row there; down_proj (K = 172) falls back to per
    # row
    "stories260K": (str(SHARED / "models/stories260K/stories260K.bin"),
                    SHARED / "corpora/tinystories/tinystories_val_sample.txt", 0.5, 40_000,
                    [(4, 32), (4, 64), (3, -1)]),
}
# gptq-ao-static: act-order with every group's grid fixed from the original weights and groups
# k // group_size (llmcompressor's default, actorder="static")
METHODS = [("rtn", {}), ("gptq", {}), ("gptq-ao", {"act_order": True}),
           ("gptq-ao-static", {"act_order": True, "static_groups": True}), ("awq", {})]


def _nll(path, tok, eval_text, max_tokens, calib, **kw) -> tuple[float, float, list[str]]:
    model, _, _ = load_model(path)
    start = time.perf_counter()
    res = quantize_model(model, calib, QuantizeConfig(sym=True, **kw), progress=False)
    seconds = time.perf_counter() - start
    r = perplexity(model, tok, eval_text, max_tokens=max_tokens, progress=False)
    fallback = [x.name for x in res.layers if x.group_size != res.config.group_size]
    return r.nll_sum / r.n_tokens, seconds, fallback


def run(name: str, nsamples: int, seqlen: int, seeds: int, methods: list[str]) -> dict:
    path, corpus, split, max_tokens, settings = MODELS[name]
    text = corpus.read_text()
    calib_text, eval_text = text[: int(len(text) * split)], text[int(len(text) * split):]
    model, cfg, tok = load_model(path)
    seqlen = min(seqlen, cfg.max_position_embeddings)
    calibs = [calibration_ids(tok, calib_text[:300_000], nsamples, seqlen,
                              seed=s) for s in range(seeds)]
    fp = perplexity(model, tok, eval_text, max_tokens=max_tokens, progress=False)
    base = fp.nll_sum / fp.n_tokens
    rows = {"fp32": {"nll": [base]}}
    nll, secs, _ = _nll(path, tok, eval_text, max_tokens, None, method="rtn", bits=8, group_size=-1)
    rows["int8"] = {"nll": [nll], "seconds": secs}
    for bits, group in settings:
        tag = f"w{bits}-g{group}" if group != -1 else f"w{bits}-row"
        for label, extra in METHODS:
            if label not in methods:
                continue
            kw = dict(method=label.split("-")[0], bits=bits, group_size=group, **extra)
            runs = [_nll(path, tok, eval_text, max_tokens, c,
                         **kw) for c in (calibs[:1] if label == "rtn" else calibs)]
            rows[f"{label}-{tag}"] = {"nll": [r[0] for r in runs],
                                      "seconds": statistics.mean(r[1] for r in runs),
                                     "per_row_layers": runs[0][2]}
    summarize(rows)
    return {"model": name, "eval_tokens": fp.n_tokens, "nsamples": nsamples, "seqlen": seqlen,
            "calibration_seeds": seeds, "rows": rows}


def summarize(rows: dict) -> None:
    """Add NLL increase, mean perplexity and RTN gap closed to each row (keys
    "<method>-w<bits>-<group>")."""
    base = rows["fp32"]["nll"][0]
    for key, r in rows.items():
        r["nll_increase_pct"] = [100 * (x - base) / base for x in r["nll"]]
        r["ppl_mean"] = statistics.mean(float(torch.tensor(x).exp()) for x in r["nll"])
        setting = "-".join(key.split("-")[-2:])  # w4-g128 of gptq-ao-w4-g128
        rtn = rows.get(f"rtn-{setting}")
        if rtn and not key.startswith("rtn") and rtn["nll"][0] > base:
            r["rtn_gap_closed_pct"] = [
                100 * (rtn["nll"][0] - x) / (rtn["nll"][0] - base) for x in r["nll"]
            ]


def _mean_sd(xs: list[float], fmt: str) -> str:
    return (
        format(xs[0], fmt) if len(xs) == 1
        else f"{statistics.mean(xs):{fmt}} ± {statistics.stdev(xs):{fmt}}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=5, help="calibration draws per GPTQ / AWQ setting")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    labels = [label for label, _ in METHODS]
    ap.add_argument("--methods", nargs="+", default=labels, choices=labels,
                    help="rows to run (fp32 and int8 always run; 'gap closed' needs rtn)")
    ap.add_argument("--out")
    ap.add_argument("--table", metavar="JSON",
                    help="only print the table of a saved run (summaries recomputed)")
    args = ap.parse_args()
    if args.table:
        out = json.loads(Path(args.table).read_text())
        for res in out["results"]:
            summarize(res["rows"])
        print_table(out)
        Path(args.table).write_text(json.dumps(out, indent=2) + "\n")
        return
    out = {
        "date": date.today().isoformat(),
        "device": f"CPU ({platform.machine()}), {torch.get_num_threads()} threads",
        "torch": torch.__version__, "command": "python benchmarks/bench_quant_ppl.py "
        + " ".join(
            f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if v
        ),
        "results": [run(m, args.nsamples, args.seqlen, args.seeds,
                        args.methods) for m in args.models],
    }
    print_table(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


def print_table(out: dict) -> None:
    for res in out["results"]:
        print(f"{res['model']} ({res['eval_tokens']} eval tokens, {res['calibration_seeds']} "
              "calibration draws)")
        print(f"  {'setting':<16}{'ppl':>9}{'NLL +%':>16}{'RTN gap closed %':>20}")
        for key, r in res["rows"].items():
            closed = _mean_sd(r["rtn_gap_closed_pct"], ".0f") if "rtn_gap_closed_pct" in r else "-"
            print(
                f"  {key:<16}{r['ppl_mean']:>9.4f}{_mean_sd(r['nll_increase_pct'], '.2f'):>16}{closed:>20}"
            )


if __name__ == "__main__":
    main()
