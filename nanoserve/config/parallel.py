"""The parallel section: how many ranks the model is split over (nanoserve/parallel/)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NanoserveError
from .base import EngineArg, arg, check_int


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks the model is split over (nanoserve/parallel/): one kind of split at a time."""

    tensor_parallel_size: int = 1  # every layer split N ways
    pipeline_parallel_size: int = 1  # the stack of blocks split into N stages

    def __post_init__(self):
        check_int("tensor_parallel_size", self.tensor_parallel_size)
        check_int("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise NanoserveError(
                f"tensor_parallel_size={self.tensor_parallel_size} with pipeline_parallel_size="
                f"{self.pipeline_parallel_size}: one kind of split at a time (not both yet)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def kind(self) -> str:
        """"tensor" or "pipeline" (what the ranks split), "none" for one rank."""
        if self.tensor_parallel_size > 1:
            return "tensor"
        if self.pipeline_parallel_size > 1:
            return "pipeline"
        return "none"

    @property
    def size_name(self) -> str:
        """The argument that set the world size, for messages: "tensor_parallel_size=2"."""
        name = "pipeline_parallel_size" if self.kind == "pipeline" else "tensor_parallel_size"
        return f"{name}={self.world_size}"


# its keyword arguments (config/args.py)
PARALLEL_ARGS: dict[str, EngineArg] = {
    "tensor_parallel_size": arg("parallel", "tensor_parallel_size",
                                "ranks every layer is split over (workers)"),
    "pipeline_parallel_size": arg("parallel", "pipeline_parallel_size",
                                  "stages the blocks are split into (workers)"),
}
