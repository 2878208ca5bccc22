"""KV-cache eviction: perplexity against the KV budget, and how many requests one pool holds.

    python benchmarks/bench_kv_eviction.py --out benchmarks/kv_eviction_cpu.json

Perplexity. Held-out text (demo and demo-sinks: the last 10 % of tinyshakespeare; stories260K: the
second half of the TinyStories sample) is cut into windows of T tokens (the model's context: 128,
256 and 512; demo-sinks' windows start with its BOS, as its training windows did), and the last
quarter of each window is scored: every scored token has ≥ 3T/4 tokens of context, at least
3× the largest budget, and each window is 4× it. Each policy is the model run with an explicit
attention mask, as tests/test_kv_eviction.py proves the engine computes it (decode steps: query p
sees the blocks kept after p tokens, engine/kv_eviction.streaming_kept_blocks, and its own block):

    full         every key (causal)
    truncation   the newest ⌊budget / block⌋ full blocks and the block being filled, no sinks:
                 the negative control — dropping the sinks is what breaks a plain window
    sinks=k      StreamingLLM: k sink blocks + the newest (budget blocks − k) full blocks
    snapkv       the first 3T/4 tokens are the prompt, compressed once to the budget from its last
                 8 queries' attention (engine/kv_eviction.snapkv_kept_blocks); the scored tokens
                 (the generation) are all kept, so SnapKV holds the budget plus up to T/4 tokens

Sinks: the share of attention the queries at positions ≥ 32 put on the first key, per layer and
head (the most and the mean over a layer's heads), on the same windows.

Capacity: one pool of blocks, 16 requests of 16 prompt + 96 generated tokens on the demo model:
the most sequences running at once and the preemptions, with and without StreamingLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config.kv_eviction import KVEvictionConfig
from nanoserve.engine.kv_eviction import block_sums, snapkv_kept_blocks, streaming_kept_blocks
from nanoserve.models.loader import load_model

SHARED = Path(__file__).resolve().parents[2] / "shared"
OBSERVATION = 8
SINK_QUERIES = 32  # the sink share counts queries at positions >= this


@dataclass(frozen=True)
class Setup:
    """One model's held-out windows and budgets."""

    model: str  # a shipped name or a path
    corpus: Path
    split: float  # held-out text starts at this fraction of the corpus
    block_size: int
    window: int  # T tokens: the model's context
    budgets: tuple[int, ...]  # KV budgets in tokens
    windows: int
    bos: int | None = None  # every window starts with this token (the model was trained so)


SHAKESPEARE = SHARED / "corpora/tinyshakespeare/input.txt"
MODELS = {
    "demo": Setup("demo", SHAKESPEARE, 0.9, 4, 128, (16, 24, 32), 24),
    "demo-sinks": Setup("demo-sinks", SHAKESPEARE, 0.9, 4, 256, (16, 32, 64), 24, bos=256),
    "stories260K": Setup(str(SHARED / "models/stories260K/stories260K.bin"),
                         SHARED / "corpora/tinystories/tinystories_val_sample.txt", 0.5, 8, 512,
                         (32, 64, 128), 12),
}


