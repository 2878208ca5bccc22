"""Each rank's share of the model and its model runner, and rank 0's runner that sends every step
first.

    split_for_rank(net, parallel, rank)     the loaded model reduced to the rank's share, in place:
                                            its slice of every layer (tensor) or its stage's blocks
                                            (pipeline)
    rank_runner(net, parallel, rank, ...)   the rank's runner: a ModelRunner over a KV pool of its
                                            heads (tensor), or a PipelineRunner over its layers
                                            (stage_runner.py)
    LeaderRunner(group, runner)             rank 0's: each forward, block copy and slot copy goes to
                                            the workers first (WorkerGroup.send), then runs here; a
                                            failure is fatal
"""

from __future__ import annotations

import dataclasses

from ..engine.model_runner import ModelRunner
from .config import ParallelConfig
from .pipeline import keep_stage, split_layers
from .stage_runner import PipelineRunner
from .tensor_parallel import check_shardable, shard_model


@dataclasses.dataclass
class StepRow:
    """What a worker's ModelRunner.prepare reads of a sequence for one forward: its new tokens, by
    position."""

    seq_id: int
    num_computed_tokens: int
    token_ids: _Window
    block_table: list[int]
    lora_int_id: int = 0
    # KV eviction is refused with parallel ranks (engine/kv_eviction.py): a row never evicts here
    kv_eviction: None = None
    num_evicted_blocks: int = 0


class _Window:
    """The tokens a step computes, indexed by their positions in the sequence (prepare slices
    [start:start + n])."""

    def __init__(self, start: int, tokens: list[int]):
        self.start, self.tokens = start, tokens

    def __getitem__(self, s: slice) -> list[int]:
        return self.tokens[s.start - self.start: s.stop - self.start]


def check_split(net, parallel: ParallelConfig) -> None:
    """Refuse, by name, a model the ranks cannot share — before any worker starts."""
    if parallel.kind == "tensor":
        check_shardable(net, parallel.world_size)
    elif parallel.kind == "pipeline":
        split_layers(net.config.n_layers, parallel.world_size)  # at most one stage per block


def split_for_rank(net, parallel: ParallelConfig, rank: int) -> None:
    if parallel.kind == "tensor":
        shard_model(net, rank, parallel.world_size)
    elif parallel.kind == "pipeline":
        keep_stage(net, rank, parallel.world_size)


def rank_runner(net, parallel: ParallelConfig, rank: int, num_layers: int, num_blocks: int,
                block_size: int,
                attention_backend, kv_cache_dtype: str) -> ModelRunner:
    """`num_layers`: the whole model's (a pipeline stage's model holds fewer)."""
    if parallel.kind == "pipeline":
        return PipelineRunner(net, rank, parallel.world_size, num_layers, num_blocks, block_size,
                              attention_backend,
                              kv_cache_dtype)
    kv_config = dataclasses.replace(net.config,
                                    n_kv_heads=max(1, net.config.n_kv_heads // parallel.world_size))
    # its share of the KV heads (replicated when fewer than the ranks)
    return ModelRunner(net, num_blocks, block_size, attention_backend, kv_cache_dtype,
                       kv_config=kv_config)


class LeaderRunner:
    """Rank 0's model runner: `runner` (its own share), with every forward and every change to the
    KV pools sent to the workers first. Everything else is read from `runner`."""

    def __init__(self, group, runner: ModelRunner):
        self.group, self.runner = group, runner
        self.kv = _SentCache(runner.kv, group)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, seqs, num_new, num_logits=None, trees=None):
        rows = [StepRow(s.seq_id, s.num_computed_tokens, _Window(s.num_computed_tokens, s.token_ids[
            s.num_computed_tokens:s.num_computed_tokens + n]), list(s.block_table), s.lora_int_id)
            for s, n in zip(seqs, num_new)]
        self.group.send("run", rows, list(num_new), num_logits, trees)
        return self.group.guard(self.runner.run, seqs, num_new, num_logits, trees)

    def use_cuda_graphs(self, max_num_seqs: int, max_model_len: int,
                        max_verify_tokens: int = 1) -> str | None:
        return (f"{self.group.parallel.kind} parallelism runs eagerly (its steps are sent to the "
                "workers first)")

    def logits(self, ids: list[int]):
        """Logits [T, V] of one full forward without a cache, every rank running its share
        (LLM.logits)."""
        self.group.send("logits", list(ids))
        return self.group.guard(self.runner.logits, ids)


class _SentCache:
    """Rank 0's KV pool: the block and slot copies are sent to the workers too; everything else is
    the pool's."""

    def __init__(self, cache, group):
        self._cache, self._group = cache, group

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def copy_block(self, src: int, dst: int) -> None:
        self._group.send("copy_block", src, dst)
        self._cache.copy_block(src, dst)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        self._group.send("copy_slots", list(src), list(dst))
        self._cache.copy_slots(src, dst)
