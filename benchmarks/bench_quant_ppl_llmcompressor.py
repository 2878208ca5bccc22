"""llmcompressor's GPTQ on the demo model, on the calibration windows and evaluation text of
bench_quant_ppl.py, scored by nanoserve's perplexity: the outside reference for nanoserve's GPTQ.

llmcompressor pins its own transformers, so it runs from a scratch virtualenv that also sees
.venv's packages (torch, nanoserve) through one .pth line, as `make test-clients` does:

    python3 -m venv /tmp/lmc
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \\
        > /tmp/lmc/lib/python3.11/site-packages/nanoserve-venv.pth
    /tmp/lmc/bin/pip install llmcompressor==0.14.0.1 -c <(echo torch==2.13.0+cpu)
    /tmp/lmc/bin/python benchmarks/bench_quant_ppl_llmcompressor.py --seeds 5 \\
        --out benchmarks/quant_ppl_llmcompressor_cpu.json

The demo is a GPT-2, whose HF layers are transformers' Conv1D (W stored [K, N]); llmcompressor
quantizes nn.Linear, so each Conv1D becomes the nn.Linear holding Wᵀ (the same function). Its
GPTQModifier runs with W4A16's weights (int4, symmetric, groups of 128), block size 128, 1 %
damping, the LM head left in float (as nanoserve's default), its sequential pipeline one GPT2Block
at a time; `--actorder static` is its default. The quantized weights (Ŵ in float) are copied into
nanoserve's model, which bench_quant_ppl.py's `perplexity` call then scores.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import torch
from bench_quant_ppl import MODELS
from datasets import Dataset
from llmcompressor import __version__ as llmcompressor_version
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from torch import nn
from transformers import GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

from nanoserve.models.loader import load_model, resolve_model_path
from nanoserve.quant.model import calibration_ids
from nanoserve.tools.evaluate import perplexity


def conv1d_to_linear(model: nn.Module) -> nn.Module:
    """Replace every Conv1D (y = x W + b, W [K, N]) by the nn.Linear with weight Wᵀ, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                k, n = child.weight.shape
                linear = nn.Linear(k, n)
                linear.weight.data = child.weight.data.t().contiguous()       # N, K
                linear.bias.data = child.bias.data.clone()
                setattr(parent, name, linear)
    return model


def gptq_recipe(actorder: str | None) -> GPTQModifier:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": 128}
    return GPTQModifier(config_groups={"g0": {"targets": ["Linear"], "weights": weights}},
                        ignore=["lm_head"], actorder=actorder, block_size=128,
                        dampening_frac=0.01)


def quantized_nll(calib: torch.Tensor, actorder: str | None, eval_text: str,
                  max_tokens: int) -> tuple[float, float]:
    """(NLL per token of the llmcompressor-quantized demo, seconds llmcompressor took)."""
    path = resolve_model_path("demo")
    hf = conv1d_to_linear(GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32)).eval()
    ds = Dataset.from_dict({"input_ids": calib.tolist(),
                            "attention_mask": torch.ones_like(calib).tolist()})
    start = time.perf_counter()
    oneshot(model=hf, dataset=ds, recipe=[gptq_recipe(actorder)],
            num_calibration_samples=calib.shape[0], max_seq_length=calib.shape[1],
            pipeline="sequential", sequential_targets=["GPT2Block"],
            shuffle_calibration_samples=False, batch_size=1)
    seconds = time.perf_counter() - start
    model, _, tok = load_model("demo")
    quantized = dict(hf.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.startswith("transformer.h."):
                module.weight.copy_(quantized[name].weight.float())
    r = perplexity(model, tok, eval_text, max_tokens=max_tokens, progress=False)
    return r.nll_sum / r.n_tokens, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=5, help="calibration draws: seeds first-seed, ...")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--actorder", default="static", choices=["static", "weight", "none"])
    ap.add_argument("--out")
    args = ap.parse_args()
    _, corpus, split, max_tokens, _ = MODELS["demo"]
    text = corpus.read_text()
    calib_text, eval_text = text[: int(len(text) * split)], text[int(len(text) * split):]
    _, _, tok = load_model("demo")
    actorder = None if args.actorder == "none" else args.actorder
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        calib = calibration_ids(tok, calib_text[:300_000], args.nsamples, args.seqlen, seed=seed)
        nll, seconds = quantized_nll(calib, actorder, eval_text, max_tokens)
        print(f"seed {seed}: NLL {nll:.6f}, ppl {torch.tensor(nll).exp().item():.4f}, "
              f"{seconds:.0f} s")
        runs.append({"seed": seed, "nll": nll, "seconds": seconds})
    out = {"date": date.today().isoformat(), "torch": torch.__version__,
           "llmcompressor": llmcompressor_version, "actorder": args.actorder,
           "nsamples": args.nsamples, "seqlen": args.seqlen, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
