"""Exercise 23: which KV blocks StreamingLLM and SnapKV keep.

Your versions of nanoserve/engine/kv_eviction.py's `streaming_kept_blocks` and
`snapkv_kept_blocks`, with the same names and signatures. Taught in
notebooks/20_kv_eviction.ipynb. Check your work with

    make exercises EX=ex23        # or: .venv/bin/pytest tests/exercises -m ex23 --impl exercises

Blocks are numbered 0, 1, ... in the sequence's order; block i holds tokens
i·block_size .. (i + 1)·block_size − 1. A block is *full* when all its tokens are computed.
"""

from __future__ import annotations


# ----------------------------------------------------------------------------- exercise 23
def streaming_kept_blocks(num_tokens: int, block_size: int, sink_blocks: int,
                          window_blocks: int) -> list[int]:
    """StreamingLLM's blocks with `num_tokens` computed, ascending: the first `sink_blocks`, the
    last `window_blocks` FULL blocks, and the block being filled (when the last block is
    partial)."""
    raise NotImplementedError(
        "Exercise 23.1: count the full blocks first; keep the sinks, the window of full blocks "
        "just before the partial one, and the partial one itself, without listing a block twice "
        "(roughly 6 lines; see notebooks/20_kv_eviction, section 2; make hint EX=ex23 N=1)")


def snapkv_kept_blocks(block_scores: list[float], num_prompt_tokens: int, block_size: int,
                       sink_blocks: int, budget_blocks: int,
                       observation_window: int) -> list[int]:
    """SnapKV's prompt blocks, ascending: the sinks, every block holding one of the last
    `observation_window` prompt tokens (the partial last block among them), then the other full
    blocks with the highest `block_scores` (ties: the earlier block) until `budget_blocks` FULL
    blocks are kept in all."""
    raise NotImplementedError(
        "Exercise 23.2: the forced blocks first (sinks, the observation window's blocks); the "
        "room left is the budget minus the forced FULL blocks; rank the rest by score "
        "(roughly 8 lines; see notebooks/20_kv_eviction, section 5; make hint EX=ex23 N=1)")
