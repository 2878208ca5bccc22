"""Helpers of `gpu_check.py` for the end-to-end figures: random checkpoints, decode timing, HF
generate.

Nothing here touches the network: model shapes are configs built in code, weights are random
(N(0, 0.02), norms 1, as HF's initializer_range), the tokenizer is nanoserve's 257-token byte-level
one, saved beside the weights (the loader allows an embedding with more rows than the tokenizer has
ids; the engine then samples only ids the tokenizer can decode).
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from pathlib import Path

import torch

from nanoserve.models import build_model
from nanoserve.models.config import ModelConfig

# Peak HBM bandwidth (TB/s) by device name; the first pattern that matches wins.
PEAK_TBPS = (
    (r"\bH200\b", 4.8, "H200"),
    (r"\bH100\b.*\bPCIe\b", 2.0, "H100 PCIe"),
    (r"\bH100\b.*\bNVL\b", None, "H100 NVL (not in the table)"),
    (r"\bH100\b", 3.35, "H100 SXM"),
    (r"\bA100\b.*80\s?GB", 2.0, "A100 80GB"),
    (r"\bA100\b", 1.56, "A100 40GB"),
    (r"\bL4\b", 0.3, "L4"),
    (r"\bA10\b", 0.6, "A10"),
    (r"\bT4\b", 0.32, "T4"),
)


def peak_bandwidth(device_name: str) -> tuple[float | None, str]:
    """(peak HBM TB/s or None, which table entry matched or why none did)."""
    for pattern, tbps, label in PEAK_TBPS:
        if re.search(pattern, device_name):
            return tbps, label if tbps else f"unknown: {label}"
    return None, f"unknown: {device_name!r} is not in the peak-bandwidth table"


def llama_config(kind: str, dry: bool) -> ModelConfig:
    """The shapes the end-to-end figures use (dry: tiny stand-ins with the same structure).

    target: a 1B-class Llama (Llama-3.2-1B's body with a 32k vocabulary): 2048 wide, 16 layers,
    32 heads / 8 kv heads, MLP 8192, tied embeddings: 1.04 B parameters. draft: 512 wide, 4 layers,
    8 / 2 heads, MLP 1536: 28 M parameters, ~37x smaller."""
    if dry:
        shapes = {"target": (64, 2, 4, 2, 128), "draft": (32, 1, 2, 1, 64)}
        vocab, ctx = 320, 256
    else:
        shapes = {"target": (2048, 16, 32, 8, 8192), "draft": (512, 4, 8, 2, 1536)}
        vocab, ctx = 32000, 4096
    d, layers, heads, kv_heads, ffn = shapes[kind]
    return ModelConfig(arch="llama", vocab_size=vocab, hidden_size=d, n_layers=layers,
                       n_heads=heads,
                       n_kv_heads=kv_heads, intermediate_size=ffn, max_position_embeddings=ctx,
                       tie_word_embeddings=True, rope_theta=500000.0, eos_token_ids=[256])


def describe(cfg: ModelConfig) -> str:
    return (f"random Llama {cfg.hidden_size} wide, {cfg.n_layers} layers, "
            f"{cfg.n_heads}/{cfg.n_kv_heads} heads, MLP {cfg.intermediate_size}, vocab "
            f"{cfg.vocab_size} (byte tokenizer: 257 usable), {cfg.num_parameters() / 1e6:.1f} M "
            "parameters")


def ensure_checkpoint(workdir: Path, name: str, cfg: ModelConfig, device: str,
                      dtype: torch.dtype) -> Path:
    """workdir/name: config.json + model.safetensors (random weights) + the byte tokenizer, built
    once and reused by the later figures of the same run."""
    from nanoserve.models.loader import save_checkpoint
    from nanoserve.tokenizers.bpe import byte_level_tokenizer
    from nanoserve.tokenizers.tiktoken_file import save_tiktoken

    out = workdir / name
    if (out / ".complete").is_file():
        return out
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.device("meta"):
        model = build_model(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)  # RMSNorm gains (the model has no biases)
    save_checkpoint(model, out)
    save_tiktoken(byte_level_tokenizer(), out)
    del model
    free()
    (out / ".complete").write_text("ok\n")
    return out


def free() -> None:
    """Give the memory of dropped models back to the GPU between measurements (callers `del` theirs
    first)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer (packed int4 tensors
    included) except the token embedding, of which a step reads one row per token; the LM head
    counts in full, tied or not."""
    seen, total = set(), 0
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(head, "weight", None) is not None:
        tensors.append(("lm_head.weight", head.weight))
    for name, t in tensors:
        if id(t) in seen or (name.endswith(("embed_tokens.weight", "wte.weight", "wpe.weight"))
                             and not name.startswith("lm_head")):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def random_prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()  # byte ids: every one decodes


def measure_decode(llm, prompt_len: int, new_tokens: int, reps: int,
                   peak_tbps: float | None) -> dict:
    """Batch-1 greedy decode: median time per output token after the first (TPOT: the decode step,
    prefill excluded) and what it implies for HBM bandwidth: (weights + KV read per step) / step
    time."""
    from nanoserve import SamplingParams
    from nanoserve.kv.cache import kv_bytes_per_token

    prompt = random_prompt(prompt_len, seed=1)
    llm.generate([prompt],
                 SamplingParams(temperature=0, max_tokens=min(8, new_tokens), ignore_eos=True),
                 use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    tpots, tokens = [], None
    for _ in range(reps):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        times = out.token_times
        tpots.append((times[-1] - times[0]) / (len(times) - 1))
        tokens = out.token_ids
    tpot = statistics.median(tpots)
    wbytes = weight_bytes_per_step(llm.model)
    # mean context of a step
    kv = kv_bytes_per_token(llm.config, llm.dtype) * (prompt_len + new_tokens / 2)
    achieved = (wbytes + kv) / tpot / 1e12
    return {"tok_s": 1 / tpot, "tpot_ms": 1e3 * tpot, "tpot_ms_runs": [1e3 * t for t in tpots],
            "weight_gb": wbytes / 1e9, "kv_mb_per_step": kv / 1e6, "achieved_tbps": achieved,
            "frac_of_peak": achieved / peak_tbps if peak_tbps else None,
            "roofline_tok_s": peak_tbps * 1e12 / (wbytes + kv) if peak_tbps else None,
            "token_ids": tokens}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_throughput(path: Path, prompts, params, batch_sizes, device: str, dtype: torch.dtype,
                  deadline: float) -> dict:
    """HF `generate` in left-padded static batches (as nanoserve.tools.bench does on CPU), on
    `device` in `dtype`. Each batch generates its longest request's length; a batch size whose
    batches run past `deadline` (perf_counter) keeps the batches it finished (they are i.i.d.: the
    rate is unbiased)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    hf = (
        transformers.AutoModelForCausalLM.from_pretrained(str(path)) .to(device=device, dtype=dtype)
        .eval()
    )
    res = {"transformers": transformers.__version__, "runs": [], "best": None}
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0][:8]], device=device), max_new_tokens=2,
                    do_sample=False,
                    pad_token_id=0)  # warm-up
        for bs in batch_sizes:
            run = {"batch_size": bs, "batches": 0, "requests": 0, "output_tokens": 0,
                   "prompt_tokens": 0,
                   "slots": 0, "duration_s": 0.0, "complete": True}
            try:
                for i in range(0, len(prompts), bs):
                    if time.perf_counter() > deadline:
                        run["complete"] = False
                        break
                    batch, ps = prompts[i:i + bs], params[i:i + bs]
                    width, new = max(len(p) for p in batch), max(p.max_tokens for p in ps)
                    # left padding
                    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
                    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                                        device=device)
                    sync()
                    start = time.perf_counter()
                    hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                do_sample=False,
                                pad_token_id=0)
                    sync()
                    run["duration_s"] += time.perf_counter() - start
                    run["batches"] += 1
                    run["requests"] += len(batch)
                    # past a request's own length: waste
                    run["output_tokens"] += sum(p.max_tokens for p in ps)
                    run["prompt_tokens"] += sum(len(p) for p in batch)
                    run["slots"] += len(batch) * (width + new)
            except torch.cuda.OutOfMemoryError as e:
                run["error"] = f"out of memory: {str(e).splitlines()[0]}"
                free()
            if run["batches"]:
                run["output_tok_s"] = run["output_tokens"] / run["duration_s"]
                run["total_tok_s"] = (run["output_tokens"] + run["prompt_tokens"]) / run[
                    "duration_s"
                ]
                run["computed_per_useful_token"] = run["slots"] / (
                    run["output_tokens"] + run["prompt_tokens"]
                )
                if res["best"] is None or run["output_tok_s"] > res["best"]["output_tok_s"]:
                    res["best"] = run
            res["runs"].append(run)
    del hf
    free()
    return res
