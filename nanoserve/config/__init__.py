"""Every setting of an engine: one small validated dataclass per concern, in vLLM's names, each in
its own file of this package (as vLLM's vllm/config/ does).

    EngineConfig (engine.py)
        load                LoadConfig (load.py): which model, dtype and device, 8-bit linears,
                            eager or CUDA graphs
        cache               CacheConfig (cache.py): the paged KV pool (block size, size, K/V dtype,
                            attention backend)
        scheduler           SchedulerConfig (scheduler.py): sequences and tokens per step, the
                            waiting queue
        parallel            ParallelConfig (parallel.py): tensor- or pipeline-parallel ranks
        speculative         SpeculativeConfig (speculative.py), or None: no speculative decoding
        lora                LoRAConfig (lora.py), or None: no per-request adapters
        structured_outputs  GrammarLimits (structured_outputs.py): what a grammar may ask for

Each dataclass checks its own fields when it is made, so a bad value is refused by name before any
model loads; `EngineConfig` checks the few rules that span two of them. Users rarely build these by
hand: `LLM(model, **kwargs)`, `LLMEngine.from_kwargs` and the `nanoserve` command take flat keyword
arguments (`max_num_seqs=8`, `--max-num-seqs 8`) and `EngineConfig.from_kwargs` sorts them into the
sections with the table ENGINE_ARGS (args.py). An unknown name is an error that suggests the
closest ones.

This package imports nothing from the rest of nanoserve but its errors, so that the core and every
extension can read their settings from here (docs/ARCHITECTURE.md). The core reads load, cache,
scheduler, args and engine; the other sections are the extensions' settings, which EngineConfig
holds so that one object describes an engine.
"""

from .args import ENGINE_ARGS, unknown_argument_message
from .base import EngineArg, check_choice, check_int
from .cache import ATTENTION_BACKENDS, KV_CACHE_DTYPES, CacheConfig, check_block_size
from .engine import SECTION_TYPES, EngineConfig
from .load import QUANTIZATION_METHODS, LoadConfig
from .lora import LoRAConfig
from .parallel import ParallelConfig
from .scheduler import SchedulerConfig
from .speculative import (
    DEFAULT_TREE,
    MAX_SPECULATIVE_TOKENS,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
    check_tree_choices,
)
from .structured_outputs import LEXER_STATE_BYTES, GrammarLimits

__all__ = [
    "ATTENTION_BACKENDS", "DEFAULT_TREE", "ENGINE_ARGS", "KV_CACHE_DTYPES", "LEXER_STATE_BYTES",
    "MAX_SPECULATIVE_TOKENS", "QUANTIZATION_METHODS", "SECTION_TYPES", "SPECULATIVE_METHODS",
    "CacheConfig", "EngineArg", "EngineConfig", "GrammarLimits", "LoRAConfig", "LoadConfig",
    "ParallelConfig", "SchedulerConfig", "SpeculativeConfig", "check_block_size", "check_choice",
    "check_int", "check_tree_choices", "unknown_argument_message",
]
