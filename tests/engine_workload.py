"""A fixed workload that exercises every path of the engine through the public API only, and the
outputs it gave at commit 12a02f3 (tests/golden/engine_outputs.json), before the layout redesign.

The redesign (one owner per piece of state, a batched sampler, subpackages) must not change a
single token: `tests/test_golden_outputs.py` replays this workload and compares token for token.
The recorded outputs come from the engine as it was before the redesign, an implementation the
redesign does not touch, so they are an outside oracle for it. Run this file to record them again
(only ever at a commit whose outputs are trusted):

    .venv/bin/python tests/engine_workload.py

One case was recorded again since, alone, twice: `spec_ngram_seeded` (2026-11-26), when the
speculative controller began starting new samples from the engine's running acceptance rate and
backing its probes off, and again the same day when it began keeping one acceptance rate per draft
position (issue 25). Either changes which γ a step picks and so which random draws a seeded
speculative request consumes, not the law of its tokens (tests/test_speculative_core.py); the greedy
speculative case and every other case are the original record.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from nanoserve import LLM, SamplingParams

GOLDEN = Path(__file__).parent / "golden" / "engine_outputs.json"
PROMPTS = ["ROMEO:", "JULIET:", "First Citizen:\nBefore we proceed any further, hear me "
                                "speak.", "KING"]
SHARED_PREFIX = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\n"


def _ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def run(stories_path: str | None) -> dict:
    """{case: [per prompt: [per sample: token ids]]} (and a few counters) for the whole workload."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order, whatever the machine's core count
    try:
        return _run(stories_path)
    finally:
        torch.set_num_threads(threads)


def _run(stories_path: str | None) -> dict:
    out: dict = {}
    demo = LLM("demo")
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out["greedy"] = _ids(demo.generate(PROMPTS, greedy))
    out["seeded_top_k"] = _ids(demo.generate(PROMPTS,
                                             SamplingParams(temperature=0.8, top_k=40, seed=7,
                                                                      max_tokens=40)))
    out["seeded_top_p"] = _ids(demo.generate(PROMPTS,
                                             SamplingParams(temperature=1.1, top_p=0.9, seed=3,
                                                                      max_tokens=40)))
    out["per_prompt_params"] = _ids(demo.generate(PROMPTS, [
        greedy, SamplingParams(temperature=0.7, seed=1, max_tokens=30),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.8, repetition_penalty=1.3, seed=2,
                       max_tokens=30),
        SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=30)]))
    out["n3"] = _ids(demo.generate(PROMPTS[:2],
                                   SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=30)))
    out["stop"] = [[o.text, o.finish_reason] for o in
                   demo.generate(PROMPTS,
                                 SamplingParams(temperature=0, max_tokens=60,
                                                stop=["\n\n", "the"]))]
    prefixed = [SHARED_PREFIX + p for p in ("ROMEO:", "JULIET:", "KING:")]
    cached = LLM("demo", block_size=4)
    outs = cached.generate(prefixed, greedy) + cached.generate(prefixed, greedy)
    out["prefix_hits"] = _ids(outs)
    out["prefix_hits_cached_tokens"] = [o.num_cached_tokens for o in outs]
    # chunked prefill, preemption
    tight = LLM("demo", block_size=4, num_blocks=48, max_num_batched_tokens=64)
    out["preemption"] = _ids(tight.generate(PROMPTS * 3,
                                            SamplingParams(temperature=0.9, seed=11, max_tokens=48,
                                                                         ignore_eos=True)))
    out["preemption_count"] = tight.engine.scheduler.num_preemptions
    # the controller's costs pinned to what it assumed when these were recorded (draft / target
    # parameters, 426,752 / 4,837,632; n-gram 0): measured costs would let the machine's speed pick
    # γ, and with it the draws
    spec = LLM("demo", speculative_model="demo-draft", num_speculative_tokens=3,
               speculative_cost=426_752 / 4_837_632)
    out["spec_draft_greedy"] = _ids(spec.generate(PROMPTS, greedy))
    out["spec_draft_seeded"] = _ids(
        spec.generate(PROMPTS, SamplingParams(temperature=0.8, seed=4, max_tokens=40))
    )
    ngram = LLM("demo", speculative="ngram", num_speculative_tokens=4, speculative_cost=0.0)
    out["spec_ngram_seeded"] = _ids(
        ngram.generate(
            PROMPTS,
            SamplingParams(temperature=0.6, top_k=20, seed=9, max_tokens=40, ignore_eos=True),
        )
    )
    if stories_path is not None:
        stories = LLM(stories_path, dtype="float32", device="cpu")
        tale = ["Once upon a time", "The little dog"]
        out["stories_greedy"] = _ids(stories.generate(tale,
                                                      SamplingParams(temperature=0, max_tokens=60)))
        out["stories_seeded"] = _ids(
            stories.generate(
                tale, SamplingParams(temperature=0.9, top_p=0.95, seed=0, max_tokens=60, n=2)
            )
        )
    return out


if __name__ == "__main__":
    shared = (
        Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
        / "stories260K.bin"
    )
    if not shared.exists():
        sys.exit(f"{shared} is missing: the golden set includes stories260K")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(run(str(shared))) + "\n")
    print(f"wrote {GOLDEN}")
