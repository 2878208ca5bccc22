"""Speculative decoding, the algorithm: guess γ tokens cheaply, check them all with one target
forward, keep a prefix, and still sample exactly from the target.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and Chen et al.
2023 ("Accelerating LLM decoding with speculative sampling"); their names: p the target's
next-token distribution, q the draft's, γ (`num_speculative_tokens`) the tokens drafted per step,
α the acceptance rate. This file is model-agnostic: tensors and callables in, tokens out. The
engine side (paged KV caches, batching, rollback of blocks) lives in spec_decode.py; the proposers
in proposers.py, a reference loop over toy models in reference.py.
Taught in notebooks/08_*.

**Why verification is parallel and generation is not.** Token t+1 depends on token t, so a model
generates one token per forward. But given a *guessed* continuation x₁..x_γ, one forward over the
γ guesses yields the target's distributions p₁..p_{γ+1} at every position at once (a causal mask is
all it takes, exactly as in prefill). Decoding is memory-bound, so that forward costs about as
much as a one-token step; every accepted guess is a target forward saved.

**Why the output law is still p** (one position; `speculative_law` computes it). Draw x ~ q and
accept it with probability min(1, p(x)/q(x)); on rejection draw from the residual
r = (p − q)₊ / Σ(p − q)₊. With β = Σ min(p, q) (the chance to accept), Σ(p − q)₊ = 1 − β, so

    P(x) = q(x)·min(1, p(x)/q(x)) + (1 − β)·r(x) = min(p, q)(x) + (p − q)₊(x) = p(x).

Positions chain: after an acceptance the next check is the same one-step argument conditioned on
the prefix, and the first rejection ends the step, so each step emits a sample of p's
autoregressive law. If all γ are accepted, p_{γ+1} was computed anyway: a bonus token is free.
A step emits between 1 and γ + 1 tokens; with i.i.d. acceptances at rate α the mean is
`expected_tokens_per_step(α, γ)` = (1 − α^(γ+1)) / (1 − α).

**For the engine.** p[i] must be the target's *sampling* distribution (`probs_from_logits` with
the request's temperature / top-k / top-p) at the position that predicts draft token i, i.e. the
logits of (last accepted token, x₁, .., x_γ). q[i] must be the distribution x_i was actually drawn
from (None for a deterministic proposal: n-gram lookup, greedy draft). After verification the
target's cache holds K/V for all drafts: keep the first `num_accepted`, drop the rest (rollback);
the last emitted token has no K/V yet, like any freshly sampled token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..config import MAX_SPECULATIVE_TOKENS
from ..errors import check, is_int

# fills the unused tail of rejection_sample_batch's output rows (vLLM's placeholder)
PAD_TOKEN_ID = -1

Generators = torch.Generator | Sequence[torch.Generator | None] | None


# --------------------------------------------------------------------------- the one-step law
def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """β = Σ_x min(p, q)(x) = 1 − TV(p, q): the chance a draft token from q is accepted. [..., V] ->
    [...]"""
    return torch.minimum(p, q).sum(-1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p − q, 0)): what to sample after a rejection. p, q [..., V] -> [..., V].

    In exact arithmetic a rejection needs p(x) < q(x) for the drafted x, hence mass where p > q too,
    so the residual is never empty when it is used. With rounded probabilities p ≤ q can hold
    everywhere (say p = q·(1 − 1e-7)); there we return p itself, the law the residual stands in
    for. That changes the output law by at most the rejection probability, itself rounding-sized.
    """
    r = (p - q).clamp_min(0)  # ..., V
    mass = r.sum(-1, keepdim=True)  # ..., 1
    return torch.where(mass > 0, r / torch.where(mass > 0, mass, 1), p)


