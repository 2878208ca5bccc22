"""Record what the engine outputs on a fixed set of cases, to compare two versions of the code.

    python scripts/golden.py --out before.json          (on the old commit)
    python scripts/golden.py --out after.json           (on the new one)
    python scripts/golden.py --compare before.json after.json

A restructuring that changes no behaviour must give the same token ids and the same logprobs, bit
for bit, in every case: greedy and seeded sampling, n > 1, prefix hits, preemption, chunked
prefill, logprobs, structured outputs, speculative decoding (draft model, n-gram), tensor and
pipeline parallelism, and the torch, cpu and Triton-interpreter attention backends. This is a
regression check between two versions, not a proof of correctness: that is the test suite's job
(tests/test_hf_parity.py and the others compare with transformers).
"""

from __future__ import annotations

import argparse
import json
import sys

PROMPTS = ["ROMEO:", "JULIET: O Romeo", "To be, or not", "KING HENRY"]
LONG = "First Citizen: Before we proceed any further, hear me speak. "


def cases():
    """(name, engine kwargs, prompts, sampling kwargs)."""
    greedy = dict(temperature=0, max_tokens=16)
    seeded = dict(temperature=0.8, top_p=0.9, max_tokens=16, seed=7)
    return [
        ("greedy", {}, PROMPTS, greedy),
        ("seeded n=3", {}, PROMPTS[:2], dict(seeded, n=3)),
        ("prefix hits", {}, [LONG + "A", LONG + "B", LONG + "C"], greedy),
        ("preemption", dict(num_blocks=12, block_size=8, max_num_seqs=4), PROMPTS * 2,
         dict(greedy, max_tokens=40)),
        ("chunked prefill", dict(max_num_batched_tokens=16), [LONG, "ROMEO:"], greedy),
        ("logprobs", {}, PROMPTS[:2], dict(seeded, logprobs=3, prompt_logprobs=2)),
        ("structured regex", {}, PROMPTS[:2],
         dict(greedy, structured_outputs={"regex": "[a-z ]{4,12}\\."})),
        ("structured choice", {}, PROMPTS[:2],
         dict(seeded, structured_outputs={"choice": ["yes", "no", "perhaps"]})),
        ("spec draft", dict(speculative_model="demo-draft", num_speculative_tokens=3,
                            speculative_cost=0.2), PROMPTS, seeded),
        ("spec ngram", dict(speculative="ngram", num_speculative_tokens=3, speculative_cost=0.0),
         [LONG], greedy),
        ("backend torch", dict(attention_backend="torch"), PROMPTS, greedy),
        ("backend cpu", dict(attention_backend="cpu"), PROMPTS, greedy),
        ("backend triton", dict(attention_backend="triton"), PROMPTS[:2],
         dict(greedy, max_tokens=4)),
        ("tp=2", dict(tensor_parallel_size=2), PROMPTS[:2], dict(greedy, max_tokens=8)),
        ("pp=2", dict(pipeline_parallel_size=2), PROMPTS[:2], dict(greedy, max_tokens=8)),
    ]


def record_case(name, engine_kwargs, prompts, sampling) -> dict:
    from nanoserve import LLM, SamplingParams

    llm = LLM("demo", dtype="float32", device="cpu", **engine_kwargs)
    try:
        outs = llm.generate(prompts, SamplingParams(**sampling), use_tqdm=False)
    finally:
        workers = getattr(llm.engine, "workers", None)
        if workers is not None:
            workers.shutdown()
    result = []
    for out in outs:
        for o in out.outputs:
            result.append({"token_ids": list(o.token_ids), "text": o.text,
                           "logprobs": _logprobs(o.logprobs),
                           "prompt_logprobs": _logprobs(out.prompt_logprobs)})
    return {"name": name, "outputs": result}


def _logprobs(rows) -> list | None:
    """Each position's {token: logprob} as a sorted list, floats as their exact hex."""
    if rows is None:
        return None
    plain = []
    for row in rows:
        if row is None:
            plain.append(None)
            continue
        plain.append(sorted((int(t),
                             float(getattr(lp, "logprob", lp)).hex()) for t, lp in row.items()))
    return plain


def compare(before_path: str, after_path: str) -> int:
    before = {c["name"]: c for c in json.load(open(before_path))}
    after = {c["name"]: c for c in json.load(open(after_path))}
    bad = 0
    for name, case in before.items():
        same = after.get(name) == case
        bad += not same
        print(f"{'same' if same else 'DIFFERENT':9} {name}")
    print(f"{len(before) - bad} of {len(before)} cases identical")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="record the cases into this JSON file")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--only", help="record only the cases whose name contains this")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    results = []
    for name, kwargs, prompts, sampling in cases():
        if args.only and args.only not in name:
            continue
        print(f"recording {name}", file=sys.stderr, flush=True)
        results.append(record_case(name, kwargs, prompts, sampling))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
