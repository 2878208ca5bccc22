"""nanoserve: an educational LLM inference engine, written to be read.

    from nanoserve import LLM, SamplingParams
    llm = LLM("demo")
    print(llm.generate("ROMEO:", SamplingParams(max_tokens=100))[0].text)
"""

import os

import torch

# Without CUDA, nanoserve's Triton kernels (nanoserve.kernels) run in Triton's interpreter. It has
# to be switched on before Triton is first imported — and torch may import Triton on its own
# (torch._dynamo) — so as early as possible: here (DESIGN.md §5).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .async_engine import AsyncLLMEngine  # noqa: E402
from .engine import LLM, LLMEngine, RequestOutput  # noqa: E402
from .errors import CheckpointError, ConfigError, NanoserveError  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "RequestOutput", "SamplingParams",
           "NanoserveError", "CheckpointError", "ConfigError"]
