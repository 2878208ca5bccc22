"""Perplexity: how well a model predicts a text, by sliding-window negative log-likelihood.

Convention (stated once, used everywhere): losses are natural-log **nats**; we report the
mean NLL per token, per byte of UTF-8 text (comparable across tokenizers), the same in bits,
and perplexity = exp(NLL per token).

Windows: the text is tokenized once (no BOS). A window holds up to `context` tokens (one of
them a BOS when the model family uses one); consecutive windows start `stride` tokens apart,
and each scores only the tokens no earlier window scored, so every token is scored exactly
once, with at least context − stride tokens of history once past the first window.
stride = context (− 1 with BOS) gives non-overlapping windows; a smaller stride gives more
history per token and costs more forwards. Without a BOS the very first token has no
prediction and is not scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .errors import NanoserveError


@dataclass
class PerplexityResult:
    nll_sum: float  # nats
    n_tokens: int
    n_bytes: int
    n_windows: int
    context: int
    stride: int

    @property
    def nats_per_token(self) -> float:
        return self.nll_sum / self.n_tokens

    @property
    def nats_per_byte(self) -> float:
        return self.nll_sum / self.n_bytes

    @property
    def bits_per_byte(self) -> float:
        return self.nats_per_byte / math.log(2)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats_per_token)

    def as_dict(self) -> dict:
        return dict(nats_per_token=self.nats_per_token, nats_per_byte=self.nats_per_byte,
                    bits_per_byte=self.bits_per_byte, perplexity=self.perplexity, n_tokens=self.n_tokens,
                    n_bytes=self.n_bytes, n_windows=self.n_windows, context=self.context, stride=self.stride)

    def table(self) -> str:
        return "\n".join(f"{k:>15}: {v:.4f}" if isinstance(v, float) else f"{k:>15}: {v}"
                         for k, v in self.as_dict().items())


def read_text(path: str | Path) -> str:
    """A non-empty UTF-8 text file; anything else is a clear error (we do not guess encodings)."""
    p = Path(path)
    if not p.is_file():
        raise NanoserveError(f"text file {str(p)!r} does not exist")
    data = p.read_bytes()
    if not data.strip():
        raise NanoserveError(f"text file {str(p)!r} is empty")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NanoserveError(
            f"text file {str(p)!r} is not UTF-8 (invalid byte at offset {e.start}); convert it to UTF-8 first") from e


@torch.inference_mode()
def perplexity(model, tokenizer, text: str, context: int | None = None, stride: int | None = None,
               max_tokens: int | None = None, add_bos: bool | None = None,
               progress: bool = True) -> PerplexityResult:
    """Sliding-window NLL of `text` under `model` (read a file with `read_text`)."""
    cfg = model.config
    if not text:
        raise NanoserveError("text to evaluate is empty")
    if add_bos is None:
        add_bos = cfg.arch == "llama" and tokenizer.bos_id is not None
    context = context or cfg.max_position_embeddings
    if not 2 <= context <= cfg.max_position_embeddings:
        raise NanoserveError(
            f"context={context} is outside 2..{cfg.max_position_embeddings} (the model's context length)")
    budget = context - add_bos  # text tokens per window
    stride = stride or max(1, budget // 2)
    if not 1 <= stride <= budget:
        raise NanoserveError(f"stride={stride} must be in 1..{budget} (the text tokens per window)")
    ids = tokenizer.encode(text)
    if max_tokens:
        ids = ids[:max_tokens]
    if len(ids) < 2 - add_bos:
        raise NanoserveError("text is too short to score: it has fewer than 2 tokens")
    device = next(model.parameters()).device
    nll, scored_from, prev_end, windows = 0.0, None, 0, 0
    starts = range(0, max(1, len(ids) - budget + stride), stride)
    for begin in tqdm(starts, desc="eval", unit="win", disable=not progress):
        end = min(begin + budget, len(ids))
        if end <= prev_end:
            break
        window = ([tokenizer.bos_id] if add_bos else []) + ids[begin:end]
        x = torch.tensor([window], device=device)
        logp = F.log_softmax(model(x)[0].float(), dim=-1)  # T, V
        # position j predicts window[j + 1]; score the targets not scored by an earlier window
        first = max(prev_end, begin if add_bos else begin + 1)  # index into ids of first scored target
        targets = torch.tensor(ids[first:end], device=device)
        pred_rows = torch.arange(first - begin + add_bos - 1, end - begin + add_bos - 1, device=device)
        nll -= logp[pred_rows, targets].sum().item()
        scored_from = first if scored_from is None else scored_from
        prev_end, windows = end, windows + 1
    n_tokens = prev_end - scored_from
    n_bytes = len(tokenizer.decode_bytes(ids[scored_from:prev_end]))
    return PerplexityResult(nll, n_tokens, n_bytes, windows, context, stride)
