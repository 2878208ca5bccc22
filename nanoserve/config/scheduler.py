"""The scheduler section: how many sequences and new tokens one step may hold, chunked prefill, and
the waiting queue's bound (engine/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NanoserveError
from .base import EngineArg, arg, check_int


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits per step, and the waiting queue's bound."""

    max_num_seqs: int = 64  # sequences in one forward
    max_num_batched_tokens: int = 512  # new tokens in one forward (the token budget)
    enable_chunked_prefill: bool = True
    max_waiting: int | None = None  # None = unbounded
    # schedule and launch step N + 1 before step N's tokens reach the host (engine/async_step.py)
    async_scheduling: bool = False

    def __post_init__(self):
        if not isinstance(self.async_scheduling, bool):
            raise NanoserveError(f"async_scheduling must be True or False, got "
                                 f"{self.async_scheduling!r}")
        check_int("max_num_seqs", self.max_num_seqs)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("max_waiting", self.max_waiting, optional=True)

    def validate(self, max_model_len: int) -> None:
        """The rule that needs the model: without chunked prefill, a whole prompt fits one step."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise NanoserveError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be ≥ the context "
                f"length {max_model_len} when chunked prefill is off (a whole prompt must fit in "
                "one step)")


# its keyword arguments (config/args.py)
SCHEDULER_ARGS: dict[str, EngineArg] = {
    "max_num_seqs": arg("scheduler", "max_num_seqs", "sequences in one forward"),
    "max_num_batched_tokens": arg("scheduler", "max_num_batched_tokens",
                                  "new tokens in one forward"),
    "enable_chunked_prefill": arg("scheduler", "enable_chunked_prefill",
                                  "split long prompts over steps, beside the decodes"),
    "max_waiting": arg("scheduler", "max_waiting",
                       "waiting-queue bound: beyond it requests get 429"),
    "async_scheduling": arg("scheduler", "async_scheduling",
                            "launch each step before the last one's tokens reach the host "
                            "(tokens come back one step late)"),
}
