"""How often a speculative step reads the device, counted on the CPU as a GPU would wait.

    python benchmarks/bench_spec_syncs.py [--label after] [--out benchmarks/spec_syncs_cpu.json]
    git worktree add /tmp/before <rev> && \
        PYTHONPATH=/tmp/before python benchmarks/bench_spec_syncs.py --label before

On a GPU each read of a device value (`.tolist()`, `int(t)`, `bool(t)`, ...) stalls the host until
the device has caught up. A count, not a timing: every such call made during one steady
speculative step of `LLMEngine.step` (the demo model, the demo-draft model, γ fixed), seen by the
spy of this checkout's tests/test_no_host_sync.py, whichever nanoserve is imported (so an older
checkout can be counted by the same spy). The host-side building of inputs (`ModelRunner.prepare`)
reads CPU tensors by design and is not counted. Five steps per row, greedy and seeded sampled
rows; each label's counts are kept in the JSON beside the others', and the table shows them all.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import date
from pathlib import Path

import torch

import nanoserve
from nanoserve import SamplingParams
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.kv.metadata import CommonAttentionMetadata

HERE = Path(__file__).resolve().parent
PROMPTS = ["ROMEO:", "To be, or not to be", "KING", "First Citizen:"] * 2
CASES = [(2, 1), (4, 1), (4, 4), (4, 8)]  # (γ, batch)
STEPS = 5


def _spy():
    """The spy of this checkout's tests/test_no_host_sync.py (whichever nanoserve is measured)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from test_no_host_sync import SyncSpy

    return SyncSpy()


def steady_reads(gamma: int, batch: int, temperature: float) -> list[int]:
    """The reads of each of STEPS steady speculative steps."""
    engine = LLMEngine.from_kwargs("demo", block_size=4, speculative_model="demo-draft",
                                   num_speculative_tokens=gamma, speculative_adaptive=False)
    seed = 5 if temperature else None
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=60, ignore_eos=True)
    for prompt in PROMPTS[:batch]:
        engine.add_request(prompt, params)
    engine.step()  # the prompts, each first token drawn plainly
    engine.step()  # the draft catches up
    spy = _spy()
    prepare, build = ModelRunner.prepare, CommonAttentionMetadata.build

    ModelRunner.prepare = spy.unwatched(prepare)
    CommonAttentionMetadata.build = staticmethod(spy.unwatched(build))
    counts = []
    try:
        for _ in range(STEPS):
            spy.calls = []
            with spy:
                engine.step()
            counts.append(len(spy.calls))
    finally:
        ModelRunner.prepare = prepare
        CommonAttentionMetadata.build = staticmethod(build)
    return counts


def table(results: dict) -> str:
    labels = list(results)
    lines = [f"{'γ':>3}{'batch':>7}{'sampling':>10}" + "".join(f"  {x:>26}" for x in labels)]
    for key in results[labels[0]]:
        gamma, batch, sampling = key.split("/")
        cells = "".join(f"  {str(results[x].get(key, '-')):>26}" for x in labels)
        lines.append(f"{gamma:>3}{batch:>7}{sampling:>10}{cells}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", default=str(HERE / "spec_syncs_cpu.json"))
    args = ap.parse_args()
    counts = {}
    for gamma, batch in CASES:
        for name, temperature in (("greedy", 0.0), ("seeded", 0.8)):
            counts[f"{gamma}/{batch}/{name}"] = steady_reads(gamma, batch, temperature)
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.exists() else {"results": {}}
    record.update(date=date.today().isoformat(), torch=torch.__version__,
                  machine=platform.processor() or platform.machine(),
                  command="python benchmarks/bench_spec_syncs.py --label <label>")
    record["results"][args.label] = {"nanoserve": str(Path(nanoserve.__file__).parent),
                                     "reads_per_step": counts}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(table({k: v["reads_per_step"] for k, v in record["results"].items()}))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
