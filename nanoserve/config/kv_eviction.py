"""`KVEvictionConfig`: one request's KV-cache eviction policy (a field of SamplingParams).

    policy               "none" (keep every key), "streaming" (StreamingLLM, Xiao et al. 2023: the
                         first tokens as attention sinks plus a recent window) or "snapkv" (SnapKV,
                         Li et al. 2024: after the prompt, keep the blocks its last queries attend
                         to most)
    kv_budget            tokens of K/V a sequence keeps, sinks included, not counting the block
                         being filled; rounded down to whole blocks (floor(kv_budget / block_size))
    num_sink_tokens      the first tokens always kept; rounded UP to whole blocks (4 tokens with
                         blocks of 16 keep the whole first block)
    observation_window   snapkv: how many of the prompt's last queries vote for the blocks to keep

The engine evicts whole blocks, so that each one evicted goes back to the pool
(nanoserve/engine/kv_eviction.py). The block size is the engine's, so the rules that need it
(`blocks`) are checked when a request reaches an engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NanoserveError
from .base import check_choice, check_int

KV_EVICTION_POLICIES = ("none", "streaming", "snapkv")


@dataclass(frozen=True)
class KVEvictionConfig:
    """A request's eviction policy and its KV budget in tokens (see the module docstring)."""

    policy: str = "streaming"
    kv_budget: int = 256
    num_sink_tokens: int = 4
    observation_window: int = 8

    def __post_init__(self) -> None:
        check_choice("kv_eviction.policy", self.policy, KV_EVICTION_POLICIES)
        check_int("kv_eviction.kv_budget", self.kv_budget, minimum=1)
        check_int("kv_eviction.num_sink_tokens", self.num_sink_tokens, minimum=0)
        check_int("kv_eviction.observation_window", self.observation_window, minimum=1)

    @property
    def evicts(self) -> bool:
        """Whether this policy ever evicts (policy "none" keeps every key)."""
        return self.policy != "none"

    def blocks(self, block_size: int) -> tuple[int, int]:
        """(sink blocks, budget blocks) at `block_size`: sinks rounded up, the budget down. Refuses
        a budget that holds no block besides the sinks: such a policy would keep no recent key."""
        sink_blocks = -(-self.num_sink_tokens // block_size)
        budget_blocks = self.kv_budget // block_size
        if budget_blocks < sink_blocks + 1:
            raise NanoserveError(
                f"kv_eviction.kv_budget={self.kv_budget} is {budget_blocks} whole blocks of "
                f"{block_size} tokens, but num_sink_tokens={self.num_sink_tokens} takes "
                f"{sink_blocks}; allowed: kv_budget >= {(sink_blocks + 1) * block_size} (the sinks "
                "rounded up to whole blocks, plus one block)")
        return sink_blocks, budget_blocks
