"""8-bit weights and activations: what W8A8 int8, LLM.int8, SmoothQuant and FP8 cost in quality.

    python benchmarks/bench_w8a8.py [--out benchmarks/w8a8_cpu.json]      # demo and (with ../shared) stories260K
    python benchmarks/bench_w8a8.py --quick --out X                        # tiny (tested)

Held-out NLL per token (fp32 activations outside the linears) on the same corpora and splits as
bench_quant_ppl.py: the demo on tinyshakespeare's last 10 % (20,000 tokens), stories260K on the
second half of the TinyStories sample (40,000 tokens); SmoothQuant calibrated on 32 windows of 128
tokens from the training split (seed 0). Rows: fp32; int8 weight-only (RTN, one scale per row);
naive W8A8 (int8 per channel × per token, no smoothing); SmoothQuant W8A8 at α = 0.25, 0.5, 0.75;
LLM.int8 (threshold 6); FP8-e4m3 weights (per channel) alone and with per-token FP8 activations.
Also, per model, the activation outliers the methods are about: the largest |x| of any input feature
of any block linear over the calibration tokens, and that over the median feature's. Neither model
is large enough for the outlier features LLM.int8 reports from 6.7B parameters on, so
"stories260K+outliers" puts two in without changing the float model (`inject_outliers`): the model
SmoothQuant and LLM.int8 are for. Saves JSON, prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import torch

from nanoserve.models.loader import load_model
from nanoserve.quant.awq import fold_scales
from nanoserve.quant.fp8 import FP8Linear
from nanoserve.quant.int8 import W8A8Linear
from nanoserve.quant.llm_int8 import LLMInt8Linear
from nanoserve.quant.model import (
    QuantizeConfig,
    block_groups,
    calibration_ids,
    decoder_blocks,
    quantize_model,
)
from nanoserve.quant.online import quantize_linears
from nanoserve.quant.smoothquant import channel_maxima, smooth_model
from nanoserve.tools.evaluate import perplexity

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared"
MODELS = {  # name: (model, corpus, training split, eval tokens)
    "demo": ("demo", SHARED / "corpora/tinyshakespeare/input.txt", 0.9, 20_000),
    "stories260K": (str(SHARED / "models/stories260K/stories260K.bin"),
                    SHARED / "corpora/tinystories/tinystories_val_sample.txt", 0.5, 40_000),
}
# with outlier features put in (`inject_outliers`)
MODELS["stories260K+outliers"] = MODELS["stories260K"]
OUTLIER_CHANNELS, OUTLIER_FACTOR = (5, 37), 30.0
ALPHAS = (0.25, 0.5, 0.75)


@torch.no_grad()
def inject_outliers(model) -> None:
    """Give the model the outlier features of a large LLM without changing what it computes: every
    norm that feeds linears multiplies channels 5 and 37 by 30 and the linears reading them divide
    those columns by 30 (smoothing run backwards: awq.fold_scales with s = 1/30 there). The float
    model is the same one; its activations now have two features 30x larger in every token, as
    LLM.int8 describes them."""
    _, blocks = decoder_blocks(model)
    for block in blocks:
        for prev, names in block_groups(model, block):
            if prev is None or isinstance(block.get_submodule(prev), torch.nn.Linear):
                continue
            lins = [block.get_submodule(n) for n in names]
            s = torch.ones(lins[0].in_features)
            s[list(OUTLIER_CHANNELS)] = 1 / OUTLIER_FACTOR
            fold_scales(block.get_submodule(prev), lins, s)


def methods():
    """label -> a function that makes a loaded fp32 model 8-bit in place (calib: token ids)."""
    def swap(make):
        return lambda model, calib: quantize_linears(model, make)

    def smooth(alpha):
        return lambda model, calib: (smooth_model(model, calib, alpha),
                                     quantize_linears(model, W8A8Linear.from_linear))

    rows = {"fp32": lambda model, calib: None,
            "int8 weight-only": lambda model, calib: quantize_model(model, None, QuantizeConfig(
                method="rtn", bits=8, group_size=-1), progress=False),
            "W8A8 naive": swap(W8A8Linear.from_linear)}
    rows.update({f"SmoothQuant α={a}": smooth(a) for a in ALPHAS})
    rows["LLM.int8"] = swap(LLMInt8Linear.from_linear)
    rows["FP8 W8A16"] = swap(lambda lin: FP8Linear.from_linear(lin, "channel", None))
    rows["FP8 W8A8"] = swap(lambda lin: FP8Linear.from_linear(lin, "channel", "token"))
    return rows


def _load(name: str, path: str):
    model, cfg, tok = load_model(path)
    if name.endswith("+outliers"):
        inject_outliers(model)
    return model, cfg, tok


@torch.no_grad()
def run(name: str, quick: bool) -> dict:
    path, corpus, split, max_tokens = MODELS[name]
    text = corpus.read_text()
    calib_text, eval_text = text[: int(len(text) * split)], text[int(len(text) * split):]
    max_tokens = 600 if quick else max_tokens
    load = lambda: _load(name, path)  # noqa: E731
    model, cfg, tok = load()
    calib = calibration_ids(tok, calib_text[:300_000], 4 if quick else 32,
                            min(128, cfg.max_position_embeddings))
    # every feature of every block linear's input
    maxima = torch.cat(list(channel_maxima(model, calib).values()))
    rows, base = {}, None
    for label, apply in methods().items():
        model, _, _ = load()
        apply(model, calib)
        r = perplexity(model, tok, eval_text, max_tokens=max_tokens, progress=False)
        nll = r.nll_sum / r.n_tokens
        base = base if base is not None else nll
        rows[label] = {"nll": nll, "change": nll / base - 1}
        print(f"{name:12} {label:22} {nll:8.4f} {nll / base - 1:+8.2%}")
    return {"model": name, "eval_tokens": r.n_tokens, "calibration": list(calib.shape),
            "outliers": {"max_abs": maxima.max().item(),
                         "max_over_median": (maxima.max() / maxima.median()).item()},
            "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "w8a8_cpu.json"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [n for n in MODELS if n == "demo" or (not args.quick and Path(MODELS[n][0]).is_file())]
    res = dict(date=date.today().isoformat(), device=f"cpu ({platform.machine()})",
               threads=args.threads,
               torch=torch.__version__,
               command="python benchmarks/bench_w8a8.py" + (" --quick" if args.quick else ""),
               models={n: run(n, args.quick) for n in names})
    for n, m in res["models"].items():
        print(f"{n}: activation outliers, max |x| {m['outliers']['max_abs']:.1f} "
              f"({m['outliers']['max_over_median']:.1f}x the median feature's)")
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
