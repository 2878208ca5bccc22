"""Pipeline parallelism: the blocks split into stages, one per rank, micro-batches flowing through
them.

Tensor parallelism splits every layer; pipeline parallelism splits the *stack*. With N stages of a
model of L blocks, rank s holds blocks s·L/N .. (s+1)·L/N − 1 (stage 0 also the embeddings, the last
stage the final norm and the LM head) and hands its output activations [b, T, C] to rank s + 1
(torch.distributed send/recv: gloo on CPU, NCCL on GPUs). Nothing but those activations crosses
between ranks: one exchange per stage boundary, against tensor parallelism's two all-reduces per
block.

One batch through N stages leaves N − 1 ranks idle at every moment. Cut it into m micro-batches and
the stages overlap — while stage 1 works on micro-batch 0, stage 0 starts micro-batch 1 — the simple
schedule of GPipe (Huang et al. 2019) for a forward pass: the whole pass takes (N + m − 1)
micro-batch steps instead of N·m, and the idle share, the *bubble*, is (N − 1) / (N + m − 1)
(notebook 16 draws it, and `pp_forward` times it).

    split_layers(L, N)                      the blocks of each stage
    keep_stage(model, stage, num_stages)    a loaded GPT-2 or Llama-family model reduced to one
                                            stage's blocks
    stage_forward(model, x, positions, first, last)   ids (first stage) or activations ->
                                                      activations or logits
    pp_forward(path, batch, num_stages, microbatches)  logits [B, T, V] of a batch through N local
                                                       processes, and every micro-batch's start and
                                                       end on every rank
    pp_greedy(path, ids, n, num_stages)     n greedy tokens, each from a full forward through the
                                            stages (the last stage's choice is broadcast back to the
                                            first)

`pp_forward` and `pp_greedy` are forwards without a KV cache, for teaching and checks; the engine
runs the stages over its paged KV cache with `LLM(model, pipeline_parallel_size=N)`
(stage_runner.py).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..errors import NanoserveError
from .launch import spawn_ranks


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Stage s's blocks: as even a split as L and N allow (the first stages get the remainder)."""
    if not 1 <= num_stages <= num_layers:
        raise NanoserveError(f"pipeline_parallel_size={num_stages}: a model of {num_layers} blocks "
                             f"splits into 1..{num_layers} stages")
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _body(model: nn.Module) -> nn.Module:
    """The family's transformer: `embed`, `blocks` and the final norm (models/gpt2.py,
    models/llama.py)."""
    return model.transformer if hasattr(model, "transformer") else model.model


def keep_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """Drop every block but stage `stage`'s, in place (the embeddings and the head stay where they
    are needed)."""
    body = _body(model)
    name = "h" if hasattr(body, "h") else "layers"
    blocks = getattr(body, name)
    setattr(body, name,
            nn.ModuleList(blocks[i] for i in split_layers(len(blocks), num_stages)[stage]))
    return model


