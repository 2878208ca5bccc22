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
speculative decoding) can use the exact same law. `sample_next` draws one row's token, the way
to read it; the engine calls `sample_batch`, the same law for every row of a step at once with
one device→host transfer (a GPU pays dearly for one per row). Taught in notebooks/01_* and notebooks/00_*.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import NanoserveError

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as OpenAI's and vLLM's seed fields
_F32 = torch.finfo(torch.float32)


@dataclass
class SamplingParams:
    """One request's sampling settings (vLLM's names), validated on construction."""

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
        """Temperature 0: the argmax, no randomness."""
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
    softmax of +inf is NaN), and top-p keeps at least the most likely token. (A NaN logit counts
    as 0, so a draw still happens; the engine checks for NaN and fails such a request.)
    """
    logits = (logits.float() / temperature).nan_to_num(nan=0.0, posinf=_F32.max, neginf=-_F32.max)  # clamp
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


@torch.inference_mode()  # (also 2-4x faster on CPU: no autograd bookkeeping on the fresh tensors)
def sample_batch(logits: torch.Tensor, params: list[SamplingParams], seen: list[torch.Tensor | None],
                 generators: list[torch.Generator | None]) -> tuple[list[int], list[bool]]:
    """One token for each row of logits [R, V] — row i with params[i], its seen ids (repetition
    penalty) and its generator — with one device→host transfer for the whole batch (`sample_next`
    per row would cost one each). Returns the tokens and which rows held a NaN (their token means
    nothing: the engine fails those requests). Draw for draw equal to `sample_next` on each row:
    the same law, and each seeded row draws from its own generator (tests/test_sampling.py)."""
    nan = logits.amax(-1).isnan()  # R: max propagates NaN (one pass, ~10x cheaper than isnan().any())
    penalized = [i for i, (p, s) in enumerate(zip(params, seen)) if s is not None and p.repetition_penalty != 1.0]
    if penalized:
        logits = logits.clone()  # R, V
        for i in penalized:
            logits[i] = apply_repetition_penalty(logits[i], seen[i], params[i].repetition_penalty)
    tokens = torch.zeros(len(params), dtype=torch.long, device=logits.device)  # R
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == len(params):  # every row greedy: no copy of the [R, V] logits
        tokens = logits.argmax(-1)
    elif greedy:
        g = torch.tensor(greedy, device=logits.device)
        tokens = tokens.index_copy(0, g, logits.index_select(0, g).argmax(-1))
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sub = logits if len(rows) == len(params) else logits[rows]  # S, V
        probs = probs_from_logits_batch(sub, [params[i].temperature for i in rows],
                                        [params[i].top_k for i in rows], [params[i].top_p for i in rows])  # S, V
        drawn = [torch.multinomial(p, 1, generator=generators[i]) for p, i in zip(probs, rows)]  # S × [1]
        tokens = tokens.index_copy(0, torch.tensor(rows, device=logits.device), torch.cat(drawn))
    host = torch.cat([tokens, nan.long()]).tolist()  # the one sync
    R = len(params)
    return host[:R], [bool(b) for b in host[R:]]


def probs_from_logits_batch(logits: torch.Tensor, temperatures: list[float], top_ks: list[int],
                            top_ps: list[float]) -> torch.Tensor:
    """`probs_from_logits` with settings per row: logits [S, V] -> probs [S, V]; row i equals
    probs_from_logits(logits[i], temperatures[i], top_ks[i], top_ps[i]). The settings are host
    values, so top-k and top-p touch only the rows that use them, without asking the device."""
    dev, V = logits.device, logits.shape[-1]
    logits = logits.float() / torch.tensor(temperatures, dtype=torch.float32, device=dev)[:, None]  # S, V
    logits = logits.nan_to_num_(nan=0.0, posinf=_F32.max, neginf=-_F32.max)  # = clamp; a NaN row is flagged
    k_rows = [i for i, k in enumerate(top_ks) if 0 < k < V]
    if k_rows:
        idx = torch.tensor(k_rows, device=dev)
        sub = logits.index_select(0, idx)  # Sk, V
        top = sub.topk(max(top_ks[i] for i in k_rows), dim=-1).values  # Sk, kmax
        kth = top.gather(-1, torch.tensor([[top_ks[i] - 1] for i in k_rows], device=dev))  # Sk, 1: k-th largest
        logits = logits.index_copy(0, idx, sub.masked_fill(sub < kth, float("-inf")))
    probs = logits.softmax(dim=-1)  # S, V
    p_rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if p_rows:
        idx = torch.tensor(p_rows, device=dev)
        sub = probs.index_select(0, idx)  # Sp, V
        top_p = torch.tensor([[top_ps[i]] for i in p_rows], dtype=torch.float32, device=dev)  # Sp, 1
        sorted_p, order = sub.sort(dim=-1, descending=True)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # Sp, V
        drop_sorted[..., 0] = False
        kept = sub.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        probs = probs.index_copy(0, idx, kept / kept.sum(-1, keepdim=True))
    return probs


def mask_from(logits: torch.Tensor | list[torch.Tensor], first: int):
    """Logits with ids ≥ `first` at -inf, never sampled (an embedding padded past the tokenizer's
    vocabulary): [B, V] or a list of [k, V]."""
    if isinstance(logits, list):
        return [mask_from(x, first) for x in logits]
    return torch.cat([logits[..., :first], torch.full_like(logits[..., first:], float("-inf"))], dim=-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A private random stream for a seeded request; None means torch's global one."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
