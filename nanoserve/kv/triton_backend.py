"""The Triton attention backend: the kernels of nanoserve.kernels read the paged pool in place.

`store_kv` scatters the new K/V into their slots; a decode step runs `paged_attention` over the
block tables (split-KV when the batch is too small to fill a GPU); a prefill step packs the rows'
real tokens (`cu_seqlens`) and runs `flash_attention` with the cached prefix read through the
block tables. A quantized pool (kv_cache_dtype, kv/quant.py) is quantized by `store_kv` and
dequantized tile by tile inside the attention kernels.

A pool of MLA's latent (DeepSeek-V2/V3, models/mla.py: one K "head" [c_kv ; k_pe] per token, V read
as its first r values) has its own view, `TritonLatentCacheView`: its decode steps run
`mla_decode` (kernels/mla_decode.py) over the pool in place; its prefills, chunks and speculative
multi-token steps take the torch backend's path (gather, then SDPA), as the CPU backend's do.
Taught in notebooks/04_* and 12_*.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..errors import NanoserveError
from ..extension_points import extension
from .metadata import CommonAttentionMetadata, host_tensor
from .torch_backend import CacheView, TorchAttentionMetadata


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


@dataclass
class LatentTorchMetadata(TorchAttentionMetadata):
    """The torch backend's metadata (torch_backend.py) for a step over MLA's latent pool that
    `TritonLatentCacheView` gives to the torch path (every step but a decode), and

        stale_slots  [S] the slots past each row's context in its last block (they may hold an
                     earlier owner's values: the kernel's decode steps zero no fresh block)
    """

    stale_slots: torch.Tensor | None = None


class TritonLatentCacheView(CacheView):
    """The triton backend over MLA's latent pool (`cache.v_in_k` = r: models/mla.py): the torch
    backend (CacheView), except that a decode step runs `mla_decode` over the pool in place.

    The layer passes the absorbed query [q_lat ; q_pe] [B, 1, H, r + d_rope] and the token's
    latent key [c_kv ; k_pe] [B, 1, 1, r + d_rope]. A decode step (one new token in every row)
    writes the key into its slot with `store_kv` (slot −1, a CUDA graph's padding row, is skipped)
    and runs `mla_decode(q_lat, q_pe, pool, ...)`, which returns o_lat [B, H, r]; the layer then
    applies W_UV. Its metadata is the Triton backend's (`TritonAttentionMetadata`: int32 tables,
    as the decode CUDA graphs build it too).

    Every other step (a prefill, a chunk after a cached prefix, a speculative verification of
    several tokens or a token tree) takes the torch path unchanged: there is no latent prefill
    kernel, and the flash kernel reads separate K and V pools of one head_dim. The torch path
    gathers whole blocks, so before it runs, the slots past each row's context in its last block
    are zeroed (`stale_slots`, in every layer): the decode steps write into fresh blocks without
    zeroing them (a CUDA graph replays a fixed set of launches), and masked slots must hold finite
    values (0 · weight is 0, NaN · 0 is not). Refused by name: a sliding window, soft-capped scores
    and attention sinks on a decode step (the kernel has none; MLA models use none), and a CUDA
    graph of a verification step (its torch path reads host values).
    """

    zero_fresh_blocks = False  # `stale_slots` instead (class docstring)

    @classmethod
    def build_metadata(cls, cache, common: CommonAttentionMetadata,
                       trees: list | None = None):
        """A decode step: the Triton backend's metadata; any other step: the torch backend's, with
        the stale slots of each row's last block (host values)."""
        if common.decode and trees is None:
            return TritonCacheView.build_metadata(cache, common)
        torch_meta = super().build_metadata(cache, common, trees)
        stale = stale_tail_slots(common.block_tables.tolist(), common.context_lens.tolist(),
                                 cache.block_size)
        values = {f.name: getattr(torch_meta, f.name) for f in dataclasses.fields(torch_meta)}
        return LatentTorchMetadata(**values, stale_slots=host_tensor(stale))

    def __init__(self, cache, meta):
        super().__init__(cache, meta)
        self.decode = meta.decode and not isinstance(meta, TorchAttentionMetadata)
        if not self.decode and not isinstance(meta, LatentTorchMetadata):
            raise NotImplementedError(
                "a several-token step over MLA's latent pool with the Triton backend's metadata "
                "(a verification step's CUDA graph): these steps take the torch path, which reads "
                "host values; run it eagerly (enforce_eager=True)")
        if self.decode:
            from ..kernels import check_interpreter

            check_interpreter(meta.slot_mapping.device)
        elif len(meta.stale_slots):  # in every layer at once: L, slots, 1, r + d_rope
            cache.k.flatten(1, 2).index_fill_(1, meta.stale_slots, 0)

    @staticmethod
    def kernel_problem(dtype: torch.dtype, device: torch.device | str) -> str | None:
        """Why `mla_decode` cannot run for this dtype on `device`, or None (kv/cache.py asks
        before choosing the backend). Reads no tensor and imports no Triton."""
        from ..kernels import configs

        if dtype not in configs.DTYPES:
            return (f"the MLA decode kernel takes {', '.join(map(str, configs.DTYPES))}, "
                    f"not {dtype}")
        arch = configs.gpu_arch(device)
        if arch is None:  # the interpreter runs every supported dtype
            return None
        if arch < configs.MIN_ATTENTION_ARCH:
            return (f"sm_{arch}: the MLA decode kernel needs sm_{configs.MIN_ATTENTION_ARCH} or "
                    "newer (tensor-core tl.dot, bf16)")
        try:
            configs.pick("mla_decode", device, dtype)  # its shared memory on this GPU
        except ValueError as err:
            return str(err)
        return None

    def attention(self, layer, q, k, v, positions, window=None, scale=None, softcap=None,
                  sinks=None):
        """q [B, T, H, r + d_rope] = [q_lat ; q_pe], k [B, T, 1, r + d_rope] = [c_kv ; k_pe], v
        its first r values -> o_lat [B, T, H, r]."""
        if not self.decode:
            return super().attention(layer, q, k, v, positions, window, scale, softcap,
                                     sinks=sinks)
        from ..kernels.mla_decode import mla_decode
        from ..kernels.store_kv import store_kv

        for name, value in (("window", window), ("softcap", softcap), ("sinks", sinks)):
            if value is not None:
                raise NanoserveError(f"{name}={value!r}: the MLA decode kernel "
                                     "(kernels/mla_decode.py) has no sliding window, soft cap or "
                                     "sinks; allowed: None (or attention_backend='torch')")
        B, _, H, width = q.shape
        r = self.cache.v_in_k
        pool, _ = self.cache.layer(layer)  # num_blocks, block_size, 1, r + d_rope
        key = k.reshape(B, 1, width)  # B, 1, r + d_rope   one new token a row
        # V is the pool's first r values: the pool goes in as both (each slot written twice, the
        # same values)
        store_kv(key, key, pool, pool, self.dst)
        q_lat, q_pe = q[:, 0].split([r, width - r], dim=-1)  # B, H, r; B, H, d_rope
        if scale is None:  # as the torch path's SDPA: 1/√ of the query's width
            scale = width ** -0.5
        o_lat = mla_decode(q_lat, q_pe, pool, self.meta.block_tables, self.meta.context_lens,
                           scale)  # B, H, r
        return o_lat[:, None]  # B, 1, H, r


