"""Beyond one device: tensor parallelism on torch.distributed (gloo on CPU, NCCL on CUDA).

    tensor_parallel.py   column- and row-parallel linears, the vocabulary split, shard_model
    launch.py            a sharded forward on N local processes (tp_forward, tp_greedy)

Built so far: the layers and the sharding of GPT-2 and Llama-family models, proven against one process.
Not yet: the engine's workers (rank 0 schedules, the others follow), a paged KV pool per rank, pipeline
parallelism (issue 27).
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