def stage_forward(
    model: nn.Module,
    x: torch.Tensor,
    positions: torch.Tensor,
    first: bool,
    last: bool,
    cache=None,
    logit_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """One stage: token ids [b, T] (first stage) or activations [b, T, C] -> activations, or logits
    [b, T, V] (last stage; [b, K, V] at `logit_index`, as CausalLM.forward). Without a cache the T
    tokens attend causally among themselves; with one (a paged view: the engine's stages,
    stage_runner.py), to the cached tokens too."""
    body = _body(model)
    if first:
        x = body.embed(x, positions)  # b, T, C
    x = body.blocks(x, positions, cache)  # b, T, C
    if not last:
        return x
    norm = body.ln_f if hasattr(body, "ln_f") else body.norm
    return model.head(norm(x), logit_index)  # b, T (or K), V


def _stage_rank(
    rank: int,
    world: int,
    path: str,
    batch: list[list[int]],
    microbatches: int,
    out: str,
    skip_blocks: bool,
) -> None:
    from ..models.loader import load_model

    model = load_model(path, dtype="float32", device="cpu")[0]
    keep_stage(model, rank, world)
    ids = torch.tensor(batch)  # B, T
    T, C = ids.shape[1], model.config.hidden_size
    first, last = rank == 0, rank == world - 1
    # the negative control: the last stage passes its input on without its blocks
    if skip_blocks and last:
        _body(model).blocks = lambda x, positions, cache: x
    # spans: (start, end) on this host's monotonic clock, one clock for all its processes
    logits, spans = [], []
    dist.barrier()
    with torch.no_grad():
        # b, T each (GPipe: every micro-batch's forward, in order)
        for mb in ids.chunk(microbatches):
            positions = torch.arange(T).expand(len(mb), T)
            x = mb if first else torch.empty(len(mb), T, C)
            if not first:
                dist.recv(x, src=rank - 1)  # the previous stage's activations
            start = time.monotonic()
            y = stage_forward(model, x, positions, first, last)
            spans.append((start, time.monotonic()))
            if last:
                logits.append(y)
            else:
                dist.send(y.contiguous(), dst=rank + 1)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(spans, gathered, dst=0)  # every rank's busy times, for the schedule's plot
    # from the first stage's first start (each rank's own zero would differ by the barrier's skew)
    if rank == 0:
        t0 = gathered[0][0][0]
        torch.save({"spans": [[(a - t0, b - t0) for a, b in stage] for stage in gathered]},
                   out + ".spans")
    if last:
        torch.save({"logits": torch.cat(logits)}, out)


def _greedy_rank(rank: int, world: int, path: str, ids: list[int], n: int, out: str) -> None:
    from ..models.loader import load_model

    model = load_model(path, dtype="float32", device="cpu")[0]
    keep_stage(model, rank, world)
    tokens, C, first, last = list(ids), model.config.hidden_size, rank == 0, rank == world - 1
    with torch.no_grad():
        # a full forward per token, no KV cache: every stage sees the whole sequence
        for _ in range(n):
            T = len(tokens)
            positions = torch.arange(T)[None]  # 1, T
            x = torch.tensor([tokens]) if first else torch.empty(1, T, C)
            if not first:
                dist.recv(x, src=rank - 1)
            y = stage_forward(model, x, positions, first, last)
            if not last:
                dist.send(y.contiguous(), dst=rank + 1)
            nxt = y[0, -1].argmax().reshape(1) if last else torch.zeros(1, dtype=torch.long)
            dist.broadcast(nxt, src=world - 1)  # the last stage's token, to every stage
            tokens.append(int(nxt))
    if last:
        Path(out).write_text(" ".join(map(str, tokens[len(ids):])))


def pp_greedy(path, ids: list[int], n: int, num_stages: int) -> list[int]:
    """`n` greedy tokens after `ids`, the model's blocks in `num_stages` stages over as many gloo
    processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "tokens.txt")
        spawn_ranks(_greedy_rank, num_stages, str(path), list(ids), n, out)
        return [int(t) for t in Path(out).read_text().split()]


def pp_forward(path, batch: list[list[int]], num_stages: int, microbatches: int = 1,
               skip_blocks: bool = False) -> tuple[torch.Tensor, list[list[tuple[float, float]]]]:
    """Logits [B, T, V] (float32) of `batch` (B sequences of one length T) through `num_stages` gloo
    processes, cut into `microbatches`; and per rank, each micro-batch's (start, end) in seconds
    from a common start."""
    if len({len(row) for row in batch}) != 1:
        raise NanoserveError("pp_forward takes sequences of one length (no padding in this "
                             "forward)")
    if not 1 <= microbatches <= len(batch):
        raise NanoserveError(f"microbatches={microbatches}: 1..{len(batch)} for a batch of "
                             f"{len(batch)}")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "logits.pt")
        spawn_ranks(_stage_rank, num_stages, str(path), batch, microbatches, out, skip_blocks)
        return torch.load(out)["logits"], torch.load(out + ".spans")["spans"]
