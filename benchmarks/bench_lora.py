"""What a LoRA adapter costs at decode: merged (W + s·BA, the base's cost exactly) against applied beside
the base layer (two thin matmuls per target), on CPU.

    python benchmarks/bench_lora.py                 # -> benchmarks/lora_cpu.json, and a table
    python benchmarks/bench_lora.py --quick --out X # tiny, for the test that keeps it running

Model: bench_peers.py's random GPT-2 6 × 384 (vocab 50257), fp32, 2 threads. Adapters: PEFT LoRA on c_attn,
c_proj and c_fc (every linear of a block), A and B random, made with `peft` and saved once per rank. A point
is bench_step_time.py's: B requests of C prompt tokens, the median of K decode steps timed one by one.
The unmerged cost per target is 2·B·r·(in + out) FLOPs beside the base's 2·B·in·out, so the ratio to the
base should grow with r; merged, it is the base's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime
from pathlib import Path

import bench_peers
from bench_step_time import nanoserve_point

HERE = Path(__file__).resolve().parent
TARGETS = ["c_attn", "c_proj", "c_fc"]


def make_adapter(model_dir: Path, rank: int, out: Path) -> Path:
    """A PEFT LoRA adapter of `rank` on the checkpoint, A and B random (PEFT's own init leaves B = 0)."""
    if (out / "adapter_model.safetensors").is_file():
        return out
    import peft
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "lora_cpu.json"))
    ap.add_argument("--cache-dir", default=str(HERE / ".peers_cache"))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    path = bench_peers.model_dir("gpt2-tiny" if args.quick else "gpt2-6x384", cache)
    ranks, batches, context, k = ((4,), (1, 2), 8, 3) if args.quick else ((8, 64), (1, 16, 64), 128, 16)
    configs = [("base", {})]
    for r in ranks:
        adapter = str(make_adapter(path, r, cache / f"lora-{path.name}-r{r}"))
        configs += [(f"merged r={r}", {"lora": adapter}), (f"unmerged r={r}", {"lora": adapter, "lora_merge": False})]
    res = {"benchmark": "LoRA decode cost on CPU", "model": path.name, "context": context, "k": k,
           "threads": args.threads, "cores": os.cpu_count(), "torch": torch.__version__,
           "date": datetime.now().isoformat(timespec="seconds"), "malloc": bench_peers.malloc_of_this_process(),
           "command": " ".join(["python", "benchmarks/bench_lora.py", *sys.argv[1:]]), "points": []}
    for name, kwargs in configs:
        for b in batches:
            pt = nanoserve_point(path, b, context, k, args.threads, **kwargs)
            res["points"].append({"config": name, "batch": b, "step_ms": pt["step_ms"]})
    base = {p["batch"]: p["step_ms"] for p in res["points"] if p["config"] == "base"}
    print(f"{'config':<14}" + "".join(f"{'B=' + str(b):>16}" for b in batches))
    for name, _ in configs:
        row = {p["batch"]: p["step_ms"] for p in res["points"] if p["config"] == name}
        print(f"{name:<14}" + "".join(f"{row[b]:>8.2f} ({row[b] / base[b]:.2f}×)" for b in batches))
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
