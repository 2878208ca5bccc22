"""The CPU attention backend: decode steps read the paged pool in place, through a C kernel.

A decode step (one new token in every row) is where the torch backend's gather costs most: it copies
every sequence's whole context out of the pool, per layer, per step, to attend with one query. Here
that step runs `paged_attention_cpu` (kernels/cpu_paged_attention.c) over the block tables instead,
which reads each key and value once and copies nothing. Every other step (prefills, chunks,
speculative verification: several new tokens in a row) and a quantized pool take the torch
backend's path unchanged, so this class is the torch backend with one fast case. It is the CPU
default where the kernel builds (kv/cache.py: `resolve_attention_backend`); figures in
benchmarks/RESULTS.md, "Where the time goes".
"""

from __future__ import annotations

import torch

from .torch_backend import CacheView, TorchAttentionMetadata


class CpuCacheView(CacheView):
    """The torch backend (CacheView), except that a decode step over a float32 pool runs the C
    kernel."""

    def __init__(self, cache, meta: TorchAttentionMetadata):
        super().__init__(cache, meta)
        self.in_place = self.reads_in_place(cache, meta.decode)
        # the kernel trusts its indices: check them once per step, here, not per layer
        if self.in_place:
            from ..kernels.checks import check_block_ids

            # B, max_blocks; B
            self.tables, self.context_lens = meta.block_tables.long(), meta.context_lens.long()
            check_block_ids(self.tables, self.context_lens, cache.block_size, cache.num_blocks)

    @staticmethod
    def reads_in_place(cache, decode: bool) -> bool:
        """Whether a step runs the C kernel over the pool: a decode step over a float32, unquantized
        pool with V of its own (MLA's latent, V read from K, takes the torch path: the kernel
        reads K and V as two pools of one head_dim)."""
        plain = cache.quant is None and cache.v_in_k is None
        return decode and plain and cache.dtype == torch.float32

    @classmethod
    def gathers_by_bucket(cls, cache, decode: bool) -> bool:
        """A step the C kernel reads in place gathers nothing (no length buckets to build)."""
        return not cls.reads_in_place(cache, decode)

    def attention(self, layer, q, k, v, positions, window=None, scale=None, softcap=None,
                  sinks=None):
        if not self.in_place:
            return super().attention(layer, q, k, v, positions, window, scale, softcap,
                                     sinks=sinks)
        from ..kernels.cpu_paged_attention import paged_attention_cpu_unchecked

        pool_k, pool_v = self.cache.layer(layer)  # num_blocks, block_size, Hkv, D
        self._write(pool_k, k)  # each row's new key and value first: its query sees itself
        self._write(pool_v, v)
        out = paged_attention_cpu_unchecked(
            q[:, 0], pool_k, pool_v, self.tables, self.context_lens, scale, window or 0,
            softcap or 0.0, sinks,
        )  # B, H, D
        return out[:, None]  # B, 1, H, D
