"""How the engine splits a model over ranks: `ParallelConfig` (vLLM's names), checked before any model loads.

    tensor_parallel_size=N     every layer split N ways (Megatron: columns, then rows, one all-reduce each);
                               each rank holds 1/N of every weight and of every layer's KV heads
    pipeline_parallel_size=N   the stack of blocks split into N stages (parallel/pipeline.py); each rank holds
                               its stage's blocks and their KV layers, activations pass from stage to stage

One kind of split at a time: both > 1 (vLLM's TP × PP grid) is refused by name, as is what the split engine
does not run yet (speculative decoding, LoRA adapters).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import NanoserveError


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise NanoserveError(f"{name}={size!r} must be an integer ≥ 1")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise NanoserveError(f"tensor_parallel_size={self.tensor_parallel_size} with pipeline_parallel_size="
                                 f"{self.pipeline_parallel_size}: one kind of split at a time (not both yet)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def kind(self) -> str:
        """"tensor" or "pipeline" (what the ranks split), "none" for one rank."""
        return "tensor" if self.tensor_parallel_size > 1 else "pipeline" if self.pipeline_parallel_size > 1 else "none"

    @property
    def size_name(self) -> str:
        """The argument that set the world size, for messages: "tensor_parallel_size=2"."""
        name = "pipeline_parallel_size" if self.kind == "pipeline" else "tensor_parallel_size"
        return f"{name}={self.world_size}"

    def check(self, spec_cfg, enable_lora: bool) -> None:
        """What the split engine does not run yet, refused by name before any model loads."""
        if self.world_size == 1:
            return
        if spec_cfg is not None:
            raise NanoserveError(f"speculative decoding is not supported with {self.size_name} yet")
        if enable_lora:
            raise NanoserveError(f"enable_lora is not supported with {self.size_name} yet")
        if torchrun_rank(self) is not None and torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # each rank its own GPU, before the model loads


def torchrun_rank(parallel: ParallelConfig) -> int | None:
    """This process's rank when torchrun (or any launcher setting RANK and WORLD_SIZE) started the ranks; None
    when it did not (the engine then spawns its workers). A launch of another size is refused by name."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    if int(os.environ["WORLD_SIZE"]) != parallel.world_size:
        raise NanoserveError(f"{parallel.size_name} but the launcher started WORLD_SIZE={os.environ['WORLD_SIZE']} "
                             "processes; they must be equal")
    return int(os.environ["RANK"])
