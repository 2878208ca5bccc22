"""A compact trainer (nanoGPT-like) and distillation, used to build the shipped demo models.

    python -m nanoserve.tools.train --preset demo --data PATH/TO/tinyshakespeare/input.txt
    python -m nanoserve.tools.train --preset demo-draft --teacher nanoserve/assets/demo --data ...

Byte-level data (token id = byte value, the `byte_level_tokenizer`), first 90 % train, last
10 % validation. AdamW, linear warmup then cosine decay, gradient clipping, a fixed seed,
periodic evaluation, and a checkpoint in the HF layout the loader reads.

Distillation trains a small draft to imitate a target: loss = KL(p_target ‖ q_draft) over the
target's full next-token distribution at every position (Hinton et al. 2015; for speculative
decoding, a draft closer to the target in KL is accepted more often), optionally mixed with
the ordinary cross-entropy on the data.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import NanoserveError
from ..models import build_model
from ..models.config import ModelConfig
from ..models.loader import load_model, save_checkpoint
from ..tokenizers import byte_level_tokenizer, save_hf_tokenizer, save_tiktoken

BYTE_VOCAB = 257  # 256 bytes + <|endoftext|>
BOS = 256  # <|endoftext|>, the BOS of a model trained with `bos_first`


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 32
    block_size: int = 128
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_batches: int = 20
    seed: int = 1337
    distill_alpha: float = 1.0  # weight of KL(target ‖ draft) vs cross-entropy, when distilling
    threads: int = 0  # torch threads; 0 = torch's default
    # every window starts with <|endoftext|> (id 256, then also the tokenizer's BOS), as documents
    # start with a BOS; False: windows start at random bytes
    bos_first: bool = False
    save_dtype: str = "float32"  # the checkpoint's dtype


# The shipped pair. Sized for a 2-core CPU (see the model cards for time and loss).
PRESETS: dict[str, tuple[ModelConfig, TrainConfig]] = {
    "demo": (
        ModelConfig(arch="gpt2", vocab_size=BYTE_VOCAB, hidden_size=256, n_layers=6, n_heads=4,
                    n_kv_heads=4,
                    intermediate_size=1024, max_position_embeddings=256, eos_token_ids=[256]),
        TrainConfig(steps=3000, batch_size=32, block_size=128, lr=2e-3),
    ),
    "demo-draft": (
        ModelConfig(arch="llama", vocab_size=BYTE_VOCAB, hidden_size=128, n_layers=2, n_heads=4,
                    n_kv_heads=2,
                    intermediate_size=384, max_position_embeddings=256, norm_eps=1e-5,
                    tie_word_embeddings=True, eos_token_ids=[256]),
        TrainConfig(steps=1500, batch_size=32, block_size=128, lr=3e-3),
    ),
    # A Llama whose every training window starts with BOS, trained with weight decay 0.5 and a high
    # learning rate: the conditions under which softmax attention parks mass on the first token
    # (Gu et al. 2024). Notebook 20's model with attention sinks; saved in bfloat16.
    "demo-sinks": (
        ModelConfig(arch="llama", vocab_size=BYTE_VOCAB, hidden_size=128, n_layers=6, n_heads=8,
                    n_kv_heads=8, intermediate_size=384, max_position_embeddings=256,
                    norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=256,
                    eos_token_ids=[256]),
        TrainConfig(steps=2000, batch_size=16, block_size=256, lr=6e-3, min_lr=6e-4, warmup=50,
                    weight_decay=0.5, bos_first=True, save_dtype="bfloat16"),
    ),
    # a few seconds; for tests and the notebook
    "tiny": (
        ModelConfig(arch="gpt2", vocab_size=BYTE_VOCAB, hidden_size=32, n_layers=1, n_heads=2,
                    n_kv_heads=2,
                    intermediate_size=64, max_position_embeddings=64, eos_token_ids=[256]),
        TrainConfig(steps=40, batch_size=8, block_size=32, lr=3e-3, warmup=5, eval_interval=20,
                    eval_batches=4),
    ),
}


def load_bytes(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte ids of a text file, split 90 % train / 10 % validation (the usual tinyshakespeare
    split)."""
    data = Path(path).read_bytes()
    if len(data) < 1000:
        raise NanoserveError(f"{path} has {len(data)} bytes; training needs at least 1000")
    ids = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
    n = int(0.9 * len(ids))
    return ids[:n], ids[n:]


def get_batch(data: torch.Tensor, batch_size: int, block_size: int, gen: torch.Generator,
              bos: int | None = None):
    """Random windows: x [B, T] and the next-byte targets y [B, T]. With `bos`, every window
    starts with that token and the bytes follow it: x = [bos, b0 .. b(T-2)], y = [b0 .. b(T-1)]."""
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    if bos is None:
        x = torch.stack([data[s:s + block_size] for s in starts])
        y = torch.stack([data[s + 1:s + block_size + 1] for s in starts])
        return x, y
    y = torch.stack([data[s:s + block_size] for s in starts])
    return bos_first_inputs(y, bos), y


def bos_first_inputs(targets: torch.Tensor, bos: int) -> torch.Tensor:
    """The inputs [B, T] that predict `targets` [B, T] when every window starts with `bos`:
    [bos, t0 .. t(T-2)]."""
    first = torch.full((len(targets), 1), bos, dtype=targets.dtype)
    return torch.cat([first, targets[:, :-1]], dim=1)


