"""Record what the engine outputs on a fixed set of cases, to compare two versions of the code.

    python scripts/golden.py --assets DIR --out before.json    (on the old commit)
    python scripts/golden.py --assets DIR --out after.json     (on the new one)
    python scripts/golden.py --compare before.json after.json

DIR holds what the LoRA and Medusa/EAGLE cases load — two PEFT adapters on the demo model and
randomly initialised heads, seeded — made on the first run and read as they are by the second, so
both versions load the same files.

A restructuring that changes no behaviour must give the same token ids and the same logprobs, bit
for bit, in every case: greedy and seeded sampling, n > 1, prefix hits, preemption, chunked
prefill, logprobs, structured outputs, speculative decoding (draft model, n-gram, Medusa as a
chain and as a tree, EAGLE), per-request LoRA adapters mixed in one batch, tensor and pipeline
parallelism, and the torch, cpu and Triton-interpreter attention backends. This is a
regression check between two versions, not a proof of correctness: that is the test suite's job
(tests/test_hf_parity.py and the others compare with transformers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROMPTS = ["ROMEO:", "JULIET: O Romeo", "To be, or not", "KING HENRY"]
LONG = "First Citizen: Before we proceed any further, hear me speak. "


def make_assets(root: Path) -> None:
    """Two PEFT LoRA adapters on the demo model (A and B random, seeded: PEFT starts B at zero),
    random Medusa heads and a random EAGLE head; each made only when its directory is missing."""
    import torch

    from nanoserve.models.loader import resolve_model_path

    demo = resolve_model_path("demo")
    for k, targets in enumerate((["c_attn", "c_proj"], ["c_fc", "c_attn"])):
        if not (root / f"lora{k}").exists():
            _peft_adapter(demo, root / f"lora{k}", targets, seed=k)
    config = json.loads((demo / "config.json").read_text())
    hidden, vocab = config["n_embd"], config["vocab_size"]
    if not (root / "medusa").exists():
        from nanoserve.spec.medusa import MedusaHeads, save_medusa

        torch.manual_seed(0)
        save_medusa(MedusaHeads(hidden, vocab, num_heads=3), root / "medusa", "demo")
    if not (root / "eagle").exists():
        from nanoserve.spec.eagle import EagleHead, save_eagle

        torch.manual_seed(1)
        head = EagleHead(hidden, config["n_head"], 4 * hidden, vocab)
        save_eagle(head, root / "eagle", "demo")


def _peft_adapter(model_dir: Path, out: Path, targets: list[str], seed: int) -> None:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=True)
    model = peft.get_peft_model(hf, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)


def cases(assets: Path):
    """(name, engine kwargs, prompts, sampling kwargs, LoRA adapter per prompt or None)."""
    greedy = dict(temperature=0, max_tokens=16)
    seeded = dict(temperature=0.8, top_p=0.9, max_tokens=16, seed=7)
    medusa = dict(speculative="medusa", speculative_model=str(assets / "medusa"),
                  num_speculative_tokens=3, speculative_cost=0.0)
    eagle = dict(speculative="eagle", speculative_model=str(assets / "eagle"),
                 num_speculative_tokens=3, speculative_cost=0.0)
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    adapters = [str(assets / "lora0"), str(assets / "lora1"), None, str(assets / "lora0")]
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
        ("spec medusa", medusa, PROMPTS, seeded),
        ("spec medusa tree", dict(medusa, speculative_tree="default"), [LONG], greedy),
        ("spec medusa tree triton", dict(medusa, speculative_tree="default",
                                         attention_backend="triton"), PROMPTS[:1],
         dict(greedy, max_tokens=6)),
        ("spec eagle", eagle, PROMPTS, seeded),
        ("spec eagle triton", dict(eagle, attention_backend="triton"), PROMPTS[:1],
         dict(greedy, max_tokens=6)),
        ("lora", lora, PROMPTS, dict(seeded, logprobs=2), adapters),
        ("lora + prefix hits", lora, [LONG + "A", LONG + "B", LONG + "C", LONG + "D"], greedy,
         adapters),
    ]


def record_case(name, engine_kwargs, prompts, sampling, adapters=None) -> dict:
    from nanoserve import LLM, SamplingParams

    llm = LLM("demo", dtype="float32", device="cpu", **engine_kwargs)
    lora = None
    if adapters is not None:
        lora = [_lora_request(path) for path in adapters]
    try:
        outs = llm.generate(prompts, SamplingParams(**sampling), use_tqdm=False,
                            lora_request=lora)
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


def _lora_request(path: str | None):
    """A LoRARequest for an adapter directory (its id from its name: lora0 → 1), or None."""
    from nanoserve import LoRARequest

    if path is None:
        return None
    return LoRARequest(Path(path).name, int(Path(path).name[-1]) + 1, path)


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
    ap.add_argument("--assets", default="golden_assets",
                    help="where the adapters and heads are made once, then read "
                         "(default: %(default)s)")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    assets = Path(args.assets).resolve()
    make_assets(assets)
    results = []
    for name, kwargs, prompts, sampling, *adapters in cases(assets):
        if args.only and args.only not in name:
            continue
        print(f"recording {name}", file=sys.stderr, flush=True)
        results.append(record_case(name, kwargs, prompts, sampling, *adapters))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