class MaskAttention:
    """Attention over the window's own K/V with an explicit mask [T, T]; with `record`, the
    probabilities of the queries in `record` (a slice) summed over heads, queries and layers."""

    def __init__(self, mask: torch.Tensor, record: slice | None = None):
        self.mask, self.record = mask, record
        self.scores = torch.zeros(mask.shape[1], dtype=torch.float64)
        self.first_key: list[torch.Tensor] = []  # per layer [H]: see `sink_shares`

    def attention(self, layer, q, k, v, positions, window=None, scale=None, softcap=None):
        H, D = q.shape[2], q.shape[3]
        k = k.repeat_interleave(H // k.shape[2], dim=2)  # 1, T, H, D
        v = v.repeat_interleave(H // v.shape[2], dim=2)
        logits = torch.einsum("bthd,bshd->bhts", q, k) * (scale or 1 / math.sqrt(D))
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        probs = logits.masked_fill(~self.mask, float("-inf")).softmax(-1)  # 1, H, T, S
        if self.record is not None:
            self.scores += probs[0, :, self.record].sum((0, 1)).double()
        self.first_key.append(probs[0, :, SINK_QUERIES:, 0].mean(-1))
        return torch.einsum("bhts,bshd->bthd", probs, v)

    def advance(self, n):
        pass


def streaming_mask(T: int, bs: int, sink_blocks: int, window_blocks: int) -> torch.Tensor:
    """Decode steps: query p sees the blocks kept after p tokens and its own block, causally."""
    mask = torch.zeros(T, T, dtype=torch.bool)
    for p in range(T):
        kept = streaming_kept_blocks(p, bs, sink_blocks, window_blocks) + [p // bs]
        for b in kept:
            mask[p, b * bs:min((b + 1) * bs, p + 1)] = True
    return mask


def nll(model, ids: torch.Tensor, mask: torch.Tensor, scored: slice) -> float:
    """Summed negative log-likelihood of the tokens after the positions in `scored`."""
    with torch.no_grad():
        logits = model(ids[None], torch.arange(len(ids))[None], cache=MaskAttention(mask))[0]
    logp = logits.float().log_softmax(-1)[scored]
    targets = ids[scored.start + 1:scored.stop + 1]
    return -logp[torch.arange(len(targets)), targets].sum().item()


def snapkv_mask(model, ids: torch.Tensor, bs: int, budget_blocks: int, prompt: int) -> torch.Tensor:
    """The prompt's first `prompt` tokens compressed once by SnapKV; the rest kept."""
    T = len(ids)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    view = MaskAttention(causal[:prompt, :prompt], record=slice(prompt - OBSERVATION, prompt))
    with torch.no_grad():
        model(ids[None, :prompt], torch.arange(prompt)[None], cache=view)
    kept = snapkv_kept_blocks(block_sums(view.scores, bs), prompt, bs, 0, budget_blocks,
                              OBSERVATION)
    mask = causal.clone()
    for b in set(range(prompt // bs)) - set(kept):
        mask[prompt:, b * bs:(b + 1) * bs] = False
    return mask


def held_out_windows(setup: Setup, tok) -> list[torch.Tensor]:
    """`setup.windows` windows of T tokens from the held-out text; with `setup.bos`, each is that
    token then T − 1 tokens of text."""
    T, text = setup.window, setup.corpus.read_text()
    per_window = T if setup.bos is None else T - 1
    # (enough characters for the windows: tokenizing the whole split is slow)
    held_out = text[int(len(text) * setup.split):][:8 * T * setup.windows]
    ids = torch.tensor(tok.encode(held_out))
    if len(ids) < per_window * setup.windows:
        raise SystemExit(f"{setup.model}: {len(ids)} tokens of held-out text, "
                         f"{per_window * setup.windows} needed")
    chunks = [ids[i * per_window:(i + 1) * per_window] for i in range(setup.windows)]
    if setup.bos is None:
        return chunks
    return [torch.cat([torch.tensor([setup.bos]), c]) for c in chunks]


def sink_shares(model, chunks: list[torch.Tensor]) -> list[list[float]]:
    """Per layer and head: the mean attention probability the queries at positions >=
    SINK_QUERIES put on the first key, averaged over `chunks`, with a full causal mask."""
    T = len(chunks[0])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    total = None
    for c in chunks:
        view = MaskAttention(causal)
        with torch.no_grad():
            model(c[None], torch.arange(T)[None], cache=view)
        shares = torch.stack(view.first_key).double()  # L, H
        total = shares if total is None else total + shares
    return (total / len(chunks)).tolist()


def per_layer(shares: list[list[float]]) -> str:
    """`sink_shares` in one line: per layer, the most a head puts on the first key / the mean."""
    return "; ".join(f"L{i} {max(h):.2f} / {sum(h) / len(h):.2f}" for i, h in enumerate(shares))


def perplexities(name: str) -> dict:
    setup = MODELS[name]
    bs, T, windows = setup.block_size, setup.window, setup.windows
    model, cfg, tok = load_model(setup.model, "float32", "cpu")
    chunks = held_out_windows(setup, tok)
    scored = slice(3 * T // 4 - 1, T - 1)  # logits at these positions predict the last quarter
    rows = []
    for budget in setup.budgets:
        blocks = budget // bs
        masks = {"truncation": streaming_mask(T, bs, 0, blocks)}
        for k in range(1, 5):
            if blocks - k >= 1:
                masks[f"sinks={k}"] = streaming_mask(T, bs, k, blocks - k)
        masks["full"] = torch.ones(T, T, dtype=torch.bool).tril()
        for policy, mask in masks.items():
            total = sum(nll(model, c, mask, scored) for c in chunks)
            n = windows * (scored.stop - scored.start)
            rows.append({"budget": budget, "policy": policy, "ppl": math.exp(total / n)})
        total = sum(nll(model, c, snapkv_mask(model, c, bs, blocks, 3 * T // 4), scored)
                    for c in chunks)
        rows.append({"budget": budget, "policy": "snapkv", "ppl": math.exp(total / n)})
    return {"block_size": bs, "window": T, "windows": windows, "bos_first": setup.bos is not None,
            "rows": rows, "first_key_share": sink_shares(model, chunks)}


def capacity(num_blocks: int = 64) -> dict:
    """Most sequences running at once, preemptions and steps for 16 requests on one pool."""
    prompts = [[(13 * r + 7 * i) % 250 + 1 for i in range(16)] for r in range(16)]
    result = {"num_blocks": num_blocks, "block_size": 4, "requests": 16, "prompt": 16,
              "max_tokens": 96}
    eviction = KVEvictionConfig("streaming", kv_budget=16, num_sink_tokens=4)
    for label, config in (("full", None), ("streaming budget 16", eviction)):
        llm = LLM("demo", dtype="float32", device="cpu", block_size=4, num_blocks=num_blocks,
                  max_num_seqs=16, attention_backend="torch")
        params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, kv_eviction=config)
        engine = llm.engine
        for p in prompts:
            engine.add_request(p, params)
        most = steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            most = max(most, len(engine.scheduler.running))
        result[label] = {"most_running": most, "preemptions": engine.scheduler.num_preemptions,
                         "steps": steps}
    return result


def table(results: dict) -> str:
    lines = []
    for name in MODELS:
        r = results[name]
        lines.append(f"\n{name}: block {r['block_size']}, window {r['window']} tokens, "
                     f"{r['windows']} windows, last quarter scored")
        lines.append("attention on the first key (queries >= 32), per layer, most / mean over "
                     "heads: " + per_layer(r["first_key_share"]))
        budgets = sorted({row["budget"] for row in r["rows"]})
        policies = ["full", "truncation", "sinks=1", "sinks=2", "sinks=3", "sinks=4", "snapkv"]
        lines.append("| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |")
        lines.append("|---" * (len(budgets) + 1) + "|")
        for policy in policies:
            cells = []
            for b in budgets:
                hit = [row["ppl"] for row in r["rows"] if row["budget"] == b
                       and row["policy"] == policy]
                cells.append(f"{hit[0]:.3f}" if hit else "—")
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    c = results["capacity"]
    lines.append(f"\ncapacity: {c['requests']} requests ({c['prompt']} + {c['max_tokens']} "
                 f"tokens) on {c['num_blocks']} blocks of {c['block_size']}")
    for label in ("full", "streaming budget 16"):
        lines.append(f"  {label}: {c[label]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/kv_eviction_cpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    for name in MODELS:
        results[name] = perplexities(name)
        print(f"{name}: done", flush=True)
    results["capacity"] = capacity()
    results["meta"] = {"date": str(date.today()), "torch": torch.__version__,
                       "machine": platform.processor() or platform.machine()}
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
