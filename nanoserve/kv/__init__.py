"""KV storage and the attention backends that read it.

    cache.py           PagedKVCache: per-layer pools of blocks [num_blocks, block_size, Hkv, D];
                       sizing
    torch_backend.py   CacheView: write, gather into logical order, SDPA (the reference)
    triton_backend.py  TritonCacheView: the kernels of nanoserve.kernels read the pool in place
    cpu_backend.py     CpuCacheView: the torch backend, with decode steps in a C kernel that reads
                       in place
    contiguous.py      KVCache: the special case block_table = arange (notebook 01)

Which blocks a sequence owns is the block allocator's business
(nanoserve/engine/block_allocator.py); this package only stores and reads. The kernels themselves
(Triton, and the CPU's C decode kernel) live in the top-level kernels/ folder, installed as
nanoserve.kernels.
"""

from .cache import (
    PagedKVCache,
    kv_bytes_per_token,
    num_blocks_for_budget,
    resolve_attention_backend,
)
from .contiguous import KVCache
from .torch_backend import CacheView

# (the in-place backends, triton_backend.py and cpu_backend.py, attach through in_place.py)
__all__ = ["PagedKVCache", "KVCache", "CacheView", "kv_bytes_per_token", "num_blocks_for_budget",
           "resolve_attention_backend"]
