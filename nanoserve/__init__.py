"""nanoserve: an educational LLM inference engine, written to be read.

    from nanoserve import LLM, SamplingParams
    llm = LLM("demo")
    print(llm.generate("ROMEO:", SamplingParams(max_tokens=100))[0].text)

The folders are the course map (docs/ARCHITECTURE.md tells the whole story):

    engine/      the loop: LLM, LLMEngine, Scheduler, Sequence, BlockAllocator, ModelRunner,
                 sampler, outputs
    kv/          KV storage and the two attention backends (torch, Triton)
    models/      GPT-2 and Llama, their configs, checkpoint loading
    spec/        speculative decoding: the rejection sampler, proposers, the engine's path
    quant/       RTN, GPTQ, AWQ, packing, QuantLinear, quantized checkpoints
    lora/        LoRA adapters: PEFT's format, merging, many adapters in one batch, per-request
                 serving
    parallel/    tensor parallelism: column- and row-parallel layers, a model split over N processes
    serving/     the async engine and the OpenAI-compatible server
    tokenizers/  one module per tokenizer file format
    tools/       benchmarks, evaluation, training, the batching comparison
    errors.py    the error types, and which faults stop the engine
    cli.py       the `nanoserve` command

The Triton kernels live in the top-level kernels/ folder, installed as nanoserve.kernels.
"""

import os

import torch

# Without CUDA, nanoserve's Triton kernels (nanoserve.kernels) run in Triton's interpreter. It has
# to be switched on before Triton is first imported — and torch may import Triton on its own
# (torch._dynamo) — so as early as possible: here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # A CPU engine streams every weight from memory each step: torch's allocator puts tensors of ≥ 2
    # MB on 2 MB pages when this is set (read at its first allocation, so also as early as possible;
    # a process that sets it to 0 keeps 4 KiB pages). Why and how much: engine/cpu_allocator.py.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# every extension attached to the core's extension points (nanoserve/extensions.py)
from . import extensions  # noqa: E402, F401
from .engine import LLM, LLMEngine, RequestOutput, SamplingParams  # noqa: E402
from .errors import CheckpointError, ConfigError, NanoserveError  # noqa: E402
from .lora.serving import LoRARequest  # noqa: E402
from .serving.async_engine import AsyncLLMEngine  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "RequestOutput", "SamplingParams", "LoRARequest",
           "NanoserveError", "CheckpointError", "ConfigError"]