def stale_tail_slots(block_tables: list[list[int]], context_lens: list[int],
                     block_size: int) -> list[int]:
    """The slots past each row's context in its last block: row b's last block holds
    context_lens[b] % block_size of its tokens (all of them when that is 0: no slot)."""
    slots = []
    for table, n in zip(block_tables, context_lens):
        used = n % block_size
        if used == 0:
            continue
        start = table[(n - 1) // block_size] * block_size
        slots.extend(range(start + used, start + block_size))
    return slots


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
    latent_view = TritonLatentCacheView  # the view of a pool of MLA's latent (kv/cache.py)

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

    def attention(self, layer, q, k, v, positions, window=None, scale=None, softcap=None,
                  sinks=None):
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
                                  softcap=softcap, sinks=sinks, **kv)
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
            softcap=softcap, tree_bits=self.meta.tree_bits, sinks=sinks, **kv,
        )  # N, H, D
        out = q.new_zeros(B * T, H, D)  # padding rows get zeros (their logits are never read)
        out.index_copy_(0, self.src, out_new)
        return out.view(B, T, H, D)

    def rope_attention(self, layer, q, k, v, positions, cos, sin, window=None, scale=None,
                       softcap=None, sinks=None):
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
                              softcap=softcap, sinks=sinks)
        return out[:, None]  # B, 1, H, D
