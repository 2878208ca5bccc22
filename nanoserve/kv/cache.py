"""KV caches: keys and values of past tokens, so each decode step runs the model on new tokens only.

Without a cache, generating token t recomputes keys and values for all t previous tokens, so
n tokens cost O(n²) token-forwards; with it, O(n). Notebook 01 builds the simplest cache, one
preallocated [max_len] tensor per layer. This file holds the cache the engine uses:

**Paged storage** (Kwon et al. 2023, vLLM). Per layer, K and V live in a pool of fixed-size
blocks, `[num_blocks, block_size, n_kv_heads, head_dim]`. A sequence's tokens are spread over
blocks listed in its *block table*; token i of a sequence lives in block
`block_table[i // block_size]` at offset `i % block_size`, i.e. in *slot*
`block_table[i // block_size] * block_size + i % block_size`. Which blocks a sequence gets is
the block allocator's business (nanoserve/engine/block_allocator.py); this package only stores and
reads.

Per forward step the engine binds a `CacheView` to its backend's attention metadata (metadata.py),
built on the host: `slot_mapping` [B, T] (where each new token's K/V goes, −1 for padding),
`block_tables` [B, max_blocks] (each sequence's blocks in logical order), `context_lens` [B]
(tokens in the cache once this step's are written), and what the backend derives from them.
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
  which is correct but slow. A pool of MLA's latent (`TritonLatentCacheView`) runs its decode
  steps through `mla_decode` and its other steps through the torch backend's path.
- `"cpu"` (`CpuCacheView`, cpu_backend.py): the torch backend, except that a decode step reads the
  pool in place through a small C kernel (kernels/cpu_paged_attention.c) instead of gathering it.
  Default on the CPU where a C compiler builds it and the model computes in float32.

**The contiguous cache** (`KVCache`) is the special case `block_table = arange`: each row owns
consecutive blocks. It runs through exactly the same code, which is why the paged and
contiguous caches give bitwise-equal logits. Taught in notebooks/01_* and notebooks/02_*.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ..config import ATTENTION_BACKENDS, check_block_size
from ..errors import NanoserveError
from ..extension_points import extension
from ..models.config import KVLayout, ModelConfig
from .metadata import CommonAttentionMetadata
from .torch_backend import CacheView

logger = logging.getLogger("nanoserve")


def resolve_attention_backend(backend: str | None, device: torch.device | str,
                              head_dim: int | None = None,
                              dtype: torch.dtype | None = None,
                              kv_layout: KVLayout | None = None) -> str:
    """None -> the default for the device: on CUDA Triton's kernels where they serve this head_dim
    and dtype, on the CPU the C decode kernel where it builds and the model computes in float32;
    else torch, with the reason logged. "triton" or "cpu" where they cannot serve is refused, with
    the reason. A latent `kv_layout` (V read from K: MLA) is served by torch, by the CPU backend
    (through its torch path: the C kernel reads no latent) and by Triton where its latent decode
    kernel runs (kernels/mla_decode.py; other steps take the torch path: triton_backend.py)."""
    if backend is not None and backend not in ATTENTION_BACKENDS:
        raise NanoserveError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)} "
                             f"(or None for the device's default), got {backend!r}")
    cuda = torch.device(device).type == "cuda"
    fast = "triton" if cuda else "cpu"  # the device's backend that reads the pool in place
    problem = None
    if backend in (None, fast) and head_dim is not None and dtype is not None:
        problem = extension("attention_backends").in_place_problem(cuda, head_dim, dtype, device)
    if backend == "cpu" and cuda:
        problem = ("it runs on the CPU, and this model is on CUDA (its in-place backend there "
                   "is 'triton')")
    latent = kv_layout is not None and kv_layout.v_in_k is not None
    if latent and (backend == "triton" or (backend is None and cuda)) and dtype is not None:
        # Triton's latent view runs the MLA decode kernel, not the paged and flash ones
        views = extension("attention_backends").VIEWS
        problem = views["triton"].latent_view.kernel_problem(dtype, device)
    if backend in ("triton", "cpu") and problem:
        raise NanoserveError(f"attention_backend={backend!r} cannot serve this model here: "
                             f"{problem}; use 'torch'")
    if backend is None:
        # (the CPU kernel is float32 only: no news for bf16)
        if problem and (cuda or dtype == torch.float32):
            logger.warning("attention backend: torch, not %s: %s", fast, problem)
        # the CPU kernel is only chosen once checked
        checked = head_dim is not None and dtype is not None
        return fast if not problem and (cuda or checked) else "torch"
    return backend


class PagedKVCache:
    """k, v: [n_layers, num_blocks, block_size, n_kv_heads, head_dim] as the model's
    `cfg.kv_layout` says; where V is read from K (`v_in_k` = r: MLA's latent, models/mla.py) there
    is no v pool (`v` is None) and layer i's V is the view k[i][..., :r]. With a quantized
    `kv_cache_dtype`, 8-bit codes there and fp16 scales in k_scale, v_scale [n_layers, num_blocks,
    block_size, n_kv_heads]; int4: two codes a byte in k, v [.., head_dim / 2] and a scale and
    minimum per group in k_scale, v_scale [.., n_kv_heads, 2 · head_dim / group] (kv/quant.py).
    `layers`: the model layers the pool holds (default all; a pipeline stage's pool: its own,
    parallel/)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 attention_backend: str | None = "torch", num_kv_splits: int | None = None,
                 kv_cache_dtype: str = "auto", layers: range | None = None):
        layers = range(cfg.n_layers) if layers is None else layers
        self.first_layer = layers.start  # model layer i is the pool's layer i − first_layer
        layout = cfg.kv_layout  # what one token holds: K heads, and V's own pool or V inside K
        shape = (len(layers), num_blocks, block_size, layout.n_kv_heads, layout.head_dim)
        self.v_in_k = layout.v_in_k  # None: V in a pool of its own; r: V is K's first r values
        check_kv_cache_dtype(layout, kv_cache_dtype)
        self.quant = None  # K/V in the model's dtype; else their format: 8-bit codes + scales
        if kv_cache_dtype != "auto":
            self.quant = extension("kv_quant").kv_quant(kv_cache_dtype)  # kv/quant.py
        self.kv_cache_dtype, self.dtype = kv_cache_dtype, dtype  # dtype: what attention computes in
        storage = dtype if self.quant is None else self.quant.storage
        self.head_dim = layout.head_dim  # the pools' last dim, unless int4 packs two codes a byte
        code_shape, scale_shape = shape, None
        if self.quant is not None:  # 8-bit: [.., D], [.., Hkv]; int4: [.., D/2], [.., Hkv, 2·D/G]
            code_shape, scale_shape = self.quant.pool_shapes(shape)
        self.k = torch.zeros(code_shape, dtype=storage, device=device)
        self.v = None  # V read from K: no pool of its own
        if self.v_in_k is None:
            self.v = torch.zeros(code_shape, dtype=storage, device=device)
        scales = None
        if self.quant is not None:
            scales = torch.zeros(scale_shape, dtype=self.quant.scale_dtype, device=device)
        # L, nb, bs, Hkv (int4: and a scale and a minimum per group)
        self.k_scale, self.v_scale = scales, None if scales is None else scales.clone()
        self.num_blocks, self.block_size = num_blocks, block_size
        self.attention_backend = resolve_attention_backend(attention_backend, device,
                                                           layout.head_dim, dtype, layout)
        self.num_kv_splits = num_kv_splits  # triton decode: None = choose_num_splits (1 on CPU)
        # workspace
        self._gather_k = self._gather_v = torch.empty((0, *shape[2:]), dtype=dtype, device=device)

    def gather_buffers(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two buffers of ≥ num_blocks blocks [n, block_size, Hkv, D] the torch backend gathers K
        and V into, kept and reused across layers and steps (grown geometrically to the largest
        gather asked
        for: the blocks in use plus under 1/16 of padding (metadata.length_buckets), at most
        doubled)."""
        if self._gather_k.shape[0] < num_blocks:
            # grow geometrically: few reallocations
            n = max(num_blocks, 2 * self._gather_k.shape[0])
            self._gather_k = self._gather_v = None  # release the old pair before allocating the new
            shape = (n, *self.k.shape[2:4], self.head_dim)  # n, block_size, Hkv, D
            self._gather_k = torch.empty(shape, dtype=self.dtype, device=self.k.device)
            if self.v_in_k is None:  # (else V is read from the gathered K: no buffer)
                self._gather_v = torch.empty(shape, dtype=self.dtype, device=self.k.device)
        return self._gather_k, self._gather_v

    def layer(self, i: int):
        """Model layer i's K and V pools [num_blocks, block_size, Hkv, D]; quantized, each a (codes,
        scales) pair."""
        i -= self.first_layer
        if self.v_in_k is not None:  # V is K's first r values: a view, nothing stored twice
            return self.k[i], self.k[i][..., :self.v_in_k]
        if self.quant is None:
            return self.k[i], self.v[i]
        return (self.k[i], self.k_scale[i]), (self.v[i], self.v_scale[i])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: a sequence about to write into a shared block gets its own copy first."""
        for pool in (self.k, self.v, self.k_scale, self.v_scale):
            if pool is not None:
                pool[:, dst] = pool[:, src]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy K/V from slots `src` to slots `dst` (block · block_size + offset), in every layer,
        all at once (every source is read before any destination is written): a verified token
        tree's accepted path to the positions it now holds (spec_decode.py)."""
        s, d = torch.tensor(src, device=self.k.device), torch.tensor(dst, device=self.k.device)
        for pool in (self.k, self.v, self.k_scale, self.v_scale):
            if pool is not None:
                flat = pool.view(pool.shape[0], -1, *pool.shape[3:])  # layers, slots, ...
                flat[:, d] = flat[:, s]

    def view_class(self) -> type[CacheView]:
        """This backend's CacheView class (torch_backend.py, or an extension's: in_place.py)."""
        if self.attention_backend == "torch":
            return CacheView
        view = extension("attention_backends").VIEWS[self.attention_backend]
        if self.v_in_k is not None and self.attention_backend == "triton":
            return view.latent_view  # MLA's latent: the decode kernel over it (triton_backend.py)
        return view

    def build_metadata(self, common: CommonAttentionMetadata, trees: list | None = None):
        """This backend's attention metadata for a step (its view's `build_metadata`)."""
        return self.view_class().build_metadata(self, common, trees)

    def bind(self, meta: CommonAttentionMetadata) -> CacheView:
        """The view one forward writes and reads through: this backend's CacheView over `meta`."""
        return self.view_class()(self, meta)

    def view(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
             context_lens: torch.Tensor) -> CacheView:
        """A view from a step's three tensors, for tests and notebooks: it reads them on the host to
        derive the metadata (the model runner builds the metadata from host values and calls
        `bind`)."""
        common = CommonAttentionMetadata.build(slot_mapping.cpu(), block_tables.cpu(),
                                               context_lens.cpu())
        return self.bind(self.build_metadata(common).to(slot_mapping.device))


