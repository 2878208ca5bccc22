"""The engine loop, in vLLM's names:

    llm.py              LLM: the offline façade (generate / stream / logits)
    llm_engine.py       LLMEngine: add_request / step / abort_request; one step =
                        schedule → forward → sample → update
    request.py          Request and Sample: what the engine holds per request
    scheduler.py        Scheduler: which sequences run and how many tokens each computes; the only
                        writer of a sequence's state
    sequence.py         Sequence: token ids, block table, computed tokens
    block_allocator.py  BlockAllocator: which KV blocks a sequence owns, prefix caching,
                        copy-on-write
    model_runner.py     ModelRunner: one batched forward (tensors in, logits out)
    sampler.py          SamplingParams and the sampler: logits -> tokens
    outputs.py          RequestOutput / CompletionOutput, incremental detokenizing

Data flows one way: request → scheduler → block allocator → model runner → sampler → outputs.
"""

from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, EngineStats, RequestOutput
from .sampler import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineStats", "SamplingParams", "RequestOutput", "CompletionOutput"]
