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
The model's attention layers call `view.attention(layer, q, k, v, positions)`: the view owns
both halves of attention over the cache, writing this step's K/V and attending over everything
cached, so *how* that happens is the view's choice — the **attention backend**:

- `"torch"` (`CacheView`): `update` writes the new K/V with `index_copy_`, gathers each
  sequence's K/V back into logical order ([B, S, Hkv, D], S = max_blocks · block_size) and runs
  torch's SDPA with a causal mask. Every block is zeroed when it receives its first token, so
  slots past a sequence's context hold zeros and stale or poisoned memory can never leak in.
- `"triton"` (`TritonCacheView`): the kernels of `nanoserve.kernels` read the pool in place.
  `store_kv` scatters the new K/V into their slots; a decode step (one new token per row) runs
  `paged_attention` over the block tables (split-KV when the batch is too small to fill a GPU);
  a prefill step packs the rows' real tokens without padding (`cu_seqlens`) and runs
  `flash_attention` with the cached prefix read through the block tables. No gather, no padding
  computed, no mask tensor. Default on CUDA; on CPU the kernels run in Triton's interpreter,
  which is correct but slow, so CPU defaults to torch.

**The contiguous cache** (`KVCache`) is the special case `block_table = arange`: each row owns
consecutive blocks. It runs through exactly the same code, which is why the paged and
contiguous caches give bitwise-equal logits. Taught in notebooks/01_* and notebooks/02_*.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .errors import NanoserveError
from .models.layers import attention as sdpa_attention

ATTENTION_BACKENDS = ("torch", "triton")


def resolve_attention_backend(backend: str | None, device: torch.device | str) -> str:
    """None -> the default for the device (Triton's kernels on CUDA, torch on CPU); else check the name."""
    if backend is None:
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if backend not in ATTENTION_BACKENDS:
        raise NanoserveError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)} (or None for the "
                             f"device's default), got {backend!r}")
    return backend


class PagedKVCache:
    """k, v: [n_layers, num_blocks, block_size, n_kv_heads, head_dim]."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 attention_backend: str | None = "torch", num_kv_splits: int | None = None):
        shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.attention_backend = resolve_attention_backend(attention_backend, device)
        self.num_kv_splits = num_kv_splits  # triton decode: None = choose_num_splits (1 on CPU)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: a sequence about to write into a shared block gets its own copy first."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def view(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> CacheView:
        view_cls = TritonCacheView if self.attention_backend == "triton" else CacheView
        return view_cls(self, slot_mapping, block_tables, context_lens)


class CacheView:
    """One forward step's window onto a PagedKVCache: what `model(..., cache=view)` writes and reads.

    The torch backend: write, gather into logical order, then SDPA with a causal mask.
    """

    zero_fresh_blocks = True  # the gather reads whole blocks, so their unused slots must hold zeros

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
        if self.zero_fresh_blocks:
            fresh = self.dst[self.dst % cache.block_size == 0] // cache.block_size
            if fresh.numel():
                cache.k[:, fresh] = 0
                cache.v[:, fresh] = 0

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
        """Store this step's k, v [B, T, Hkv, D]; attend q [B, T, H, D] at `positions` over the cache.

        Returns [B, T, H, D]. The model's attention layers call this; the backend decides how."""
        k_all, v_all = self.update(layer, k, v)  # B, S, Hkv, D
        return sdpa_attention(q, k_all, v_all, positions)

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


