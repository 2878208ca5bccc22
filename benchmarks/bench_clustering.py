"""Weight clustering (nanoserve/quant/clustering.py): what the look-up costs on this CPU, and what
the codebooks buy in perplexity at the bits they really store.

    python benchmarks/bench_clustering.py --out benchmarks/clustering_cpu.json [--reps 15]
    python benchmarks/bench_clustering.py --parts speed        # only the timing part

**speed.** A few rows x through one linear layer, four ways, interleaved pass by pass (each pass
runs every way once, in a rotating order; medians over `reps` passes):
  - `fp32`: F.linear with the float32 weight (the dense baseline);
  - `clustered`: ClusteredLinear's CPU forward, gather each row's weights from its fp16 codebook,
    then F.linear (what the layer does on a CPU: Ŵ is built for every call);
  - `int4 C kernel`: QuantLinear (RTN, g128) through nanoserve's CPU C kernel, which reads the
    packed codes in place (kernels/cpu_packed_gemv.c);
  - `int4 torch`: the same int4 layer dequantized in torch, then F.linear (the int4 counterpart of
    `clustered`: decode to float, then multiply).
Times are per call; the ratio column is fp32's time over each way's (> 1: faster than fp32).
One torch thread by default (`--threads`): on a machine shared with other jobs, a second thread
that is descheduled makes every multi-threaded call wait for it, and the medians then measure the
scheduler; one thread measures the work each way does.

**ppl.** Perplexity on bench_quant_ppl.py's held-out text (same splits, eval tokens, calibration
windows: 32 × 128 tokens, seed 0) for clustering (plain and sensitivity-weighted) at 3 and 4 bits
against RTN and GPTQ (symmetric) at the same code bits with group sizes on either side of the
clustering's storage. Bits per weight are counted as stored, averaged over the block linears:
clustering b + 16·2^b/K (2^b fp16 centroids per row of K weights); RTN/GPTQ b + (16 + b)/g (an
fp16 scale and a b-bit zero point per group of g, as the GPTQ format stores them; a layer that
falls back to one group per row counts g = K). Embeddings and the LM head stay float in every row.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoserve.models.loader import load_model
from nanoserve.quant.clustering import ClusterConfig, ClusteredLinear, cluster_model, cluster_weight
from nanoserve.quant.model import QuantizeConfig, calibration_ids, quantize_model
from nanoserve.quant.qlinear import QuantLinear
from nanoserve.quant.rtn import quantize_rtn
from nanoserve.tools.evaluate import perplexity

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_ppl import MODELS  # noqa: E402  (model, corpus, split, eval tokens)

SHAPES = [(1024, 256), (2048, 2048), (4096, 4096)]      # (out, in): the demo's c_fc, two larger
ROWS = (1, 4)
# the RTN/GPTQ (bits, group) rows per model: groups on either side of the clustering's bits
BASELINES = {"demo": [(3, 64), (3, 32), (4, 32), (4, 16)],
             "stories260K": [(3, 16), (3, 8), (4, 8), (4, 4)]}


# ----------------------------------------------------------------------------- speed
def _ways(out_features: int, in_features: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5   # N, K
    clustered = ClusteredLinear.from_clustered(
        cluster_weight(w, ClusterConfig(bits=4, weighted=False, max_iters=10)))
    int4 = QuantLinear.from_quantized(quantize_rtn(w, bits=4, group_size=128), None)
    return {"fp32": lambda x: F.linear(x, w),
            "clustered": clustered,
            "int4 C kernel": int4,
            "int4 torch": lambda x: F.linear(x, int4.dequantize(torch.float32))}


@torch.no_grad()
def speed(reps: int) -> list[dict]:
    rows = []
    for shape in SHAPES:
        ways = _ways(*shape)
        names = list(ways)
        for m in ROWS:
            x = torch.randn(m, shape[1], generator=torch.Generator().manual_seed(1))
            times = {n: [] for n in names}
            for n in names:  # warm-up (the C kernel's first call prepares its grid)
                ways[n](x)
            for r in range(reps):
                for n in names[r % len(names):] + names[:r % len(names)]:
                    start = time.perf_counter()
                    ways[n](x)
                    times[n].append(time.perf_counter() - start)
            med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
            rows.append({"out": shape[0], "in": shape[1], "rows": m, "ms": med,
                         "vs_fp32": {n: med["fp32"] / med[n] for n in names}})
    return rows


def speed_table(rows: list[dict]) -> str:
    names = list(rows[0]["ms"])
    lines = [f"{'out × in':>12} {'M':>2} " + " ".join(f"{n:>21}" for n in names)]
    for r in rows:
        cells = [f"{r['ms'][n]:8.3f} ms ({r['vs_fp32'][n]:4.2f}×)" for n in names]
        lines.append(f"{r['out']:>5} × {r['in']:<4} {r['rows']:>2} "
                     + " ".join(f"{c:>21}" for c in cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- perplexity
def grid_bits_per_weight(result) -> float:
    """Stored bits per weight of a quantize_model result: codes, fp16 scales, b-bit zeros."""
    bits = result.config.bits
    total = 0.0
    count = 0
    for layer in result.layers:
        n, k = layer.shape
        group = k if layer.group_size == -1 else layer.group_size
        total += n * k * (bits + (16 + bits) / group)
        count += n * k
    return total / count


def _eval(model, tok, eval_text: str, max_tokens: int) -> float:
    r = perplexity(model, tok, eval_text, max_tokens=max_tokens, progress=False)
    return r.nll_sum / r.n_tokens


def ppl(name: str, nsamples: int, seqlen: int) -> dict:
    path, corpus, split, max_tokens, _ = MODELS[name]
    text = corpus.read_text()
    calib_text = text[: int(len(text) * split)]
    eval_text = text[int(len(text) * split):]
    model, cfg, tok = load_model(path)
    seqlen = min(seqlen, cfg.max_position_embeddings)
    calib = calibration_ids(tok, calib_text[:300_000], nsamples, seqlen, seed=0)
    rows = {"fp32": {"nll": _eval(model, tok, eval_text, max_tokens), "bits_per_weight": 32.0}}
    for bits in (3, 4):
        for weighted in (False, True):
            model, _, _ = load_model(path)
            start = time.perf_counter()
            res = cluster_model(model, calib, ClusterConfig(bits=bits, weighted=weighted))
            key = f"cluster{'-aware' if weighted else ''}-w{bits}"
            rows[key] = {"nll": _eval(model, tok, eval_text, max_tokens),
                         "bits_per_weight": res.bits_per_weight(),
                         "seconds": time.perf_counter() - start}
    for bits, group in BASELINES[name]:
        for method in ("rtn", "gptq"):
            model, _, _ = load_model(path)
            start = time.perf_counter()
            res = quantize_model(model, calib, QuantizeConfig(method=method, bits=bits,
                                                              group_size=group, sym=True),
                                 progress=False)
            rows[f"{method}-w{bits}-g{group}"] = {
                "nll": _eval(model, tok, eval_text, max_tokens),
                "bits_per_weight": grid_bits_per_weight(res),
                "seconds": time.perf_counter() - start}
    for r in rows.values():
        r["ppl"] = float(torch.tensor(r["nll"]).exp())
    return {"model": name, "eval_tokens": max_tokens, "nsamples": nsamples, "seqlen": seqlen,
            "rows": rows}


def ppl_table(res: dict) -> str:
    lines = [f"{res['model']} (held-out text, up to {res['eval_tokens']} tokens)",
             f"  {'setting':<20}{'bits/weight':>12}{'ppl':>9}"]
    ordered = sorted(res["rows"].items(), key=lambda kv: kv[1]["bits_per_weight"])
    for key, r in ordered:
        lines.append(f"  {key:<20}{r['bits_per_weight']:>12.3f}{r['ppl']:>9.4f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["speed", "ppl"], choices=["speed", "ppl"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the speed part")
    ap.add_argument("--models", nargs="+", default=list(BASELINES), choices=list(BASELINES))
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    out = {"date": date.today().isoformat(),
           "device": f"CPU ({platform.machine()}), {torch.get_num_threads()} threads",
           "torch": torch.__version__,
           "command": "python benchmarks/bench_clustering.py " + " ".join(sys.argv[1:])}
    if "speed" in args.parts:
        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        out["speed_threads"] = args.threads
        out["speed"] = speed(args.reps)
        torch.set_num_threads(threads)
        print(speed_table(out["speed"]))
    if "ppl" in args.parts:
        out["ppl"] = [ppl(m, args.nsamples, args.seqlen) for m in args.models]
        for res in out["ppl"]:
            print(ppl_table(res))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
