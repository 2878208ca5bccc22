"""Sampling: turning next-token logits into a token.

`SamplingParams` holds one request's settings and validates them on construction. The
pipeline, in the order vLLM and HF apply it:

    logits ─ repetition penalty ─ /temperature ─ top-k ─ top-p ─ softmax ─ draw (seeded)

Temperature 0 means greedy (argmax after the penalty). Each request with a `seed` draws from
its own `torch.Generator`, so the same seed gives the same tokens whatever else runs beside
it; sample i of n uses seed + i, so seeds live in the signed 64-bit range with room for n.

Values are checked in the dtype they are used in (float32): a top_p of 1e-300 is a positive
Python float but 0 in float32. And the sampler cannot turn finite logits into NaN: scaled
logits are clamped to float32's finite range and top-p always keeps the most likely token.

`probs_from_logits` is the distribution that is actually sampled, exposed so tests (and
speculative decoding) can use the exact same law. Taught in notebooks/01_* and notebooks/00_*.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import NanoserveError

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as OpenAI's and vLLM's seed fields
_F32 = torch.finfo(torch.float32)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set with probability ≥ top_p (Holtzman et al. 2019); 1 = off
    repetition_penalty: float = 1.0  # CTRL's rule (Keskar et al. 2019), see apply_repetition_penalty
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1  # parallel samples of one prompt (they share the prompt's KV blocks)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens > 0,
               f"max_tokens={self.max_tokens!r} must be an integer ≥ 1")
        _check(isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1,
               f"n={self.n!r} must be an integer ≥ 1")
        _check(_is_number(self.temperature) and 0 <= self.temperature < float("inf")
               and (self.temperature == 0 or self.temperature >= 1e-6),
               f"temperature={self.temperature!r} must be 0 (greedy) or a finite number ≥ 1e-6")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0,
               f"top_k={self.top_k!r} must be an integer ≥ 0 (0 = off)")
        _check(_is_number(self.top_p) and _F32.tiny <= self.top_p <= 1,
               f"top_p={self.top_p!r} must be in (0, 1] and a normal float32 (≥ {_F32.tiny:.3g}); 1 = off")
        _check(_is_number(self.repetition_penalty) and _F32.tiny <= self.repetition_penalty <= _F32.max,
               f"repetition_penalty={self.repetition_penalty!r} must be > 0 and a normal float32 "
               f"({_F32.tiny:.3g} to {_F32.max:.3g}); 1 = off")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids={self.stop_token_ids!r} must be non-negative integers")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop={self.stop!r} must be non-empty strings")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                     and SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1)),
               f"seed={self.seed!r} must be None or an integer in [{SEED_MIN}, {SEED_MAX} - (n - 1)] "
               f"(sample i of n={self.n} is seeded seed + i, a signed 64-bit value)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise NanoserveError(message)


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's rule: for every token already seen, a positive logit is divided by the penalty and a
    negative one multiplied by it (both make it less likely for penalty > 1). logits [V] or [B, V]."""
    if penalty == 1.0 or seen_ids.numel() == 0:
        return logits
    seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    seen[seen_ids.to(logits.device)] = True
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution sampled from: softmax(logits / T) restricted to the top-k / top-p set.

    logits [..., V] -> probs [..., V] in float32. Tokens outside the kept set get exactly 0.
    Finite logits give finite probabilities whatever the settings: the scaled logits are clamped
    to float32's finite range (a penalty or a tiny temperature can overflow them to ±inf, and
    softmax of +inf is NaN), and top-p keeps at least the most likely token.
    """
    logits = (logits.float() / temperature).clamp(-_F32.max, _F32.max)
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # ..., 1
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token when the tokens strictly more likely than it already reach top_p
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        drop_sorted[..., 0] = False  # the most likely token always stays (top_p rounds to 0 otherwise)
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_next(logits: torch.Tensor, params: SamplingParams, seen_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> int:
    """One token id from one position's logits [V]."""
    if seen_ids is not None:
        logits = apply_repetition_penalty(logits, seen_ids, params.repetition_penalty)
    if params.greedy:
        return int(logits.argmax())
    probs = probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A private random stream for a seeded request; None means torch's global one."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
