"""KV caches: keys and values of past tokens, so each decode step runs the model on new tokens only.

Without a cache, generating token t recomputes keys and values for all t previous tokens, so
n tokens cost O(n²) token-forwards; with it, O(n). Notebook 01 builds the simplest cache, one
preallocated [max_len] tensor per layer. This file holds the cache the engine uses:

**Paged storage** (Kwon et al. 2023, vLLM). Per layer, K and V live in a pool of fixed-size
blocks, `[num_blocks, block_size, n_kv_heads, head_dim]`. A sequence's tokens are spread over
blocks listed in its *block table*; token i of a sequence lives in block
`block_table[i // block_size]` at offset `i % block_size`, i.e. in *slot*
`block_table[i // block_size] * block_size + i % block_size`. Which blocks a sequence gets is
the block manager's business (nanoserve/paged.py); this file only stores and reads.

Per forward step the engine binds a `CacheView` with three tensors:
- `slot_mapping` [B, T]: where each new token's K/V is written (−1 for padding: not written),
- `block_tables` [B, max_blocks]: each sequence's blocks in logical order,
- `context_lens` [B]: tokens of each sequence in the cache once this step's are written.
`CacheView.update` writes the new K/V, then gathers each sequence's K/V back into logical
order ([B, S, Hkv, D], S = max_blocks · block_size) for plain-torch attention. Every block is
zeroed when it receives its first token, so slots past a sequence's context hold zeros and stale
or poisoned memory can never leak in.

**The contiguous cache** (`KVCache`) is the special case `block_table = arange`: each row owns
consecutive blocks. It runs through exactly the same code, which is why the paged and
contiguous caches give bitwise-equal logits. Taught in notebooks/01_* and notebooks/02_*.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .errors import NanoserveError


class PagedKVCache:
    """k, v: [n_layers, num_blocks, block_size, n_kv_heads, head_dim]."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: a sequence about to write into a shared block gets its own copy first."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def view(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> CacheView:
        return CacheView(self, slot_mapping, block_tables, context_lens)


class CacheView:
    """One forward step's window onto a PagedKVCache: what `model(..., cache=view)` writes and reads."""

    def __init__(self, cache: PagedKVCache, slot_mapping, block_tables, context_lens):
        self.cache = cache
        self.slot_mapping = slot_mapping  # B, T
        self.block_tables = block_tables  # B, max_blocks
        self.context_lens = context_lens  # B
        # Which of the B·T new tokens are real (padding has slot −1), resolved once for all layers.
        flat_slots = slot_mapping.flatten()  # B·T
        self.src = (flat_slots >= 0).nonzero().squeeze(1)  # indices of real tokens in the B·T rows
        self.dst = flat_slots[self.src]  # their slots
        self.gather_ids = block_tables.flatten()  # B·max_blocks
        # A block receives its first token at offset 0 (tokens are written in order; copy-on-write
        # and prefix-cache blocks arrive with their contents). Zero it then, in every layer: a
        # block's slots past the context then hold zeros, never stale or poisoned memory, so the
        # gathered K/V need no masking of their own (the attention mask hides those slots, and
        # 0 · weight stays 0 where NaN · 0 would not).
        fresh = self.dst[self.dst % cache.block_size == 0] // cache.block_size
        if fresh.numel():
            cache.k[:, fresh] = 0
            cache.v[:, fresh] = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write this step's k, v [B, T, Hkv, D] into their slots; return every sequence's [B, S, Hkv, D]."""
        return self._write_and_gather(self.cache.k[layer], k), self._write_and_gather(self.cache.v[layer], v)

    def _write_and_gather(self, pool: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        nb, bs, H, D = pool.shape
        flat = pool.view(nb * bs, H, D)  # slots, Hkv, D
        flat.index_copy_(0, self.dst, new.reshape(-1, H, D).index_select(0, self.src))
        B = self.block_tables.shape[0]
        return pool.index_select(0, self.gather_ids).view(B, -1, H, D)  # B, S, Hkv, D  (logical order)

    def advance(self, n: int) -> None:  # the engine tracks lengths; nothing to do here
        pass


class KVCache:
    """The contiguous cache: `batch` rows of up to `max_seq_len` tokens, all rows the same length.

    Row b owns blocks b·n .. b·n + n − 1 (block_table = arange), so writing token i of row b is
    writing slot (b·n + i // block_size) · block_size + i % block_size — one contiguous range
    of memory per row, exactly the layout of a plain [batch, max_seq_len] tensor.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", block_size: int = 16):
        n = -(-max_seq_len // block_size)  # blocks per row
        self.pool = PagedKVCache(cfg, batch_size * n, block_size, dtype, device)
        self.block_tables = torch.arange(batch_size * n, device=device).view(batch_size, n)  # B, n
        self.batch_size, self.max_seq_len, self.block_size = batch_size, max_seq_len, block_size
        self.length = 0  # tokens cached so far, in every row
        self._view: CacheView | None = None

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if layer == 0 or self._view is None:
            self._view = self._bind(k.shape[1])
        return self._view.update(layer, k, v)

    def _bind(self, T: int) -> CacheView:
        start, end = self.length, self.length + T
        if end > self.max_seq_len:
            raise NanoserveError(f"KV cache overflow: {start} cached + {T} new tokens > max_seq_len={self.max_seq_len}")
        pos = torch.arange(start, end, device=self.block_tables.device)  # T
        bs = self.block_size
        slots = self.block_tables[:, pos // bs] * bs + pos % bs  # B, T
        used = self.block_tables[:, : -(-end // bs)]  # only the blocks that hold tokens so far
        lens = torch.full((self.batch_size,), end, device=self.block_tables.device)
        return self.pool.view(slots, used, lens)

    def advance(self, n: int) -> None:
        """Called by the model once all layers have written the step's n tokens."""
        self.length += n
        self._view = None

    def reset(self) -> None:
        self.length = 0
