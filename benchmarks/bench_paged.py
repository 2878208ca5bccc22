"""Paged KV cache: memory waste and concurrency vs per-request reservation; prefix-caching TTFT.

    python benchmarks/bench_paged.py

1. Memory (the real BlockAllocator, no model): 256 requests, prompt and output lengths
   U[16, 512], seed 0, block size 16. Waste = allocated-but-unused KV slots / allocated,
   averaged over every decode step of every request. Compared with reserving per request
   (Orca's variants, as in the vLLM paper): "max" = the model's whole context (2048, Llama-2),
   "pow2" = the final length rounded up to a power of two, "oracle" = exactly the final length.
   Concurrency: requests admitted FCFS into one fixed budget (16,384 slots) while they fit,
   decoding one token per step; mean and peak running sequences.
2. Prefix caching: 32 requests whose prompts share 90 % (921 of 1024 tokens) on a random
   GPT-2-shaped model (6 layers, 384 wide, context 1024, fp32); mean TTFT with caching on vs
   off, one process.
Saves benchmarks/paged.json and prints tables.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import tempfile
from datetime import date
from pathlib import Path

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.block_allocator import BlockAllocator
from nanoserve.engine.sequence import Sequence
from nanoserve.models import build_model
from nanoserve.models.config import ModelConfig
from nanoserve.models.loader import save_checkpoint
from nanoserve.tokenizers import byte_level_tokenizer, save_tiktoken

HERE = Path(__file__).resolve().parent
BS, MAX_CONTEXT, BUDGET_SLOTS = 16, 2048, 16384


def workload(n=256, seed=0):
    rng = random.Random(seed)
    return [(rng.randint(16, 512), rng.randint(16, 512)) for _ in range(n)]


def waste(reqs) -> dict:
    """Allocated-but-unused slots / allocated, summed over every step of every request's life."""
    used = alloc = 0
    reserved = {"max": 0, "pow2": 0, "oracle": 0}
    bm = BlockAllocator(num_blocks=BUDGET_SLOTS // BS, block_size=BS, enable_prefix_caching=False)
    rng = random.Random(1)
    for prompt, out in reqs:
        seq = Sequence([rng.randrange(50000) for _ in range(prompt)])
        bm.allocate(seq)
        final = prompt + out
        for _ in range(out):
            used += len(seq)
            alloc += len(seq.block_table) * BS
            reserved["max"] += MAX_CONTEXT
            reserved["pow2"] += 1 << (final - 1).bit_length()
            reserved["oracle"] += final
            seq.append_token(0)
            bm.append_slot(seq)
        bm.free(seq)
    res = {"paged": 1 - used / alloc}
    res.update({k: 1 - used / v for k, v in reserved.items()})
    return res


def concurrency(reqs) -> dict:
    """Mean/peak sequences running at once in BUDGET_SLOTS, paged vs reservation policies.

    Paged admission needs only the prompt's blocks; a sequence that needs a new block when none
    is free preempts the most recently admitted one (its slots freed, it re-queues first and
    later recomputes its prompt plus what it had generated), as a continuous scheduler does.
    """
    out = {}
    for policy in ("paged", "max", "pow2", "oracle"):
        waiting = [[p, p + o] for p, o in reqs]  # [current length, final length]
        running, counts, free_slots, preempted = [], [], BUDGET_SLOTS, 0
        while waiting or running:
            while waiting:  # admit FCFS while the next one fits
                cur, final = waiting[0]
                need = {"paged": -(-cur // BS) * BS, "max": MAX_CONTEXT,
                        "pow2": 1 << (final - 1).bit_length(),
                        "oracle": final}[policy]
                if need > free_slots:
                    break
                waiting.pop(0)
                running.append([cur, final, need])
                free_slots -= need
            counts.append(len(running))
            for r in list(running):  # one decode step
                if r not in running:
                    continue
                if policy == "paged" and r[0] + 1 > r[2]:
                    while free_slots < BS:
                        victim = running.pop()
                        free_slots += victim[2]
                        waiting.insert(0, victim[:2])
                        preempted += 1
                        if victim is r:
                            break
                    if r not in running:
                        continue
                    r[2] += BS
                    free_slots -= BS
                r[0] += 1
            for r in [r for r in running if r[0] >= r[1]]:
                running.remove(r)
                free_slots += r[2]
        out[policy] = {"mean": statistics.mean(counts), "peak": max(counts), "steps": len(counts),
                       "preemptions": preempted}
    return out


def prefix_ttft(n=32, length=1024, shared=0.9) -> dict:
    torch.manual_seed(0)
    cfg = ModelConfig(arch="gpt2", vocab_size=257, hidden_size=384, n_layers=6, n_heads=6,
                      n_kv_heads=6,
                      intermediate_size=1536, max_position_embeddings=length + 8,
                      eos_token_ids=[256])
    model = build_model(cfg)
    rng = random.Random(0)
    prefix = [rng.randrange(256) for _ in range(int(shared * length))]
    prompts = [prefix + [rng.randrange(256) for _ in range(length - len(prefix))] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=1)
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(model, tmp)
        save_tiktoken(byte_level_tokenizer(), tmp)
        for caching in (False, True):
            llm = LLM(tmp, dtype="float32", device="cpu", enable_prefix_caching=caching,
                      num_blocks=4 * (length // BS + 2))
            # warm-up (and, with caching, fills the cache)
            llm.generate([prompts[0]], params, use_tqdm=False)
            outs = llm.generate(prompts, params, use_tqdm=False)
            res["on" if caching else "off"] = {
                "mean_ttft_s": statistics.mean(o.ttft for o in outs),
                "cached_tokens": statistics.mean(o.num_cached_tokens for o in outs),
            }
    res["speedup"] = res["off"]["mean_ttft_s"] / res["on"]["mean_ttft_s"]
    return res


def main() -> None:
    torch.set_num_threads(2)
    reqs = workload()
    result = {"date": date.today().isoformat(), "device": f"CPU ({platform.machine()}), 2 threads",
              "torch": torch.__version__, "block_size": BS, "budget_slots": BUDGET_SLOTS,
              "waste": waste(reqs), "concurrency": concurrency(reqs),
              "prefix_caching": prefix_ttft()}
    (HERE / "paged.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'policy':<8}{'KV waste':>10}{'mean running':>14}{'peak':>6}")
    for k in ("paged", "oracle", "pow2", "max"):
        c = result["concurrency"][k]
        print(f"{k:<8}{result['waste'][k]:>9.1%}{c['mean']:>14.1f}{c['peak']:>6}")
    ratio = result["concurrency"]["paged"]["mean"] / result["concurrency"]["max"]["mean"]
    print(f"concurrent sequences, paged / max-reservation: {ratio:.1f}x")
    pc = result["prefix_caching"]
    off, on = pc["off"]["mean_ttft_s"] * 1e3, pc["on"]["mean_ttft_s"] * 1e3
    print(f"prefix caching TTFT: off {off:.0f} ms, on {on:.0f} ms ({pc['speedup']:.1f}x lower), "
          f"cached tokens per request {pc['on']['cached_tokens']:.0f}")


if __name__ == "__main__":
    main()