def _acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for drafted tokens x; 0 where q(x) = 0 (such an x is never proposed)."""
    return torch.where(q_x > 0, p_x / torch.where(q_x > 0, q_x, 1), 0).clamp(max=1)


def speculative_law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exact law of the token one step emits at a position, in float64, built from the same
    acceptance rule and residual the samplers use. p, q [..., V] -> [..., V]; equals p when p and q
    are distributions (the proof in the module docstring; tests/test_speculative_core.py checks
    it)."""
    check(p.shape == q.shape,
          f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    p, q = p.double(), q.double()
    accepted = q * _acceptance_probability(p, q)  # ..., V: draw x from q, keep it = min(p, q)
    rejected = (q - accepted).sum(-1, keepdim=True)  # ..., 1: 1 − β
    return accepted + rejected * residual_distribution(p, q)


# --------------------------------------------------------------------------- verification
def rejection_sample(draft_ids: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Verify one sequence's draft: (tokens to emit, number of draft tokens accepted).

    draft_ids [γ] long, q [γ, V] (None: a deterministic proposal, q one-hot at each draft token),
    p [γ+1, V]. Keeps x_i with probability min(1, p_i(x_i)/q_i(x_i)); the first rejected one is
    replaced by a draw from the residual and ends the step; if all are kept a bonus token comes
    from p[γ]. Returns 1..γ+1 tokens. γ = 0 (a proposer found nothing) is an ordinary decode step.
    The readable form of `rejection_sample_batch`; both draw the same random numbers in the same
    order, so with one seeded generator they agree token for token.
    """
    draft_ids = draft_ids.to(p.device)
    gamma, vocab = _check_draft(draft_ids, q, p)
    if q is None:
        q = F.one_hot(draft_ids, vocab).to(p.dtype)  # γ, V
    # γ: one coin per draft token
    u = torch.rand(gamma, generator=generator, dtype=p.dtype, device=p.device)
    # V: for the one token drawn from a law
    noise = exponential_noise((vocab,), generator, p.dtype, p.device)
    pos = torch.arange(gamma, device=p.device)
    keep = _acceptance_probability(p[pos, draft_ids], q[pos, draft_ids])  # γ
    tokens: list[int] = []
    for i in range(gamma):
        if not u[i] < keep[i]:  # rejected: the residual replaces x_i, later drafts are discarded
            return tokens + [int(sample_by_noise(residual_distribution(p[i], q[i]), noise))], i
        tokens.append(int(draft_ids[i]))
    # all kept: a bonus token from p[γ]
    return tokens + [int(sample_by_noise(p[gamma], noise))], gamma


def rejection_sample_batch(draft_ids: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                           num_draft_tokens: torch.Tensor | Sequence[int] | None = None,
                           generator: Generators = None, check_inputs: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample` for B sequences at once, each with its own draft length.

    draft_ids [B, γ] long, q [B, γ, V] or None (deterministic proposals), p [B, γ+1, V], and
    num_draft_tokens [B] (default γ): row b uses draft_ids[b, :n_b], q[b, :n_b], p[b, :n_b+1]; the
    padding may hold anything. `generator` is one generator for the batch, or one per row (None
    entries: torch's global one) so that a seeded request draws the same numbers whoever shares
    its batch. Returns output_ids [B, γ+1], the emitted tokens left-aligned and padded with
    PAD_TOKEN_ID, and num_accepted [B]; row b emitted num_accepted[b] + 1 tokens.

    Greedy rows fit in the same call: with p one-hot at the target's argmax every coin is 0 or 1
    and the result is `greedy_verify`'s.

    `check_inputs=False` skips the checks that read device values (ids in the vocabulary, q > 0 at
    each draft): the engine's drafts are valid by construction, and each read stalls a GPU
    (spec/batch_verify.py).
    """
    batch, gamma = draft_ids.shape if draft_ids.dim() == 2 else (0, 0)
    check(
        draft_ids.dim() == 2 and 1 <= gamma <= MAX_SPECULATIVE_TOKENS
        and not draft_ids.is_floating_point(),
        f"draft_ids must be integers [B, γ] with 1 ≤ γ ≤ {MAX_SPECULATIVE_TOKENS}, "
        f"got {draft_ids.dtype} of shape {tuple(draft_ids.shape)}",
    )
    check(p.dim() == 3 and p.shape[:2] == (batch, gamma + 1),
           f"p must be [B, γ+1, V] = [{batch}, {gamma + 1}, V], got {tuple(p.shape)}")
    vocab, dev = p.shape[-1], p.device
    if q is not None:
        check(q.shape == (batch, gamma, vocab),
               f"q must be [B, γ, V] = [{batch}, {gamma}, {vocab}] (same vocabulary as p), got "
               f"{tuple(q.shape)}")
    lengths = _draft_lengths(num_draft_tokens, batch, gamma)  # B host integers
    n = torch.tensor(lengths, dtype=torch.long).to(dev, non_blocking=True)  # B
    valid = torch.arange(gamma, device=dev) < n[:, None]  # B, γ
    ids = draft_ids.to(dev).masked_fill(~valid, 0)  # B, γ: padding replaced by a harmless index
    if check_inputs:
        check(bool(((ids >= 0) & (ids < vocab)).all()),
              f"draft token ids must be in 0..{vocab - 1}")
    rows = torch.arange(batch, device=dev)

    p_x = p[:, :gamma].gather(-1, ids[..., None]).squeeze(-1)  # B, γ
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, ids[..., None]).squeeze(-1)  # B, γ
    if check_inputs:
        _check_proposed(q_x[valid])
    u, noise = _draw(lengths, gamma, vocab, generator, p.dtype, dev)  # B, γ and B, V
    kept = (u < _acceptance_probability(p_x, q_x)) & valid  # B, γ
    # B: the accepted prefix ends at the first rejection
    num_accepted = kept.long().cumprod(-1).sum(-1)
    # B, B: the decisive position (clamped for q)
    k, last = num_accepted, num_accepted.clamp(max=gamma - 1)

    p_k = p[rows, k]  # B, V: the target where the step ends (a rejection, or the bonus position)
    q_k = F.one_hot(ids[rows, last], vocab).to(p.dtype) if q is None else q[rows, last]  # B, V
    rejected = (k < n)[:, None]  # B, 1
    token = sample_by_noise(torch.where(rejected, residual_distribution(p_k, q_k), p_k), noise)  # B

    pos = torch.arange(gamma + 1, device=dev)
    out = torch.where(pos < k[:, None], F.pad(ids, (0, 1)), PAD_TOKEN_ID)  # B, γ+1
    out[rows, k] = token
    return out, num_accepted


def _draft_lengths(num_draft_tokens, batch: int, gamma: int) -> list[int]:
    """rejection_sample_batch's draft length per row, as host integers (a tensor given on the
    device is read once; the engine passes a list)."""
    if num_draft_tokens is None:
        return [gamma] * batch
    if isinstance(num_draft_tokens, torch.Tensor):
        num_draft_tokens = num_draft_tokens.tolist()
    lengths = list(num_draft_tokens)
    check(len(lengths) == batch and all(is_int(m) and 0 <= m <= gamma for m in lengths),
          f"num_draft_tokens must be {batch} integers in 0..{gamma}, got {lengths}")
    return lengths


def greedy_verify_batch(draft_ids: torch.Tensor, logits: torch.Tensor,
                        num_draft_tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_verify` for B rows at once, on the device: draft_ids [B, γ] (row b's first n_b
    valid), logits [B, γ+1, V] -> output_ids [B, γ+1] (padded with PAD_TOKEN_ID) and num_accepted
    [B], as `rejection_sample_batch` returns them. Reads nothing back."""
    batch, gamma = draft_ids.shape
    dev = logits.device
    best = logits.argmax(-1)  # B, γ+1: the target's choice after each draft prefix
    n = torch.tensor(list(num_draft_tokens), dtype=torch.long).to(dev, non_blocking=True)
    valid = torch.arange(gamma, device=dev) < n[:, None]  # B, γ
    ids = draft_ids.to(dev)
    num_accepted = ((best[:, :gamma] == ids) & valid).long().cumprod(-1).sum(-1)  # B
    pos = torch.arange(gamma + 1, device=dev)
    out = torch.where(pos < num_accepted[:, None], F.pad(ids, (0, 1)), PAD_TOKEN_ID)  # B, γ+1
    rows = torch.arange(batch, device=dev)
    out[rows, num_accepted] = best[rows, num_accepted]  # where the drafts stop: the target's own
    return out, num_accepted


def greedy_verify(draft_ids: torch.Tensor, p_or_logits: torch.Tensor) -> tuple[list[int], int]:
    """Temperature 0: keep draft tokens while they equal the target's argmax, then add the target's
    argmax where they first differ (or after the last draft). draft_ids [γ], p_or_logits [γ+1, V]
    (argmax is the same for both). The emitted tokens are what plain greedy decoding of the target
    produces, token for token: each is the target's argmax given every token before it."""
    draft_ids = draft_ids.to(p_or_logits.device)
    gamma, _ = _check_draft(draft_ids, None, p_or_logits)
    best = p_or_logits.argmax(-1)  # γ+1: the target's choice after each draft prefix
    tokens: list[int] = []
    for i in range(gamma):
        if int(best[i]) != int(draft_ids[i]):
            return tokens + [int(best[i])], i
        tokens.append(int(draft_ids[i]))
    return tokens + [int(best[gamma])], gamma


# --------------------------------------------------------------------------- sampling helpers
def exponential_noise(shape: tuple[int, ...], generator: torch.Generator | None, dtype,
                      device) -> torch.Tensor:
    e = torch.empty(shape, dtype=dtype, device=device).exponential_(generator=generator)
    return e.clamp_min(torch.finfo(dtype).tiny)  # exponential_ may return exactly 0 (rate ~2^-24)


def sample_by_noise(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(w / E) with E ~ Exp(1) i.i.d. picks i with probability w_i / Σw: of independent
    exponential clocks with rates w_i, clock i rings first with that chance. Taking the randomness
    as an input lets a batch draw each row's noise from that row's generator. [..., V] -> [...]"""
    return (weights / noise).argmax(-1)


def _draw(lengths: list[int], gamma: int, vocab: int, generator: Generators, dtype, device):
    """The batch's random numbers: coins u [B, γ] and sampling noise [B, V], per row in the order
    `rejection_sample` draws them when each row has its own generator (`lengths`: n_b, host)."""
    batch = len(lengths)
    if generator is None or isinstance(generator, torch.Generator):
        u = torch.rand(batch, gamma, generator=generator, dtype=dtype, device=device)
        return u, exponential_noise((batch, vocab), generator, dtype, device)
    check(len(generator) == batch, f"need one generator per row ({batch}), got {len(generator)}")
    u = torch.zeros(batch, gamma, dtype=dtype, device=device)  # B, γ (padding coins stay 0, unused)
    noise = torch.empty(batch, vocab, dtype=dtype, device=device)  # B, V
    for b, (g, m) in enumerate(zip(generator, lengths)):
        u[b, :m] = torch.rand(m, generator=g, dtype=dtype, device=device)
        noise[b] = exponential_noise((vocab,), g, dtype, device)
    return u, noise


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E[tokens per target call] = Σ_{i=0}^{γ} α^i = (1 − α^(γ+1)) / (1 − α) when each draft token
    is accepted with probability α independently (Leviathan et al. 2023, eq. 1); γ + 1 at α = 1."""
    check(isinstance(alpha, (int, float)) and 0 <= alpha <= 1, f"alpha={alpha!r} must be in [0, 1]")
    check_gamma(gamma, "gamma")
    return float(gamma + 1) if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


# --------------------------------------------------------------------------- validation
def check_gamma(gamma, name: str) -> None:
    check(is_int(gamma) and 1 <= gamma <= MAX_SPECULATIVE_TOKENS,
          f"{name}={gamma!r} must be an integer in 1..{MAX_SPECULATIVE_TOKENS}")


def _check_proposed(q_x: torch.Tensor) -> None:
    check(bool((q_x > 0).all()), "a draft token has q(x) = 0: the draft cannot have proposed it "
                                 "(pass the law the token was sampled from, or q=None for "
                                 "deterministic drafts)")


def _check_draft(draft_ids: torch.Tensor, q: torch.Tensor | None,
                 p: torch.Tensor) -> tuple[int, int]:
    """Shapes of one sequence's verification inputs -> (γ, V)."""
    check(draft_ids.dim() == 1 and not draft_ids.is_floating_point(),
           f"draft_ids must be a 1-D integer tensor, got {draft_ids.dtype} of shape "
           f"{tuple(draft_ids.shape)}")
    gamma = draft_ids.shape[0]
    check(gamma <= MAX_SPECULATIVE_TOKENS,
          f"{gamma} draft tokens; at most {MAX_SPECULATIVE_TOKENS} are allowed")
    check(p.dim() == 2 and p.shape[0] == gamma + 1,
           f"the target must give γ+1 = {gamma + 1} rows [γ+1, V] for {gamma} draft tokens, got "
           f"{tuple(p.shape)}")
    vocab = p.shape[1]
    check(bool(((draft_ids >= 0) & (draft_ids < vocab)).all()),
          f"draft token ids must be in 0..{vocab - 1}, "
                                                                  f"got {draft_ids.tolist()}")
    if q is not None:
        check(q.dim() == 2 and q.shape[0] == gamma,
               f"q must be [γ, V] with γ = {gamma} draft rows, got {tuple(q.shape)}")
        check(q.shape[1] == vocab,
              f"q and p must share the vocabulary, got V = {q.shape[1]} and {vocab}")
        _check_proposed(q[torch.arange(gamma, device=q.device), draft_ids])
    return gamma, vocab
