"""Acceptance on the device: a step's verifications decided together and read back once.

Each speculating row returns the target's logits at its γ + 1 positions. Deciding one row at a
time (`greedy_verify`, `rejection_sample` in rejection_sampler.py, the readable forms) reads the
device at every draft token: `int(best[i])`, `u[i] < keep[i]`. On a GPU each read stalls the host
until the device has caught up, so a step of B rows drafting γ tokens each waited up to B·(γ + 1)
times. Here every chain row of the step is decided at once:

- greedy rows by `greedy_verify_batch`: the drafts compared with the target's argmax;
- sampled rows by `rejection_sample_batch`, each row drawing from its own generator the same
  random numbers, in the same order, as `rejection_sample` would;
- each row's NaN flag beside them,

and the host learns all of it in one transfer: the emitted tokens, how many drafts were kept and
whether the row's logits held NaN (its request then fails alone, as in a plain step). A draft
model's drafts never come back on their own: they stay on the device (`ChainRow.device_ids`), and
the verdict's tokens are how the host learns the accepted ones. So a speculative step with a draft
model reads the device once (tests/test_spec_syncs.py).
A token tree (Medusa's) is still verified row by row (spec_decode.py, tree_sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..engine.sampler import SamplingParams, probs_from_logits_batch
from .rejection_sampler import greedy_verify_batch, rejection_sample_batch


@dataclass
class Verdict:
    """One row's verification as the host sees it."""

    tokens: list[int]  # the 1..γ+1 tokens to emit
    accepted: int  # how many drafts were kept
    has_nan: bool  # the row's logits held NaN


@dataclass
class ChainRow:
    """What one chain row brings to `verify_batch`."""

    draft_ids: list[int]
    q: torch.Tensor | None  # [γ, V] the laws the drafts came from; None: deterministic drafts
    params: SamplingParams
    generator: torch.Generator | None
    logits: torch.Tensor  # [γ + 1, V] the target's, under the row's grammar if it has one
    # [γ] the drafts on the device, where draft_ids holds placeholders (a draft model's chain,
    # never read back: the verdict tells the host the accepted ones)
    device_ids: torch.Tensor | None = None


def verify_batch(rows: list[ChainRow]) -> list[Verdict]:
    """Each row's verdict; one device→host transfer for the whole batch."""
    gamma = max(len(r.draft_ids) for r in rows)
    logits = _stack_logits([r.logits for r in rows], gamma + 1)  # B, γ+1, V
    dev, batch = logits.device, len(rows)
    lengths = [len(r.draft_ids) for r in rows]
    padded_ids = [r.draft_ids + [0] * (gamma - len(r.draft_ids)) for r in rows]
    ids = torch.tensor(padded_ids, dtype=torch.long).to(dev, non_blocking=True)  # B, γ
    for b, r in enumerate(rows):
        if r.device_ids is not None:
            ids[b, :len(r.draft_ids)] = r.device_ids  # placeholders replaced on the device
    out = torch.empty(batch, gamma + 1, dtype=torch.long, device=dev)  # B, γ+1
    accepted = torch.empty(batch, dtype=torch.long, device=dev)  # B

    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        index = _index(greedy, dev)
        out[index], accepted[index] = greedy_verify_batch(
            ids[index], logits[index], [lengths[i] for i in greedy]
        )
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        index = _index(sampled, dev)
        chosen = [rows[i] for i in sampled]
        out[index], accepted[index] = rejection_sample_batch(
            ids[index], _stack_q(chosen, ids[index], gamma, logits.shape[-1]),
            _target_probs(logits[index], [r.params for r in chosen]),
            [lengths[i] for i in sampled], [r.generator for r in chosen], check_inputs=False,
        )
    has_nan = logits.isnan().flatten(1).any(-1)  # B
    host = torch.cat([out, accepted[:, None], has_nan[:, None].long()], 1).tolist()  # the read
    return [Verdict(row[:row[-2] + 1], row[-2], bool(row[-1])) for row in host]


def _index(rows: list[int], dev) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)


def _stack_logits(logits: list[torch.Tensor], length: int) -> torch.Tensor:
    """Rows of [n_b, V] padded with zeros to [length, V] and stacked: [B, length, V]."""
    return torch.stack([F.pad(x, (0, 0, 0, length - x.shape[0])) for x in logits])


def _target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """p [S, γ+1, V]: each row's sampling law (temperature, top-k, top-p) at every position."""
    S, positions, V = logits.shape
    settings = [(p.temperature, p.top_k, p.top_p) for p in params for _ in range(positions)]
    temperatures, top_ks, top_ps = zip(*settings)
    flat = probs_from_logits_batch(logits.reshape(S * positions, V), temperatures, top_ks, top_ps)
    return flat.reshape(S, positions, V)


def _stack_q(rows: list[ChainRow], ids: torch.Tensor, gamma: int, vocab: int):
    """q [S, γ, V] for the sampled rows, or None when every one drafted deterministically; a
    deterministic row's q is one-hot at its drafts (what `rejection_sample` assumes for q=None)."""
    if all(r.q is None for r in rows):
        return None
    q = F.one_hot(ids, vocab).float()  # S, γ, V
    for b, r in enumerate(rows):
        if r.q is not None:
            q[b, :r.q.shape[0]] = r.q
    return q
