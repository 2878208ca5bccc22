"""Beyond one device: tensor and pipeline parallelism on torch.distributed (gloo on CPU, NCCL on
CUDA).

    config.py            ParallelConfig: tensor_parallel_size, pipeline_parallel_size (one kind at a
                         time)
    tensor_parallel.py   column- and row-parallel linears, the vocabulary split, shard_model
    quant_shard.py       GPTQ / AWQ layers split by their codes (by inputs along whole groups)
    launch.py            a sharded forward on N local processes (tp_forward, tp_greedy, spawn_ranks)
    pipeline.py          pipeline stages: the blocks split over N processes, micro-batches in
                         GPipe's order
    stage_runner.py      one stage of the engine: its blocks over a KV pool of its layers,
                         activations passed on
    runners.py           each rank's share and model runner; rank 0's, which sends every step first
    workers.py           the engine over N ranks: LLM(model, tensor_parallel_size=N) or
                         pipeline_parallel_size=N; rank 0 schedules, the worker processes follow
                         each step

Not yet: both kinds at once, 8-bit linears split, speculative decoding and LoRA adapters on the
split engine (refused by name). Several nodes: launch every rank with torchrun (workers.py).
"""

from .tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_model,
    tp_unsupported,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead",
           "shard_model",
           "tp_unsupported"]