def window_bos(tc: TrainConfig) -> int | None:
    """The token every training window starts with, or None."""
    return BOS if tc.bos_first else None


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup, then cosine decay from lr to min_lr."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = min(1.0, (step - tc.warmup) / max(1, tc.steps - tc.warmup))
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))


def init_weights(model: torch.nn.Module, n_layers: int) -> None:
    """GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers), zero biases."""
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("c_proj.weight", "o_proj.weight",
                                                                     "down_proj.weight")) else 0.02
            torch.nn.init.normal_(p, 0.0, std)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)


def trim_context(model, n: int):
    """Positions past the training block length were never trained (GPT-2's learned position rows
    stay at their random init; RoPE models never saw those distances), so the saved model's
    context is the block length: generating further would produce noise."""
    cfg = model.config
    if cfg.max_position_embeddings <= n:
        return model
    cfg.max_position_embeddings = n
    if cfg.arch == "gpt2":
        wpe = model.transformer.wpe
        model.transformer.wpe = torch.nn.Embedding(n, wpe.embedding_dim,
                                                   _weight=wpe.weight.data[:n].clone())
    return model


def loss_fn(model, x, y, teacher=None, alpha: float = 1.0) -> torch.Tensor:
    logits = model(x)  # B, T, V
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    if teacher is None:
        return ce
    with torch.no_grad():
        p_log = F.log_softmax(teacher(x).float(), dim=-1)  # B, T, V
    kl = F.kl_div(F.log_softmax(logits, dim=-1), p_log, log_target=True,
                  reduction="none").sum(-1).mean()
    return alpha * kl + (1 - alpha) * ce


@torch.no_grad()
def estimate(model, data, tc: TrainConfig, teacher=None) -> dict[str, float]:
    """Mean loss (nats/byte) and, when distilling, KL to the teacher, on fixed random windows."""
    model.eval()
    gen = torch.Generator().manual_seed(0)
    ce, kl = [], []
    for _ in range(tc.eval_batches):
        x, y = get_batch(data, tc.batch_size, tc.block_size, gen, window_bos(tc))
        ce.append(loss_fn(model, x, y).item())
        if teacher is not None:
            kl.append(loss_fn(model, x, y, teacher, alpha=1.0).item())
    model.train()
    out = {"loss": float(np.mean(ce))}
    if kl:
        out["kl"] = float(np.mean(kl))
    return out


def train(model_cfg: ModelConfig, tc: TrainConfig, data_path: str | Path,
          out_dir: str | Path | None = None,
          teacher=None, progress: bool = True) -> tuple[torch.nn.Module, dict]:
    """Train (or distill, when `teacher` is given) a model on byte-level data; return it and a
    log."""
    if tc.threads:
        torch.set_num_threads(tc.threads)
    torch.set_flush_denormal(True)  # tiny gradients as denormals slow CPU matmuls ~50x
    torch.manual_seed(tc.seed)
    train_ids, val_ids = load_bytes(data_path)
    model = build_model(model_cfg)
    init_weights(model, model_cfg.n_layers)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr,
                            betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(tc.seed)
    log: dict = {"evals": [], "train_config": asdict(tc), "model_config": model_cfg.to_dict()}
    t0 = time.perf_counter()
    bar = tqdm(range(tc.steps), disable=not progress, desc="train")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tc)
        x, y = get_batch(train_ids, tc.batch_size, tc.block_size, gen, window_bos(tc))
        loss = loss_fn(model, x, y, teacher, tc.distill_alpha)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % tc.eval_interval == 0 or step + 1 == tc.steps:
            ev = {"step": step + 1, "time_s": round(time.perf_counter() - t0, 1),
                  **{f"val_{k}": v for k, v in estimate(model, val_ids, tc, teacher).items()}}
            log["evals"].append(ev)
            tqdm.write(json.dumps(ev)) if progress else None
    log["train_time_s"] = round(time.perf_counter() - t0, 1)
    model = trim_context(model, tc.block_size)
    log["threads"] = torch.get_num_threads()
    log["device"] = f"CPU ({platform.machine()}), {torch.get_num_threads()} threads"
    model.eval()
    if out_dir is not None:
        save_checkpoint(model.to(getattr(torch, tc.save_dtype)), out_dir)
        model.float()
        tokenizer = byte_level_tokenizer(bos=tc.bos_first)
        save_tiktoken(tokenizer, out_dir)
        # for HF tools
        save_hf_tokenizer(tokenizer, out_dir, model.config.max_position_embeddings)
        (Path(out_dir) / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return model, log


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    ap.add_argument("--data", required=True, help="a UTF-8 text file (tinyshakespeare's input.txt)")
    ap.add_argument("--out", help="output directory (default: nanoserve/assets/<preset>)")
    ap.add_argument("--teacher", help="distil from this model (a path or a shipped name)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int)
    args = ap.parse_args(argv)
    model_cfg, tc = PRESETS[args.preset]
    tc = replace(tc, threads=args.threads,
                 **{k: v for k, v in (("steps", args.steps), ("seed", args.seed)) if v})
    teacher = None
    if args.teacher:
        teacher, _, _ = load_model(args.teacher, dtype="float32", device="cpu")
        teacher.requires_grad_(False)
    out = args.out or str(Path(__file__).parent / "assets" / args.preset)
    train(model_cfg, tc, args.data, out, teacher=teacher)
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
