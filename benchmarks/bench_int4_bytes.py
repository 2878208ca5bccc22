"""What one batch-1 decode step reads, in weights: bf16, int4 blocks, int4 blocks and LM head.

    python benchmarks/bench_int4_bytes.py [--out benchmarks/int4_bytes.json]

A decode step of one sequence reads every weight once (the token embedding only one row), so its
time on a GPU is bounded below by these bytes over the memory bandwidth: their ratios are the most
int4 can gain (the GPU pass measures what it does gain: `make gpu-check`, figure g). Counted by
`weight_bytes_per_step` (benchmarks/gpu_check_models.py, the figure's own count) on models built on
the meta device (no memory, no time), each linear swapped for a `QuantLinear` of its shape (4-bit,
group 128: the packed codes, fp16 scales, packed zeros, g_idx); with `lm_head`, the head too, untied
as `QuantizeConfig(lm_head=True)` unties it. Shapes: gpu-check's 1B target (32k vocabulary) and
Llama-3.2-1B's (128k vocabulary, tied).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_check_models import llama_config, weight_bytes_per_step  # noqa: E402

from nanoserve.models import build_model  # noqa: E402
from nanoserve.quant.qlinear import QuantLinear  # noqa: E402

GROUP = 128


def shapes() -> dict:
    target = llama_config("target", dry=False)
    return {"gpu-check 1B target (vocab 32000)": target,
            "Llama-3.2-1B shape (vocab 128256)": replace(target, vocab_size=128256)}


def _quantized(lin: nn.Linear) -> QuantLinear:
    return QuantLinear(lin.in_features, lin.out_features, 4, GROUP, lin.bias is not None,
                       torch.bfloat16, "meta")


def step_bytes(cfg, blocks: bool, head: bool) -> int:
    """Weight bytes of one decode step with the blocks' linears and/or the LM head in int4."""
    cfg = replace(cfg, tie_word_embeddings=cfg.tie_word_embeddings and not head)
    with torch.device("meta"):
        model = build_model(cfg).to(torch.bfloat16)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name in names:
        if (name == "lm_head" and head) or (name != "lm_head" and blocks):
            parent, _, child = name.rpartition(".")
            holder = model.get_submodule(parent) if parent else model
            setattr(holder, child, _quantized(model.get_submodule(name)))
    return weight_bytes_per_step(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "int4_bytes.json"))
    args = ap.parse_args()
    rows = []
    for label, cfg in shapes().items():
        bf16 = step_bytes(cfg, blocks=False, head=False)
        for weights, blocks, head in (("bf16", False, False), ("int4 blocks", True, False),
                                      ("int4 blocks + LM head", True, True)):
            b = step_bytes(cfg, blocks, head)
            rows.append({"shape": label, "weights": weights, "gb_per_step": b / 1e9,
                         "max_speedup_vs_bf16": bf16 / b})
    record = {"command": "python benchmarks/bench_int4_bytes.py", "date": str(date.today()),
              "machine": platform.processor() or platform.machine(), "group_size": GROUP,
              "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{'shape':36} {'weights':24} {'GB/step':>8} {'bf16 / this':>12}")
    for r in rows:
        print(f"{r['shape']:36} {r['weights']:24} {r['gb_per_step']:8.3f} "
              f"{r['max_speedup_vs_bf16']:11.2f}x")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
