"""The cache section: the paged KV pool's blocks, its size, what K and V are stored in, and which
attention backend reads it (nanoserve/kv/)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import NanoserveError
from .base import EngineArg, arg, check_choice, check_int

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4")  # kv/quant.py
ATTENTION_BACKENDS = ("torch", "triton", "cpu")  # kv/: gather + SDPA, nanoserve.kernels, C decode


def check_block_size(block_size: int) -> None:
    """Raise NanoserveError unless `block_size` is a power of two (an int ≥ 1)."""
    if type(block_size) is not int or block_size <= 0 or block_size & (block_size - 1):
        raise NanoserveError(f"block_size={block_size!r} is not allowed; "
                             "it must be a power of two: 1, 2, 4, ... 16")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` tokens, and who reads it."""

    block_size: int = 16  # tokens per block, a power of two
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes for the pool; None: 8 full-context sequences
    num_blocks: int | None = None  # the pool's size in blocks, overriding kv_cache_memory
    # auto: the model's dtype; else 8 bits with a scale per token and head, or int4: 4 bits with a
    # scale and a minimum per 64 values
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None  # None: triton on CUDA, cpu on the CPU, where they serve

    def __post_init__(self):
        check_block_size(self.block_size)
        check_int("kv_cache_memory", self.kv_cache_memory, optional=True)
        check_int("num_blocks", self.num_blocks, optional=True)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS, optional=True)


# its keyword arguments (config/args.py)
CACHE_ARGS: dict[str, EngineArg] = {
    "block_size": arg("cache", "block_size", "tokens per KV block (a power of two)"),
    "enable_prefix_caching": arg("cache", "enable_prefix_caching",
                                 "share the KV blocks of common prompt prefixes"),
    "kv_cache_memory": arg("cache", "kv_cache_memory",
                           "bytes for the KV cache (default: 8 full-context sequences)"),
    "num_blocks": arg("cache", "num_blocks", "KV cache blocks (overrides --kv-cache-memory)"),
    "kv_cache_dtype": arg("cache", "kv_cache_dtype", "auto: K/V in the model's dtype; else 8 bits "
                          "with a scale per token and head, or int4: 4 bits with a scale and a "
                          "minimum per 64 values", choices=KV_CACHE_DTYPES),
    "attention_backend": arg("cache", "attention_backend", "attention over the KV cache (default: "
                             "triton on CUDA, cpu on the CPU, where they serve)",
                             choices=ATTENTION_BACKENDS),
}
