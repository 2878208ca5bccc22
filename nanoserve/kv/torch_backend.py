"""The torch attention backend over the paged KV cache: write this step's K/V into their slots,
gather each sequence's blocks back into logical order, and run SDPA with a causal mask.

Simple and exact, and the reference the Triton backend (triton_backend.py) is tested against.
Its cost grows with batch × context every step (the gather); the kernels read the pool in place.
The gather writes into the cache's workspace (PagedKVCache.gather_buffers), not a fresh tensor: on
CPU a fresh tensor of tens of MB comes from the OS page by page, and zeroing those pages cost ~10×
the copy itself (benchmarks/RESULTS.md, "Where the time goes"). Taught in notebooks/02_*.
"""

from __future__ import annotations

import torch

from ..models.layers import attention as sdpa_attention
from .metadata import AttentionMetadata


class CacheView:
    """One forward step's window onto a PagedKVCache: what `model(..., cache=view)` writes and reads.

    The torch backend: write, gather into logical order, then SDPA with a causal mask.
    """

    zero_fresh_blocks = True  # the gather reads whole blocks, so their unused slots must hold zeros

    def __init__(self, cache, meta: AttentionMetadata):
        self.cache, self.meta = cache, meta
        self.src, self.dst = meta.src, meta.dst  # N: the real tokens' rows in B·T, and their slots
        self.block_tables = meta.block_tables  # B, max_blocks
        self._groups = None  # per bucket: (rows, their block tables, their positions), made at layer 0
        # A block receives its first token at offset 0 (tokens are written in order; copy-on-write
        # and prefix-cache blocks arrive with their contents). Zero it then, in every layer: a
        # block's slots past the context then hold zeros, never stale or poisoned memory, so the
        # gathered K/V need no masking of their own (the attention mask hides those slots, and
        # 0 · weight stays 0 where NaN · 0 would not).
        if self.zero_fresh_blocks:
            cache.k.index_fill_(1, meta.fresh_blocks, 0)  # (an empty index changes nothing)
            cache.v.index_fill_(1, meta.fresh_blocks, 0)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  positions: torch.Tensor, window: int | None = None, scale: float | None = None,
                  softcap: float | None = None) -> torch.Tensor:
        """Store this step's k, v [B, T, Hkv, D]; attend q [B, T, H, D] at `positions` over the cache
        (each query over its `window` newest keys only, when the layer has a sliding window; scores ×
        `scale`, default 1/√D, and soft-capped at `softcap` when given: layers.attention).

        Returns [B, T, H, D]. The model's attention layers call this; the backend decides how. Rows
        are gathered by length bucket (metadata.length_buckets), each bucket to its own length."""
        pool_k, pool_v = self.cache.k[layer], self.cache.v[layer]  # num_blocks, block_size, Hkv, D
        self._write(pool_k, k)
        self._write(pool_v, v)
        if window is not None:
            windowed = self._window_tables(window, positions)
            if windowed is not None:  # gather only the blocks the window reaches, not the whole context
                tables, offsets = windowed  # B, M_w; B
                return sdpa_attention(q, *self._gather_kv(pool_k, pool_v, tables), positions - offsets[:, None],
                                      window, scale, softcap)
        buckets = self.meta.buckets
        if len(buckets) <= 1:  # one length: every row gathered to the longest, as `update` does
            return sdpa_attention(q, *self._gather_kv(pool_k, pool_v, self.block_tables), positions, window, scale,
                                  softcap)
        if self._groups is None:  # each bucket's tables and positions: the same in every layer
            self._groups = [(rows, self.block_tables.index_select(0, rows)[:, :num_blocks],  # b, ≤ num_blocks
                             positions.index_select(0, rows)) for rows, num_blocks in buckets]  # b, T
        out = torch.empty_like(q)  # B, T, H, D
        for rows, tables, pos in self._groups:  # one bucket's gather is read before the next overwrites it
            out_b = sdpa_attention(q.index_select(0, rows), *self._gather_kv(pool_k, pool_v, tables), pos,
                                   window, scale, softcap)  # b, T, H, D
            out.index_copy_(0, rows, out_b)
        return out

    def _window_tables(self, window: int, positions: torch.Tensor):
        """(tables [B, M_w], offsets [B]) for a sliding window: each row's blocks from the one holding its first
        visible key (its first query's position − window + 1) on, and that block's first position, by which the
        keys are shifted (the mask sees relative positions, the same for queries and keys). M_w bounds the
        blocks any row needs, from host values: no device read. None when that is no fewer than the whole
        table. Blocks given back by the allocator lie before every row's first block: never gathered."""
        bs, width = self.cache.block_size, self.block_tables.shape[1]
        M = min(-(-(window - 1 + self.meta.max_query_len) // bs) + 1, width)
        if M >= width:
            return None
        first = (positions[:, 0] - window + 1).clamp(min=0) // bs  # B   the first block each row reads
        idx = (first[:, None] + torch.arange(M, device=first.device)).clamp(max=width - 1)  # B, M (past: masked)
        return self.block_tables.gather(1, idx), first * bs

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write this step's k, v [B, T, Hkv, D] into their slots; return every sequence's [B, S, Hkv, D]."""
        pool_k, pool_v = self.cache.k[layer], self.cache.v[layer]
        self._write(pool_k, k)
        self._write(pool_v, v)
        return self._gather(pool_k, self.block_tables), self._gather(pool_v, self.block_tables)

    def _gather_kv(self, pool_k: torch.Tensor, pool_v: torch.Tensor, tables: torch.Tensor):
        """`_gather` of K and V into the cache's reused buffers: [b, M · block_size, Hkv, D] views,
        valid until the next gather (attention reads them at once; `update` hands out fresh ones)."""
        buf_k, buf_v = self.cache.gather_buffers(tables.numel())  # ≥ M·b blocks each
        idx = tables.flatten()
        k = torch.index_select(pool_k, 0, idx, out=buf_k[:len(idx)])
        v = torch.index_select(pool_v, 0, idx, out=buf_v[:len(idx)])
        b, (_, _, H, D) = tables.shape[0], pool_k.shape
        return k.view(b, -1, H, D), v.view(b, -1, H, D)

    def _write(self, pool: torch.Tensor, new: torch.Tensor) -> None:
        nb, bs, H, D = pool.shape
        pool.view(nb * bs, H, D).index_copy_(0, self.dst, new.reshape(-1, H, D).index_select(0, self.src))

    @staticmethod
    def _gather(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Each row's blocks in logical order: tables [b, M] -> [b, M · block_size, Hkv, D]."""
        nb, bs, H, D = pool.shape
        return pool.index_select(0, tables.flatten()).view(tables.shape[0], -1, H, D)

    def advance(self, n: int) -> None:  # the engine tracks lengths; nothing to do here
        pass
