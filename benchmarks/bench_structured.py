"""What structured outputs cost per engine step: 32 requests decoding together, each under a JSON
schema, against the same 32 unconstrained (a peer in the same run).

    python benchmarks/bench_structured.py                  # demo (vocab 257) and, with ../shared, GPT-2's 50k vocab
    python benchmarks/bench_structured.py --quick --out X  # tiny (tested)

Per model: the median time of an engine step while all 32 rows decode (steps with fewer rows, and
the prefill, are left out), plain and constrained, interleaved runs; the time inside the grammar
mask (`structured_output.row_bitmask`: llguidance's bitmask, row by row for 32 rows, +
`apply_row_bitmasks`, the masked fill of the logits) per step; and the mask's share of the
constrained step. Models: the shipped `demo` (GPT-2, 6 × 256, vocab 257), and a random GPT-2 (6 ×
384) with GPT-2's real 50,257-token vocabulary, where the mask has 200× more tokens to decide. fp32,
2 threads, temperature 1, seeds fixed. JSON in benchmarks/structured_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "lines": {"type": "array",
                                                     "items": {"type": "string", "maxLength": 30}}},
          "required": ["name", "age", "lines"], "additionalProperties": False}
FULL = dict(batch=32, tokens=48, reps=3)
QUICK = dict(batch=4, tokens=8, reps=1)


def gpt2_50k(path: Path) -> Path | None:
    """A random GPT-2 6 × 384 with GPT-2's tokenizer files (from ../shared), or None without
    them."""
    src = SHARED / "models" / "gpt2-tokenizer"
    if not src.is_dir():
        return None
    import torch
    import transformers

    cfg = transformers.GPT2Config(n_embd=384, n_layer=6, n_head=6, n_positions=1024,
                                  vocab_size=50257)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    for name in ("encoder.json", "vocab.bpe"):
        shutil.copy(src / name, path / name)
    return path


def run(model: str, p: dict, constrained: bool) -> dict:
    """Step times while all rows decode, and the time spent in the mask per such step."""
    import nanoserve.engine.request as request
    import nanoserve.engine.structured_output as structured_output
    from nanoserve import LLM, SamplingParams

    llm = LLM(model, dtype="float32", device="cpu", max_num_seqs=p["batch"])
    engine, spent = llm.engine, []
    # the mask's two parts: each row's bitmask (llguidance), then one masked fill of the logits
    parts = [(structured_output, "row_bitmask"), (request, "apply_row_bitmasks")]
    originals = [getattr(module, name) for module, name in parts]

    def timed(fn):
        def wrapper(*args):
            t = time.perf_counter()
            out = fn(*args)
            spent.append(time.perf_counter() - t)
            return out
        return wrapper

    for (module, name), fn in zip(parts, originals):
        setattr(module, name, timed(fn))
    try:
        for i in range(p["batch"]):
            so = {"json": SCHEMA} if constrained else None
            engine.add_request("ROMEO:",
                               SamplingParams(temperature=1.0, seed=i, max_tokens=p["tokens"],
                                                        ignore_eos=not constrained,
                                              structured_outputs=so))
        steps, masks = [], []
        while engine.has_unfinished_requests():
            before, t = len(spent), time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            decoding = engine.last_num_seqs == p["batch"] and all(
                s.num_computed_tokens > s.num_prompt_tokens for s in engine.scheduler.running)
            if decoding:
                steps.append(dt)
                masks.append(sum(spent[before:]))
    finally:
        for (module, name), fn in zip(parts, originals):
            setattr(module, name, fn)
    return dict(step_s=statistics.median(steps) if steps else None,
                mask_s=statistics.median(masks) if masks else 0.0,
                steps=len(steps))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "structured_cpu.json"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import llguidance
    import torch

    torch.set_num_threads(args.threads)
    p = QUICK if args.quick else FULL
    res = dict(
        date=datetime.now().isoformat(timespec="seconds"), device=f"cpu ({platform.machine()})",
        threads=args.threads, torch=torch.__version__,
        llguidance=llguidance.__version__ if hasattr(llguidance, "__version__") else "?",
        workload=p, schema=SCHEMA,
        command="python benchmarks/bench_structured.py" + (" --quick" if args.quick else ""),
        models={},
    )
    with tempfile.TemporaryDirectory() as tmp:
        models = {"demo (vocab 257)": "demo"}
        big = None if args.quick else gpt2_50k(Path(tmp) / "gpt2-50k")
        if big is not None:
            models["gpt2 6x384 (vocab 50,257)"] = str(big)
        print(f"{'model':28} {'plain step ms':>14} {'constrained ms':>15} {'mask ms':>8} "
              f"{'mask share':>11}")
        for name, model in models.items():
            runs = {"plain": [], "constrained": []}
            for _ in range(p["reps"]):  # interleaved
                for kind in runs:
                    runs[kind].append(run(model, p, kind == "constrained"))
            plain = statistics.median(r["step_s"] for r in runs["plain"])
            cons = statistics.median(r["step_s"] for r in runs["constrained"])
            mask = statistics.median(r["mask_s"] for r in runs["constrained"])
            row = dict(plain_step_ms=plain * 1e3, constrained_step_ms=cons * 1e3,
                       mask_ms=mask * 1e3,
                       mask_share=mask / cons, overhead=cons / plain - 1,
                       steps_measured=[r["steps"] for r in runs["constrained"]])
            res["models"][name] = row
            print(f"{name:28} {row['plain_step_ms']:>14.2f} {row['constrained_step_ms']:>15.2f} "
                  f"{row['mask_ms']:>8.2f} {row['mask_share']:>10.1%}")
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