def kv_bytes_per_token(cfg: ModelConfig, dtype: Any, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V for one token in every layer: 2 · n_layers · n_kv_heads · head_dim · bytes
    per value (the model dtype's itemsize; quantized, 1 + the scale's share: kv/quant.py), rounded
    up. Where V is read from K (MLA's latent, `cfg.kv_layout`), K's alone: n_layers · (r + d_rope)
    values."""
    layout = cfg.kv_layout
    check_kv_cache_dtype(layout, kv_cache_dtype)
    value_bytes = kv_element_bytes(kv_cache_dtype, dtype, layout.head_dim)
    return math.ceil(cfg.n_layers * layout.values_per_token * value_bytes)


def check_kv_cache_dtype(layout: KVLayout, kv_cache_dtype: str) -> None:
    """Refuse a quantized pool where V is read from K (MLA): the 8-bit and int4 formats keep one
    scale per K head and another per V head, and V here has neither pool nor scale of its own."""
    if kv_cache_dtype != "auto" and layout.v_in_k is not None:
        raise NanoserveError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported for a model "
                             "whose cache holds MLA's latent (V read as the first "
                             f"{layout.v_in_k} values of K: models/mla.py); allowed: 'auto'")


def kv_element_bytes(kv_cache_dtype: str, dtype: Any, head_dim: int) -> float:
    """Bytes one K (or V) value costs in the pool: the dtype's itemsize; quantized, the code's
    and its share of the scale (kv/quant.py)."""
    if kv_cache_dtype != "auto":
        return extension("kv_quant").kv_element_bytes(kv_cache_dtype, head_dim)
    itemsize = getattr(dtype, "itemsize", None)
    if not isinstance(itemsize, int) or itemsize <= 0:
        raise NanoserveError(f"dtype={dtype!r} has no .itemsize; pass a torch.dtype such as "
                             "torch.float16")
    return float(itemsize)


def num_blocks_for_budget(cfg: ModelConfig, budget_bytes: int | None, block_size: int, dtype: Any,
                          kv_cache_dtype: str = "auto") -> int:
    """How many KV blocks fit in `budget_bytes`: one block holds `block_size` tokens' K and V in
    every layer. `dtype` is anything with `.itemsize` (torch.dtype, numpy dtype). The budget must
    hold at least one sequence of cfg.max_position_embeddings tokens, else nothing long could ever
    run.
    None: the engine's default, the bytes of 8 full-context sequences in `dtype` (8-bit K/V fit
    twice as many, int4 ~3.5x)."""
    check_block_size(block_size)
    if budget_bytes is None:
        budget_bytes = 8 * kv_bytes_per_token(cfg, dtype) * cfg.max_position_embeddings
    bytes_per_block = block_size * kv_bytes_per_token(cfg, dtype, kv_cache_dtype)
    num_blocks = max(budget_bytes, 0) // bytes_per_block
    min_blocks = -(-cfg.max_position_embeddings // block_size)
    if num_blocks < min_blocks:
        raise NanoserveError(
            f"KV cache budget of {budget_bytes} bytes is too small: one sequence of "
            f"max_position_embeddings={cfg.max_position_embeddings} tokens needs {min_blocks} "
            f"blocks of {bytes_per_block} bytes = {min_blocks * bytes_per_block} bytes; allowed: a "
            f"budget >= {min_blocks * bytes_per_block} bytes")
    return num_blocks
