"""nanoserve: an educational LLM inference engine, written to be read.

    from nanoserve import LLM, SamplingParams
    llm = LLM("demo")
    print(llm.generate("ROMEO:", SamplingParams(max_tokens=100))[0].text)
"""

from .engine import LLM, AsyncLLMEngine, LLMEngine, RequestOutput
from .errors import CheckpointError, ConfigError, NanoserveError
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "RequestOutput", "SamplingParams",
           "NanoserveError", "CheckpointError", "ConfigError"]
