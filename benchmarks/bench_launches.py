"""Kernels a decode step launches, per layer and per step, counted on the CPU as a GPU would launch
them.

    python benchmarks/bench_launches.py [--out benchmarks/launches_cpu.json]

A count, not a timing (nanoserve/tools/launch_count.py): aten operators that are neither views nor
allocations, and Triton launches, inside the model runner's forward of one steady decode step at
batch 1, on random Llamas with the 1B class's structure (head_dim 64, 4 query heads per KV head,
SwiGLU) of 1 and 3 layers, the difference halved. Both attention backends: "triton" (what a GPU
runs; the kernels in the interpreter here, their value checks off as on a GPU) and "torch". The
issue-43 goal is ≤ 12 a layer on the triton path. Saves JSON and prints a table by kernel.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from datetime import date
from pathlib import Path

import torch

from nanoserve.tools.launch_count import per_layer

HERE = Path(__file__).resolve().parent
BACKENDS = ("triton", "torch")


def table(results: dict) -> str:
    names = sorted({name for r in results.values() for name in r["per_layer"]})
    head = f"{'per layer':<32}" + "".join(f"{b:>8}" for b in BACKENDS)
    lines = [head]
    for name in names:
        counts = "".join(f"{results[b]['per_layer'].get(name, 0):>8}" for b in BACKENDS)
        lines.append(f"{name:<32}{counts}")
    for label, key in (("total a layer", "layer_total"), ("outside the layers", "fixed_total")):
        lines.append(f"{label:<32}" + "".join(f"{results[b][key]:>8}" for b in BACKENDS))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "launches_cpu.json"))
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for backend in BACKENDS:
            layer, fixed = per_layer(workdir, backend)
            results[backend] = {"per_layer": dict(sorted(layer.items())),
                                "layer_total": sum(layer.values()),
                                "per_step_outside_layers": dict(sorted(fixed.items())),
                                "fixed_total": sum(fixed.values())}
    machine = platform.processor() or platform.machine()
    record = {"date": date.today().isoformat(), "machine": machine, "torch": torch.__version__,
              "command": "python benchmarks/bench_launches.py", "results": results}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(table(results))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
