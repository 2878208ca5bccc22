"""The Triton attention backend: the kernels of nanoserve.kernels read the paged pool in place.

`store_kv` scatters the new K/V into their slots; a decode step runs `paged_attention` over the
block tables (split-KV when the batch is too small to fill a GPU); a prefill step packs the rows'
real tokens (`cu_seqlens`) and runs `flash_attention` with the cached prefix read through the
block tables. A quantized pool (kv_cache_dtype, kv/quant.py) is quantized by `store_kv` and
dequantized tile by tile inside the attention kernels. Taught in notebooks/04_* and 12_*.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..extension_points import extension
from .metadata import CommonAttentionMetadata, host_tensor
from .torch_backend import CacheView


@dataclass
class TritonAttentionMetadata(CommonAttentionMetadata):
    """The Triton backend's metadata: the common part (metadata.py) with block_tables and
    context_lens in int32, as the kernels read them (converted on the host, not by a launch a
    step), and

        prefix_lens  [B] int32  tokens of each row cached before this step
        tree_bits    [N] int64 or None: which of its row's new tokens each real token sees, bit j
                     for token j (−1 in a chain row), when some row is a token tree (speculative
                     verification; spec/tree_sampler.py); None: causal by position
    """

    prefix_lens: torch.Tensor
    tree_bits: torch.Tensor | None = None


class TritonCacheView(CacheView):
    """The triton backend: `store_kv`, then `paged_attention` (decode) or `flash_attention`
    (prefill).

    Rows are right-padded to T new tokens (slot −1 = padding). A prefill packs the real tokens of
    all rows back to back — row b's n_b tokens are rows cu_seqlens[b] : cu_seqlens[b+1] — so the
    kernel computes no padding; row b's first context_lens[b] − n_b tokens are its cached prefix
    (an earlier chunk or a prefix-cache hit), which the kernel reads through the block table.
    The kernels never read a slot past a row's context, so fresh blocks need no zeroing.

    With a quantized pool, a prefill reads this step's keys back from the pool too, like every other
    key (all of a row's context_lens[b] keys as its prefix, no new keys): attention then sees
    exactly the values the cache holds, in prefill as in decode, and as the torch backend does.
    (vLLM attends over a chunk's own keys unquantized: slightly more precise for the prompt,
    different from what decode sees.)
    """

    zero_fresh_blocks = False

    @classmethod
    def build_metadata(cls, cache, common: CommonAttentionMetadata,
                       trees: list | None = None) -> TritonAttentionMetadata:
        """This backend's metadata for a step, from the common part (on the CPU still) and, when
        some row is a token tree, every row's tree (its parents; None: a chain)."""
        num_new = common.query_lens()  # B (host values)
        lens = common.context_lens.tolist()  # B
        prefix = host_tensor((n_ctx - n for n_ctx, n in zip(lens, num_new)), dtype=torch.int32)
        bits = None
        if trees is not None:
            bits = extension("token_trees").packed_ancestor_bits(trees, num_new)
        fields = common.as_kwargs()
        fields["block_tables"] = common.block_tables.to(torch.int32)  # (on the host)
        fields["context_lens"] = common.context_lens.to(torch.int32)
        return TritonAttentionMetadata(**fields, prefix_lens=prefix, tree_bits=bits)

    def __init__(self, cache, meta: TritonAttentionMetadata):
        super().__init__(cache, meta)
        from ..kernels import check_interpreter
        from ..kernels.split_kv import choose_num_splits  # imports Triton: only for this backend

        check_interpreter(meta.slot_mapping.device)
        # spec_decode.check_tree_fits refuses it first
        if meta.tree_bits is not None and cache.quant is not None:
            raise NotImplementedError("a token tree over a quantized pool: its keys are read back "
                                      "from the pool, where the kernel applies no tree mask")
        self.decode = meta.decode  # one new token in every row
        self.cu_seqlens, self.prefix_lens = meta.cu_seqlens, meta.prefix_lens  # B+1, B (int32)
        self.block_tables_i32 = meta.block_tables  # B, max_blocks (int32)
        self.context_lens_i32 = meta.context_lens  # B (int32)
        self.quantized = cache.quant is not None
        # a decode step into a 16/32-bit pool: RoPE and the K/V store in one kernel
        self.fuses_rope_store = self.decode and not self.quantized
        # a prefill reads every key from the pool: no new keys per row
        if self.quantized and not self.decode:
            self.no_new_keys = torch.zeros_like(self.cu_seqlens)  # B+1
        self.num_splits = cache.num_kv_splits
        if self.num_splits is None:  # from host values: choosing must not read the device
            B = meta.slot_mapping.shape[0]
            self.num_splits = choose_num_splits(B, cache.k.shape[3],
                                                meta.max_context) if self.decode else 1

    def attention(self, layer, q, k, v, positions, window=None, scale=None, softcap=None):
        from ..kernels.flash_attention import flash_attention
        from ..kernels.paged_attention import paged_attention
        from ..kernels.store_kv import store_kv

        B, T, H, D = q.shape
        Hkv = k.shape[2]
        k_cache, v_cache = self.cache.layer(layer)  # num_blocks, block_size, Hkv, D
        # a quantized pool's format and scales [num_blocks, block_size, Hkv], for the kernels
        kv = {}
        if self.quantized:
            (k_cache, k_scale), (v_cache, v_scale) = k_cache, v_cache
            kv = dict(kv_cache_dtype=self.cache.kv_cache_dtype, k_scale=k_scale, v_scale=v_scale)
        k_new = k.reshape(B * T, Hkv, D).index_select(0, self.src)  # N, Hkv, D  (real tokens only)
        v_new = v.reshape(B * T, Hkv, D).index_select(0, self.src)  # N, Hkv, D
        store_kv(k_new, v_new, k_cache, v_cache, self.dst, **kv)
        if self.decode:  # each row's query sees its context_lens[b] keys, its own just stored
            out = paged_attention(q[:, 0], k_cache, v_cache, self.block_tables_i32,
                                  self.context_lens_i32,
                                  sm_scale=scale, num_splits=self.num_splits, window=window,
                                  softcap=softcap, **kv)
            return out[:, None]  # B, 1, H, D
        q_new = q.reshape(B * T, H, D).index_select(0, self.src)  # N, H, D
        # the prefix, then this step's keys
        new_keys = (k_new, v_new, self.cu_seqlens, self.prefix_lens)
        if self.quantized:  # every key from the pool (class docstring)
            new_keys = (k_new[:0], v_new[:0], self.no_new_keys, self.context_lens_i32)
        k_step, v_step, cu_k, prefix = new_keys
        out_new = flash_attention(
            q_new, k_step, v_step, self.cu_seqlens, cu_k, causal=True, sm_scale=scale,
            block_tables=self.block_tables_i32, k_cache=k_cache, v_cache=v_cache,
            context_lens=prefix, max_seqlen_q=self.meta.max_query_len, window=window,
            softcap=softcap, tree_bits=self.meta.tree_bits, **kv,
        )  # N, H, D
        out = q.new_zeros(B * T, H, D)  # padding rows get zeros (their logits are never read)
        out.index_copy_(0, self.src, out_new)
        return out.view(B, T, H, D)

    def rope_attention(self, layer, q, k, v, positions, cos, sin, window=None, scale=None,
                       softcap=None):
        """A decode step's attention with RoPE applied here, when `fuses_rope_store`: q [B, H, D]
        and k, v [B, Hkv, D] before rotation (views of the QKV projection), `positions` [B, 1], cos
        and sin the layer's table [P, R/2] (models/triton_layers.py). One kernel rotates q and k
        and writes k, v into their slots (kernels/rotary.py), then paged attention. Returns
        [B, 1, H, D]. (Other steps: the layer rotates, then calls `attention`.)"""
        from ..kernels.paged_attention import paged_attention
        from ..kernels.rotary import rotary_embedding_store_kv

        k_cache, v_cache = self.cache.layer(layer)  # num_blocks, block_size, Hkv, D
        q = rotary_embedding_store_kv(q, k, v, positions.reshape(-1), cos, sin, k_cache, v_cache,
                                      self.meta.slot_mapping.reshape(-1))  # B, H, D
        out = paged_attention(q, k_cache, v_cache, self.block_tables_i32, self.context_lens_i32,
                              sm_scale=scale, num_splits=self.num_splits, window=window,
                              softcap=softcap)
        return out[:, None]  # B, 1, H, D
