"""How the engine splits a model over ranks: `ParallelConfig` (nanoserve/config.py, vLLM's
names), and where a rank learns its place: torchrun's environment.

    tensor_parallel_size=N     every layer split N ways (Megatron: columns, then rows, one
                               all-reduce each); each rank holds 1/N of every weight and of every
                               layer's KV heads
    pipeline_parallel_size=N   the stack of blocks split into N stages (parallel/pipeline.py); each
                               rank holds its stage's blocks and their KV layers, activations pass
                               from stage to stage

One kind of split at a time: both > 1 (vLLM's TP × PP grid) is refused by name, as is what the split
engine does not run yet (speculative decoding, LoRA adapters).
"""

from __future__ import annotations

import os

import torch

from ..config import ParallelConfig
from ..errors import NanoserveError

__all__ = ["ParallelConfig", "pin_rank_device", "torchrun_rank"]


def pin_rank_device(parallel: ParallelConfig) -> None:
    """Under torchrun on CUDA, each rank takes its own GPU (LOCAL_RANK) before its model loads."""
    launched = parallel.world_size > 1 and torchrun_rank(parallel) is not None
    if launched and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def torchrun_rank(parallel: ParallelConfig) -> int | None:
    """This process's rank when torchrun (or any launcher setting RANK and WORLD_SIZE) started the
    ranks; None when it did not (the engine then spawns its workers). A launch of another size is
    refused by name."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    if int(os.environ["WORLD_SIZE"]) != parallel.world_size:
        raise NanoserveError(f"{parallel.size_name} but the launcher started "
                             f"WORLD_SIZE={os.environ['WORLD_SIZE']} processes; they must be equal")
    return int(os.environ["RANK"])
