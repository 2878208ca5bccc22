"""The torch attention backend over the paged KV cache: write this step's K/V into their slots,
gather each sequence's blocks back into logical order, and run SDPA with a causal mask.

Simple and exact, and the reference the Triton backend (triton_backend.py) is tested against.
Its cost grows with batch × context every step (the gather); the kernels read the pool in place.
The gather writes into the cache's workspace (PagedKVCache.gather_buffers), not a fresh tensor: on
CPU a fresh tensor of tens of MB comes from the OS page by page, and zeroing those pages cost ~10×
the copy itself (benchmarks/RESULTS.md, "Where the time goes"). Taught in notebooks/02_*.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..extension_points import extension
from ..models.layers import attention as sdpa_attention
from .metadata import CommonAttentionMetadata, host_tensor, length_buckets


@dataclass
class TorchAttentionMetadata(CommonAttentionMetadata):
    """The torch backend's metadata: the common part (metadata.py), and

        fresh_blocks  [F]  blocks receiving their first token (offset 0) this step
        no_prefix     host value: no row has tokens cached before this step (prefills from
                      scratch)
        buckets       [(rows, num_blocks)]: rows grouped by the blocks their context needs,
                      rounded up to a ladder of sizes (metadata.bucket_size; each group is
                      gathered to its own length, not every row to the longest)
        attn_mask     [B, T, M·block_size] or None: which gathered keys each new token sees, when a
                      row holds a token tree (speculative verification; spec/tree_sampler.py)
                      rather than a run of consecutive positions; None: causal by position
        query_positions  [B, T] each new token's index among its row's cached keys, context_len −
                      query_len + i as the kernels align causality: the causal mask's positions.
                      The same as the tokens' positions unless the row evicted K/V (its cache then
                      holds fewer keys than its position says; engine/kv_eviction.py)
    """

    fresh_blocks: torch.Tensor
    no_prefix: bool = False
    buckets: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    attn_mask: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> TorchAttentionMetadata:
        moved = super().to(device)
        if moved is self:
            return self
        buckets = [(rows.to(device, non_blocking=True), n) for rows, n in self.buckets]
        return replace(moved, buckets=buckets)


class CacheView:
    """One forward step's window onto a PagedKVCache: what `model(..., cache=view)` writes and
    reads.

    The torch backend: write, gather into logical order, then SDPA with a causal mask.
    """

    zero_fresh_blocks = True  # the gather reads whole blocks, so their unused slots must hold zeros

    def __init__(self, cache, meta: TorchAttentionMetadata):
        self.cache, self.meta = cache, meta
        self.src, self.dst = meta.src, meta.dst  # N: the real tokens' rows in B·T, and their slots
        self.block_tables = meta.block_tables  # B, max_blocks
        # per bucket: (rows, their block tables, their positions), made at layer 0
        self._groups = None
        # A block receives its first token at offset 0 (tokens are written in order; copy-on-write
        # and prefix-cache blocks arrive with their contents). Zero it then, in every layer: a
        # block's slots past the context then hold zeros, never stale or poisoned memory, so the
        # gathered K/V need no masking of their own (the attention mask hides those slots, and
        # 0 · weight stays 0 where NaN · 0 would not).
        if self.zero_fresh_blocks and len(meta.fresh_blocks):
            # (scales: None unless quantized)
            for pool in (cache.k, cache.v, cache.k_scale, cache.v_scale):
                if pool is not None:
                    pool.index_fill_(1, meta.fresh_blocks, 0)

    @classmethod
    def build_metadata(cls, cache, common: CommonAttentionMetadata,
                       trees: list | None = None) -> TorchAttentionMetadata:
        """This backend's metadata for a step, from the common part (on the CPU still) and, when
        some row is a token tree, every row's tree (its parents; None: a chain)."""
        bs = cache.block_size
        lens = common.context_lens.tolist()  # B (host values)
        num_new = common.query_lens()  # B
        fresh = host_tensor([slot // bs for slot in common.dst.tolist() if slot % bs == 0])
        mask = None
        if trees is not None:  # the mask spans the longest row's keys: no buckets
            T = common.slot_mapping.shape[1]
            S = common.block_tables.shape[1] * bs
            mask = extension("token_trees").tree_mask(trees, num_new, common.context_lens, T, S)
        buckets = []
        if mask is None and cls.gathers_by_bucket(cache, common.decode):
            buckets = length_buckets(lens, bs)
        return TorchAttentionMetadata(**common.as_kwargs(), fresh_blocks=fresh,
                                      no_prefix=lens == num_new, buckets=buckets, attn_mask=mask,
                                      query_positions=cache_positions(common, num_new))

    @classmethod
    def gathers_by_bucket(cls, cache, decode: bool) -> bool:
        """Whether a step's attention gathers K/V by length bucket (metadata.length_buckets)."""
        return True

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  positions: torch.Tensor, window: int | None = None, scale: float | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store this step's k, v [B, T, Hkv, D]; attend q [B, T, H, D] at `positions` over the
        cache (each query over its `window` newest keys only, when the layer has a sliding window;
        scores × `scale`, default 1/√D, and soft-capped at `softcap` when given; `sinks` [H]: each
        head's learned sink logit joins its softmax, gpt-oss: layers.attention).

        Returns [B, T, H, D]. The model's attention layers call this; the backend decides how. Rows
        are gathered by length bucket (metadata.length_buckets), each bucket to its own length."""
        # num_blocks, block_size, Hkv, D (+ scales, quantized)
        pool_k, pool_v = self.cache.layer(layer)
        self._store(pool_k, pool_v, k, v)
        if self.meta.no_prefix and self.meta.attn_mask is None and self.cache.quant is None:
            # Prefills from scratch: this step's k, v are every key there is (each row's key j at
            # position j; a padding key sits after its row's real ones, where no real query looks).
            # Nothing to gather.
            window_positions = None if window is None else positions
            return sdpa_attention(q, k, v, window_positions, window, scale, softcap, sinks=sinks)
        if window is not None:
            windowed = self._window_tables(window, positions)
            # gather only the blocks the window reaches, not the whole context
            if windowed is not None:
                tables, offsets = windowed  # B, M_w; B
                return sdpa_attention(q, *self._gather_kv(pool_k, pool_v, tables),
                                      positions - offsets[:, None],
                                      window, scale, softcap, sinks=sinks)
        # a token tree in some row: its mask spans the longest row's keys
        if self.meta.attn_mask is not None:
            return sdpa_attention(q, *self._gather_kv(pool_k, pool_v, self.block_tables), positions,
                                  None, scale,
                                  softcap, mask=self.meta.attn_mask, sinks=sinks)
        buckets = self.meta.buckets
        if self.meta.query_positions is not None:  # the mask's: among the cached keys
            positions = self.meta.query_positions
        if len(buckets) <= 1:  # one length: every row gathered to the longest, as `update` does
            return sdpa_attention(q, *self._gather_kv(pool_k, pool_v, self.block_tables), positions,
                                  window, scale,
                                  softcap, sinks=sinks)
        if self._groups is None:  # each bucket's tables and positions: the same in every layer
            # b, ≤ num_blocks
            self._groups = [(rows, self.block_tables.index_select(0, rows)[:, :num_blocks],
                             # b, T
                             positions.index_select(0, rows)) for rows, num_blocks in buckets]
        # B, T, H, Dv (V's width: K's, or MLA's latent r where V is K's first r values)
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        # one bucket's gather is read before the next overwrites it
        for rows, tables, pos in self._groups:
            out_b = sdpa_attention(q.index_select(0, rows),
                                   *self._gather_kv(pool_k, pool_v, tables), pos,
                                   window, scale, softcap, sinks=sinks)  # b, T, H, D
            out.index_copy_(0, rows, out_b)
        return out

    def _window_tables(self, window: int, positions: torch.Tensor):
        """(tables [B, M_w], offsets [B]) for a sliding window: each row's blocks from the one
        holding its first visible key (its first query's position − window + 1) on, and that block's
        first position, by which the keys are shifted (the mask sees relative positions, the same
        for queries and keys). M_w bounds the blocks any row needs, from host values: no device
        read. None when that is no fewer than the whole table. Blocks given back by the allocator
        lie before every row's first block: never gathered."""
        bs, width = self.cache.block_size, self.block_tables.shape[1]
        M = min(-(-(window - 1 + self.meta.max_query_len) // bs) + 1, width)
        if M >= width:
            return None
        # B   the first block each row reads
        first = (positions[:, 0] - window + 1).clamp(min=0) // bs
        # B, M (past: masked)
        idx = (first[:, None] + torch.arange(M, device=first.device)).clamp(max=width - 1)
        return self.block_tables.gather(1, idx), first * bs

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write this step's k, v [B, T, Hkv, D] into their slots; return every sequence's [B, S,
        Hkv, D]."""
        pool_k, pool_v = self.cache.layer(layer)
        self._store(pool_k, pool_v, k, v)
        keys = self._gather(pool_k, self.block_tables)
        if self.cache.v_in_k is not None:  # V is K's first r values (MLA's latent)
            return keys, keys[..., :self.cache.v_in_k]
        return keys, self._gather(pool_v, self.block_tables)

    def _store(self, pool_k, pool_v, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's k and v into their slots; v only where V has a pool of its own (where it is
        K's first r values, MLA's latent, writing k wrote it)."""
        self._write(pool_k, k)
        if self.cache.v_in_k is None:
            self._write(pool_v, v)

    def _gather_kv(self, pool_k: torch.Tensor, pool_v: torch.Tensor, tables: torch.Tensor):
        """`_gather` of K and V into the cache's reused buffers: [b, M · block_size, Hkv, D] views,
        valid until the next gather (attention reads them at once; `update` hands out fresh
        ones)."""
        buf_k, buf_v = self.cache.gather_buffers(tables.numel())  # ≥ M·b blocks each
        idx = tables.flatten()
        k = self._gather_into(pool_k, idx, buf_k[:len(idx)])
        b, H, D = tables.shape[0], k.shape[2], k.shape[3]
        k = k.view(b, -1, H, D)
        if self.cache.v_in_k is not None:  # V is K's first r values (MLA's latent): one gather
            return k, k[..., :self.cache.v_in_k]
        v = self._gather_into(pool_v, idx, buf_v[:len(idx)])
        return k, v.view(b, -1, H, D)

    def _gather_into(self, pool, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The blocks `idx` of one pool, in the model's dtype, into `out` [n, block_size, Hkv, D]; a
        quantized pool ((codes, scales): kv/quant.py) is dequantized on the way, the gather's only
        full-precision copy."""
        if not isinstance(pool, tuple):
            return torch.index_select(pool, 0, idx, out=out)
        codes, scales = pool
        return self.cache.quant.dequantize(codes.index_select(0, idx), scales.index_select(0, idx),
                                           out.dtype, out=out)

    def _write(self, pool, new: torch.Tensor) -> None:
        """This step's K or V [B, T, Hkv, D] into their slots (quantized first, when the pool
        is)."""
        codes, scales = pool if isinstance(pool, tuple) else (pool, None)
        rows = new.reshape(-1, *new.shape[-2:])  # B·T, Hkv, D
        if len(self.src) < len(rows):  # padding among the rows: the real tokens only
            rows = rows.index_select(0, self.src)  # N, Hkv, D
        if scales is not None:
            # N, Hkv, D codes (int4: D/2 bytes); N, Hkv scales (int4: N, Hkv, 2·D/G)
            rows, s = self.cache.quant.quantize(rows)
            scales.flatten(0, 1).index_copy_(0, self.dst, s)
        codes.flatten(0, 1).index_copy_(0, self.dst, rows)

    def _gather(self, pool, tables: torch.Tensor) -> torch.Tensor:
        """Each row's blocks in logical order: tables [b, M] -> [b, M · block_size, Hkv, D] (a fresh
        tensor)."""
        codes = pool[0] if isinstance(pool, tuple) else pool
        bs, H, D = codes.shape[1], codes.shape[2], self.cache.head_dim  # (int4 codes: D/2 bytes)
        out = torch.empty((tables.numel(), bs, H, D), dtype=self.cache.dtype, device=codes.device)
        return self._gather_into(pool, tables.flatten(), out).view(tables.shape[0], -1, H, D)

    def advance(self, n: int) -> None:  # the engine tracks lengths; nothing to do here
        pass


def cache_positions(common: CommonAttentionMetadata, num_new: list[int]) -> torch.Tensor:
    """[B, T] each new token's index among its row's cached keys: context_len − n + i for its
    i-th of n new tokens (padding repeats the last), on the host."""
    T = common.slot_mapping.shape[1]
    n = torch.tensor(num_new, dtype=torch.long)  # B
    first = common.context_lens - n  # B
    offset = torch.minimum(torch.arange(T)[None, :], (n - 1).clamp(min=0)[:, None])  # B, T
    return first[:, None] + offset
