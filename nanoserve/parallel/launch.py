"""Running a sharded model on N processes of this machine, with gloo (CPU) — what the tests and the
notebook do.

    tp_forward(path, ids, world_size)          logits [T, V] of one forward of `ids`, the model
                                               split N ways
    tp_greedy(path, ids, n, world_size)        n greedy tokens, each from a full forward (no KV
                                               cache)
    spawn_ranks(fn, world_size, *args)         fn(rank, world_size, *args) on each rank of a fresh
                                               gloo group
    mlp_over_ranks(up, down, x, world_size)    an MLP split column-then-row over N processes:
                                               each rank's partial sum and its all-reduced output

Each spawns `world_size` processes (torch.multiprocessing), which join one gloo process group over a
local TCP port, load the checkpoint, keep their share (tensor_parallel.shard_model) and run the same
forward; rank 0 writes the result to a file the caller reads. One torch thread per process: the
ranks share the cores. The engine's own workers (a scheduler on rank 0, the others following its
steps) are workers.py's.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, world_size: int, *args, threads: int = 1) -> None:
    """Run fn(rank, world_size, *args) in `world_size` new processes joined in one gloo process
    group; return when every rank has finished (torch.multiprocessing raises if one raised or died).
    `fn` must be a module-level function (it is pickled by name); it reports back through files, as
    the callers here do."""
    mp.spawn(
        _rank_main, args=(fn, world_size, free_port(), threads, args), nprocs=world_size, join=True
    )


def _rank_main(rank: int, fn, world_size: int, port: int, threads: int, args: tuple) -> None:
    """One rank's life: join the group, run `fn`, wait for the others, leave the group, end the
    process."""
    torch.set_num_threads(threads)  # the ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            # a rank left waiting on a dead one fails, not hangs
                            timeout=timedelta(seconds=120))
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # nobody tears the group down while another rank still talks to it
    finally:
        dist.destroy_process_group()
    exit_without_finalizing()


def exit_without_finalizing() -> None:
    """End a finished rank's process here, skipping the interpreter's shutdown.

    A gloo worker thread can still be dropping its last collective's work object when the rank
    returns; the work holds tensors, freeing one takes the GIL, and a thread that asks for the GIL
    while Python finalizes is stopped by force, which in C++ ends in std::terminate: the rank dies
    by SIGABRT after its job is done (CI saw it; here, 3 runs in 19 of a loop on a busy 2-core
    machine; the C++ stack is in issue 27's note). Everything is written and the group destroyed by
    now, so skipping the shutdown loses nothing. Only the success path leaves this way: a rank that
    raised exits through torch's error report."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _forward_rank(rank: int, world_size: int, path: str, ids: list[int], steps: int, out: str,
                  shard) -> None:
    from ..models.loader import load_model
    from .tensor_parallel import shard_model

    model = load_model(path, dtype="float32", device="cpu")[0]
    if world_size > 1:
        (shard or shard_model)(model, rank, world_size)
    with torch.no_grad():
        tokens, logits = list(ids), model(torch.tensor([ids]))[0]  # T, V
        for _ in range(steps):  # greedy, a full forward per token: every rank gets the same logits
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    if rank == 0:
        torch.save({"logits": logits, "tokens": tokens[len(ids):]}, out)


def _run(path, ids, steps: int, world_size: int, shard) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.pt")
        spawn_ranks(_forward_rank, world_size, str(path), list(ids), steps, out, shard)
        return torch.load(out)


def _mlp_rank(rank: int, world_size: int, up: nn.Linear, down: nn.Linear, x: torch.Tensor,
              activation, out: str) -> None:
    from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

    hidden = up.out_features
    units = torch.arange(rank * hidden // world_size, (rank + 1) * hidden // world_size)
    column, row = ColumnParallelLinear(up, units), RowParallelLinear(down, units)
    with torch.no_grad():
        h = activation(column(x))  # this rank's hidden units, no exchange
        partial = F.linear(h, row.weight)  # its partial sum of the output
        output = row(h)  # the all-reduce, then the bias once
    torch.save({"units": (int(units[0]), int(units[-1])), "partial": partial, "output": output},
               f"{out}.{rank}")


def mlp_over_ranks(up: nn.Linear, down: nn.Linear, x: torch.Tensor, world_size: int,
                   activation=F.gelu) -> list[dict]:
    """down(activation(up(x))) split over `world_size` gloo processes, as notebook 16 runs it: up
    column-parallel, down row-parallel, one all-reduce. Per rank: its hidden units (first, last),
    its partial sum before the all-reduce and its output after (`activation`: a module-level
    function)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank")
        spawn_ranks(_mlp_rank, world_size, up, down, x, activation, out)
        return [torch.load(f"{out}.{rank}") for rank in range(world_size)]


def tp_forward(path, ids: list[int], world_size: int, shard=None) -> torch.Tensor:
    """Logits [T, V] (float32) of `ids` with the model split over `world_size` gloo processes;
    `shard(model, rank, world_size)`: how each rank takes its share (default
    tensor_parallel.shard_model; a module-level function)."""
    return _run(path, ids, 0, world_size, shard)["logits"]


def tp_greedy(path, ids: list[int], n: int, world_size: int, shard=None) -> list[int]:
    """`n` greedy tokens after `ids`, the model split over `world_size` gloo processes."""
    return _run(path, ids, n, world_size, shard)["tokens"]
