"""What a LoRA adapter costs at decode: merged (W + s·BA, the base's cost exactly) against applied
beside the base layer (two thin matmuls per target); and serving many adapters in one batch, on CPU.

    python benchmarks/bench_lora.py                 # -> benchmarks/lora_cpu.json, and a table
    python benchmarks/bench_lora.py --quick --out X # tiny, for the test that keeps it running

Model: bench_peers.py's random GPT-2 6 × 384 (vocab 50257), fp32, 2 threads. Adapters: PEFT LoRA on
c_attn, c_proj and c_fc (every linear of a block), A and B random, made with `peft` and saved once
per rank. A point is bench_step_time.py's: B requests of C prompt tokens, the median of K decode
steps timed one by one. The unmerged cost per target is 2·B·r·(in + out) FLOPs beside the base's
2·B·in·out, so the ratio to the base should grow with r; merged, it is the base's.

Second sweep ("distinct"): a batch of 32 decoding requests under d distinct adapters of rank 8 (row
i under adapter i mod d; d = 0: the base, in a LoRA engine), per-request serving (`enable_lora`, 32
slots), with the adapters' part computed segmented (a pair of matmuls per adapter present: grows
with d) or gathered (each row's A and B copied, one batched product: flat in d, but copies [32, r,
in] and [32, out, r] per layer), and the engine's own choice ("auto": segmented up to
lora/serving.py's SEGMENTED_UP_TO adapters, then gathered).
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


def make_adapter(model_dir: Path, rank: int, out: Path, seed: int | None = None) -> Path:
    """A PEFT LoRA adapter of `rank` on the checkpoint, A and B random (PEFT's own init leaves B =
    0)."""
    if (out / "adapter_model.safetensors").is_file():
        return out
    import peft
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.get_peft_model(hf,
                                peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                target_modules=TARGETS))
    g = torch.Generator().manual_seed(rank if seed is None else 1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


def distinct_sweep(path: Path, cache: Path, args, res: dict) -> None:
    """Step time of a batch of 32 under d distinct adapters, segmented and gathered (see the
    docstring)."""
    from nanoserve import LoRARequest

    batch, context, k, ds = (
        (4, 8, 3, (0, 1, 4)) if args.quick else (32, 128, 16, (0, 1, 2, 4, 8, 16, 32))
    )
    adapters = [str(make_adapter(path, 8, cache / f"lora-{path.name}-r8-s{i}",
                                 seed=i)) for i in range(max(ds))]
    res["distinct"] = {"batch": batch, "context": context, "k": k, "rank": 8, "points": []}
    methods = ("segmented", "gathered", "auto")
    for method in methods:
        def use(llm, method=method):  # auto: the engine's own choice per step (lora/serving.py)
            llm.engine.inputs.lora.method = None if method == "auto" else method
        for d in ds:
            reqs = [LoRARequest(f"a{i}", i + 1, adapters[i]) for i in range(d)]
            rows = [reqs[i % d] if d else None for i in range(batch)]
            pt = nanoserve_point(path, batch, context, k, args.threads, lora_requests=rows, setup=use,
                                 enable_lora=True, max_loras=max(ds), max_lora_rank=8)
            res["distinct"]["points"].append({"method": method, "distinct": d,
                                              "step_ms": pt["step_ms"]})
    print(f"\nbatch of {batch}, d distinct adapters (rank 8): decode step, ms")
    print(f"{'method':<12}" + "".join(f"{'d=' + str(d):>9}" for d in ds))
    for method in methods:
        row = {
            p["distinct"]: p["step_ms"] for p in res["distinct"]["points"] if p["method"] == method
        }
        print(f"{method:<12}" + "".join(f"{row[d]:>9.2f}" for d in ds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ranks, batches, context, k = (
        ((4,), (1, 2), 8, 3) if args.quick else ((8, 64), (1, 16, 64), 128, 16)
    )
    configs = [("base", {})]
    for r in ranks:
        adapter = str(make_adapter(path, r, cache / f"lora-{path.name}-r{r}"))
        configs += [(f"merged r={r}", {"lora": adapter}),
                    (f"unmerged r={r}", {"lora": adapter, "lora_merge": False})]
    res = {"benchmark": "LoRA decode cost on CPU", "model": path.name, "context": context, "k": k,
           "threads": args.threads, "cores": os.cpu_count(), "torch": torch.__version__,
           "date": datetime.now().isoformat(timespec="seconds"),
           "malloc": bench_peers.malloc_of_this_process(),
           "command": " ".join(["python", "benchmarks/bench_lora.py", *sys.argv[1:]]), "points": []}
    for name, kwargs in configs:
        for b in batches:
            pt = nanoserve_point(path, b, context, k, args.threads, **kwargs)
            res["points"].append({"config": name, "batch": b, "step_ms": pt["step_ms"]})
    distinct_sweep(path, cache, args, res)
    base = {p["batch"]: p["step_ms"] for p in res["points"] if p["config"] == "base"}
    print(f"{'config':<14}" + "".join(f"{'B=' + str(b):>16}" for b in batches))
    for name, _ in configs:
        row = {p["batch"]: p["step_ms"] for p in res["points"] if p["config"] == name}
        print(f"{name:<14}" + "".join(f"{row[b]:>8.2f} ({row[b] / base[b]:.2f}×)" for b in batches))
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
