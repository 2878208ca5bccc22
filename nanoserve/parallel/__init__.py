"""Beyond one device: tensor parallelism on torch.distributed (gloo on CPU, NCCL on CUDA).

    tensor_parallel.py   column- and row-parallel linears, the vocabulary split, shard_model
    launch.py            a sharded forward on N local processes (tp_forward, tp_greedy, spawn_ranks)
    workers.py           the engine over N ranks: LLM(model, tensor_parallel_size=N); rank 0 schedules, the
                         worker processes follow each step, each rank a paged KV pool of its own heads
    pipeline.py          pipeline stages: the blocks split over N processes, micro-batches in GPipe's order
    quant_shard.py       GPTQ / AWQ layers split by their codes (by inputs along whole groups)

Not yet (issue 27): pipeline stages inside the engine, 8-bit linears split, speculative decoding and LoRA adapters
on the split engine (refused by name). Several nodes: launch every rank with torchrun (workers.py).
"""

from .tensor_parallel import (
                              ColumnParallelLinear,
                              ParallelLMHead,
                              RowParallelLinear,
                              VocabParallelEmbedding,
                              shard_model,
                              tp_unsupported,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead", "shard_model",
           "tp_unsupported"]