class TritonCacheView(CacheView):
    """The triton backend: `store_kv`, then `paged_attention` (decode) or `flash_attention` (prefill).

    Rows are right-padded to T new tokens (slot −1 = padding). A prefill packs the real tokens of
    all rows back to back — row b's n_b tokens are rows cu_seqlens[b] : cu_seqlens[b+1] — so the
    kernel computes no padding; row b's first context_lens[b] − n_b tokens are its cached prefix
    (an earlier chunk or a prefix-cache hit), which the kernel reads through the block table.
    The kernels never read a slot past a row's context, so fresh blocks need no zeroing.
    """

    zero_fresh_blocks = False

    def __init__(self, cache: PagedKVCache, slot_mapping, block_tables, context_lens):
        super().__init__(cache, slot_mapping, block_tables, context_lens)
        from .kernels import check_interpreter
        from .kernels.paged_attention import choose_num_splits  # imports Triton: only for this backend

        check_interpreter(slot_mapping.device)

        B, T = slot_mapping.shape
        self.decode = T == 1 and self.src.numel() == B  # one new token in every row
        num_new = (slot_mapping >= 0).sum(1)  # B
        self.cu_seqlens = torch.zeros(B + 1, dtype=torch.int32, device=slot_mapping.device)  # B+1
        self.cu_seqlens[1:] = num_new.cumsum(0)
        self.prefix_lens = (context_lens - num_new).to(torch.int32)  # B: tokens cached before this step
        self.block_tables_i32 = block_tables.to(torch.int32)  # B, max_blocks
        self.context_lens_i32 = context_lens.to(torch.int32)  # B
        self.num_splits = cache.num_kv_splits
        if self.num_splits is None:
            max_context = int(context_lens.max()) if B else 1
            self.num_splits = choose_num_splits(B, cache.k.shape[3], max_context) if self.decode else 1

    def attention(self, layer, q, k, v, positions):
        from .kernels.flash_attention import flash_attention
        from .kernels.paged_attention import paged_attention, store_kv

        B, T, H, D = q.shape
        Hkv = k.shape[2]
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]  # num_blocks, block_size, Hkv, D
        k_new = k.reshape(B * T, Hkv, D).index_select(0, self.src)  # N, Hkv, D  (real tokens only)
        v_new = v.reshape(B * T, Hkv, D).index_select(0, self.src)  # N, Hkv, D
        store_kv(k_new, v_new, k_cache, v_cache, self.dst)
        if self.decode:  # each row's query sees its context_lens[b] keys, its own just stored
            out = paged_attention(q[:, 0], k_cache, v_cache, self.block_tables_i32, self.context_lens_i32,
                                  num_splits=self.num_splits)  # B, H, D
            return out[:, None]  # B, 1, H, D
        q_new = q.reshape(B * T, H, D).index_select(0, self.src)  # N, H, D
        out_new = flash_attention(q_new, k_new, v_new, self.cu_seqlens, self.cu_seqlens, causal=True,
                                  block_tables=self.block_tables_i32, k_cache=k_cache, v_cache=v_cache,
                                  context_lens=self.prefix_lens)  # N, H, D
        out = q.new_zeros(B * T, H, D)  # padding rows get zeros (their logits are never read)
        out.index_copy_(0, self.src, out_new)
        return out.view(B, T, H, D)


class KVCache:
    """The contiguous cache: `batch` rows of up to `max_seq_len` tokens, all rows the same length.

    Row b owns blocks b·n .. b·n + n − 1 (block_table = arange), so writing token i of row b is
    writing slot (b·n + i // block_size) · block_size + i % block_size — one contiguous range
    of memory per row, exactly the layout of a plain [batch, max_seq_len] tensor.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", block_size: int = 16,
                 attention_backend: str | None = "torch"):
        n = -(-max_seq_len // block_size)  # blocks per row
        self.pool = PagedKVCache(cfg, batch_size * n, block_size, dtype, device, attention_backend)
        self.block_tables = torch.arange(batch_size * n, device=device).view(batch_size, n)  # B, n
        self.batch_size, self.max_seq_len, self.block_size = batch_size, max_seq_len, block_size
        self.length = 0  # tokens cached so far, in every row
        self._view: CacheView | None = None

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return self._view_for(layer, k.shape[1]).update(layer, k, v)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        return self._view_for(layer, k.shape[1]).attention(layer, q, k, v, positions)

    def _view_for(self, layer: int, T: int) -> CacheView:
        if layer == 0 or self._view is None:
            self._view = self._bind(T)
        return self._view

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
