"""Perplexity: how well a model predicts a text, by sliding-window negative log-likelihood.

Convention (stated once, used everywhere): losses are natural-log **nats**; we report the
mean NLL per token, per byte of UTF-8 text (comparable across tokenizers), the same in bits,
and perplexity = exp(NLL per token).

Windows: the text is tokenized once (no BOS). Targets are scored in consecutive chunks of
`stride` tokens; each chunk is scored in one window of up to `context` tokens that ends with
the chunk (plus a BOS in front when the model family uses one), so every token is scored
exactly once, with at least context − stride tokens of history once past the first window.
The largest stride (context − 1 without BOS, context − 1 text tokens + BOS with it) gives
non-overlapping windows; a smaller stride gives more history per token and costs more
forwards. Without a BOS the very first token has no prediction and is not scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import NanoserveError


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
                    bits_per_byte=self.bits_per_byte, perplexity=self.perplexity,
                    n_tokens=self.n_tokens,
                    n_bytes=self.n_bytes, n_windows=self.n_windows, context=self.context,
                    stride=self.stride)

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
            f"text file {str(p)!r} is not UTF-8 (invalid byte at offset {e.start}); convert it to "
            "UTF-8 first") from e


@torch.inference_mode()
def perplexity(model, tokenizer, text: str, context: int | None = None, stride: int | None = None,
               max_tokens: int | None = None, add_bos: bool | None = None,
               batch_size: int = 8, progress: bool = True) -> PerplexityResult:
    """Sliding-window NLL of `text` under `model` (read a file with `read_text`)."""
    cfg = model.config
    if not text:
        raise NanoserveError("text to evaluate is empty")
    if tokenizer is None:
        raise NanoserveError("this model was loaded without a tokenizer, so it cannot read text; "
                             "put the model's tokenizer files beside its weights")
    if add_bos is None:
        add_bos = cfg.adds_bos and tokenizer.bos_id is not None
    context = context or cfg.max_position_embeddings
    if not 2 <= context <= cfg.max_position_embeddings:
        raise NanoserveError(
            f"context={context} is outside 2..{cfg.max_position_embeddings} (the model's context "
            "length)")
    budget = context - add_bos  # text tokens per window
    max_stride = budget if add_bos else budget - 1  # without BOS a target needs one token before it
    stride = stride or max(1, budget // 2)
    if not 1 <= stride <= max_stride:
        raise NanoserveError(f"stride={stride} must be in 1..{max_stride} for context={context} "
                             f"({'a BOS plus' if add_bos else 'one token of history before'} the "
                             "scored tokens)")
    ids = tokenizer.encode(text)
    if max_tokens:
        ids = ids[:max_tokens]
    if len(ids) < 2 - add_bos:
        raise NanoserveError("text is too short to score: it has fewer than 2 tokens")
    windows = plan_windows(len(ids), budget, stride, add_bos)
    bos = [tokenizer.bos_id] if add_bos else []
    device = next(model.parameters()).device
    nll = 0.0
    batches = [windows[i:i + batch_size] for i in range(0, len(windows), batch_size)]
    for batch in tqdm(batches, desc="eval", unit="batch", disable=not progress):
        # windows in a batch share a length except possibly the last one of the text
        for group in _same_length(batch):
            x = torch.tensor([bos + ids[b:e] for b, e, _ in group], device=device)  # W, T
            logp = F.log_softmax(model(x).float(), dim=-1)  # W, T, V
            for row, (b, e, first) in enumerate(group):
                # position j of the window predicts its token j + 1; score targets first..e-1
                targets = torch.tensor(ids[first:e], device=device)
                rows = torch.arange(first - b + add_bos - 1, e - b + add_bos - 1, device=device)
                nll -= logp[row, rows, targets].sum().item()
    scored_from, end = windows[0][2], windows[-1][1]
    n_bytes = len(tokenizer.decode_bytes(ids[scored_from:end]))
    return PerplexityResult(nll, end - scored_from, n_bytes, len(windows), context, stride)


def plan_windows(n: int, budget: int, stride: int, add_bos: bool) -> list[tuple[int, int, int]]:
    """(begin, end, first scored index) per window; every index 1..n-1 (0..n-1 with BOS) scored
    once.

    Targets are scored in consecutive chunks of `stride`; each chunk's window reaches back as
    far as the budget allows, so a chunk's first target always has its prediction inside it.
    """
    windows, first = [], 0 if add_bos else 1
    while first < n:
        end = min(first + stride, n)
        windows.append((max(0, end - budget), end, first))
        first = end
    return windows


def _same_length(batch):
    lengths = sorted({e - b for b, e, _ in batch})
    return [[w for w in batch if w[1] - w[0] == n] for n in lengths]


@torch.inference_mode()
def acceptance_stats(target, draft, ids: list[int], context: int = 256,
                     max_windows: int = 32) -> dict:
    """How often a draft's proposals would be accepted by the target (speculative decoding).

    Over held-out positions (non-overlapping windows of `ids`): at temperature 1,
    α = E[Σ_x min(p(x), q(x))], the acceptance probability of the rejection sampler
    (Leviathan et al. 2023); at temperature 0, the rate at which both argmaxes agree.
    Also the implied expected tokens per target call, (1 − α^(γ+1)) / (1 − α), for γ = 1..8.
    """
    device = next(target.parameters()).device
    n = (len(ids) // context) * context
    x = torch.tensor(ids[:n], device=device).view(-1, context)[:max_windows]  # W, T
    p = target(x).float().softmax(-1)  # W, T, V
    q = draft(x).float().softmax(-1)
    alpha = {"1.0": torch.minimum(p, q).sum(-1).mean().item(),
             "0": (p.argmax(-1) == q.argmax(-1)).float().mean().item()}
    out = {"positions": int(x.numel()), "alpha": alpha, "expected_tokens_per_step": {}}
    for temp, a in alpha.items():
        out["expected_tokens_per_step"][temp] = {
            g: (1 - a ** (g + 1)) / (1 - a) for g in range(1, 9)
        }
    return out
