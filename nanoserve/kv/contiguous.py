"""The contiguous KV cache: the paged cache's special case `block_table = arange`.

Each row owns consecutive blocks, so it is the layout of a plain [batch, max_seq_len] tensor; it
runs through exactly the same code as the paged cache, which is why both give bitwise-equal
logits. Notebook 01 uses it before paging exists. Taught in notebooks/01_* and notebooks/02_*.
"""

from __future__ import annotations

import torch

from ..engine.block import slots
from ..errors import NanoserveError
from ..models.config import ModelConfig
from .cache import PagedKVCache
from .metadata import CommonAttentionMetadata
from .torch_backend import CacheView


class KVCache:
    """The contiguous cache: `batch` rows of up to `max_seq_len` tokens, all rows the same length.

    Row b owns blocks b·n .. b·n + n − 1 (block_table = arange), so writing token i of row b is
    writing slot (b·n + i // block_size) · block_size + i % block_size — one contiguous range
    of memory per row, exactly the layout of a plain [batch, max_seq_len] tensor.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 block_size: int = 16,
                 attention_backend: str | None = "torch", kv_cache_dtype: str = "auto"):
        n = -(-max_seq_len // block_size)  # blocks per row
        self.pool = PagedKVCache(cfg, batch_size * n, block_size, dtype, device, attention_backend,
                                 kv_cache_dtype=kv_cache_dtype)
        # B, n (on the host: see _bind)
        self.block_tables = torch.arange(batch_size * n).view(batch_size, n)
        self.device = torch.device(device)
        self.batch_size, self.max_seq_len, self.block_size = batch_size, max_seq_len, block_size
        self.length = 0  # tokens cached so far, in every row
        self._view: CacheView | None = None

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return self._view_for(layer, k.shape[1]).update(layer, k, v)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  positions: torch.Tensor,
                  window: int | None = None, scale: float | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None):
        view = self._view_for(layer, k.shape[1])
        return view.attention(layer, q, k, v, positions, window, scale, softcap, sinks=sinks)

    def _view_for(self, layer: int, T: int) -> CacheView:
        if layer == 0 or self._view is None:
            self._view = self._bind(T)
        return self._view

    def _bind(self, T: int) -> CacheView:
        start, end = self.length, self.length + T
        if end > self.max_seq_len:
            raise NanoserveError(f"KV cache overflow: {start} cached + {T} new tokens > "
                                 f"max_seq_len={self.max_seq_len}")
        # built on the host, like the model runner's metadata: the forward then reads nothing back
        slot_mapping = torch.tensor([slots(row, start, end, self.block_size)
                                     for row in self.block_tables.tolist()])  # B, T (host values)
        # only the blocks that hold tokens so far
        used = self.block_tables[:, : -(-end // self.block_size)]
        lens = torch.full((self.batch_size,), end)
        common = CommonAttentionMetadata.build(slot_mapping, used, lens)
        return self.pool.bind(self.pool.build_metadata(common).to(self.device))

    def advance(self, n: int) -> None:
        """Called by the model once all layers have written the step's n tokens."""
        self.length += n
        self._view = None

    def reset(self) -> None:
        self.length = 0
