"""Input checks of the kernels' launchers: shapes, dtypes, devices, index ranges.

A kernel reading out of bounds does not raise, it returns garbage or crashes the process, so
every launcher checks its inputs first and raises ValueError naming the argument. Shape, dtype
and device checks cost nothing and always run. Checks that read tensor *values* (slot, length,
block-id and g_idx ranges, cu_seqlens rising) run only where that is free: tensors on the CPU.
On a GPU each would be a host sync (the CPU waits for the GPU to drain its queue) on every call,
so there they run only with debug checks on (NANOSERVE_DEBUG_CHECKS=1 in the environment, read
once at import), and never while a CUDA graph is being captured: `can_read_values` decides.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from ..quant.packing import check_gptq
from .configs import DTYPES, MAX_HEAD_DIM

INT_DTYPES = (torch.int32, torch.int64)
DEBUG_CHECKS = os.environ.get("NANOSERVE_DEBUG_CHECKS", "0") not in ("", "0")
_values_unread = 0  # > 0 inside values_unread()


def on_host(*tensors: torch.Tensor) -> bool:
    """Whether reading these tensors' values is free: all of them live in CPU memory."""
    return all(t.device.type == "cpu" for t in tensors)


def can_read_values(*tensors: torch.Tensor) -> bool:
    """Whether the value checks run: never inside CUDA graph capture; else on the CPU or with debug
    checks on."""
    if _values_unread or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return False
    return DEBUG_CHECKS or on_host(*tensors)


@contextmanager
def values_unread():
    """Within it, the value checks are skipped even on the CPU, as a GPU skips them: what the
    launch counter (nanoserve/tools/launch_count.py) needs to count a GPU step's kernels on a
    CPU."""
    global _values_unread
    _values_unread += 1
    try:
        yield
    finally:
        _values_unread -= 1


def check_tiles(gpu: bool, **tiles: int) -> None:
    """Tile overrides: powers of two (tl.arange), and ≥ 16 on a GPU, where tl.dot needs every
    dimension ≥ 16.

    (Triton's interpreter accepts smaller tiles, which keeps tests of ragged edges cheap.)"""
    for name, size in tiles.items():
        if not isinstance(size, int) or size < 1 or size & (size - 1) or (gpu and size < 16):
            raise ValueError(f"{name} must be a power of "
                             f"two{' ≥ 16 on a GPU (tl.dot)' if gpu else ''}, got {size!r}")


def check_window(window, causal: bool = True) -> int:
    """A sliding window: None (every key) or an int ≥ 1, with causal attention; the kernels' form, 0
    for None."""
    if window is None:
        return 0
    if type(window) is not int or window < 1:
        raise ValueError("window must be None or an int ≥ 1 (keys each query sees, itself "
                         f"included), got {window!r}")
    if not causal:
        raise ValueError(f"window={window} needs causal=True (a sliding window looks back from "
                         "each query)")
    return window


def check_tree_bits(tree_bits, q, causal: bool) -> None:
    """A token tree's visibility bits: None, or int64 [total_q] on q's device, with causal
    attention."""
    if tree_bits is None:
        return
    if not causal:
        raise ValueError("tree_bits needs causal=True (a tree's nodes see earlier nodes only)")
    if (
        not isinstance(tree_bits, torch.Tensor)
        or tree_bits.dtype != torch.int64
        or tree_bits.shape != q.shape[:1]
        or tree_bits.device != q.device
    ):
        raise ValueError(f"tree_bits must be an int64 tensor of shape [{q.shape[0]}] (one entry "
                         f"per query) on {q.device}, got "
                         f"{getattr(tree_bits, 'dtype', type(tree_bits).__name__)} "
                         f"{tuple(getattr(tree_bits, 'shape', ()))}")


def check_softcap(softcap) -> float:
    """A soft-cap of the scores (c·tanh(x / c)): None (off) or a positive finite number; the
    kernels' form (0: off)."""
    if softcap is None:
        return 0.0
    if not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be None or a positive finite number, got {softcap!r}")
    return float(softcap)


def check_sinks(sinks, num_heads: int):
    """Attention sinks (gpt-oss): None, or one floating-point logit per query head, [H]; returned
    as given. (Shape only: the values are read by the kernel, no host sync.)"""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        what = sinks.dtype if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be None or a float tensor [H], got {what}")
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must hold one logit per query head, [{num_heads}], got "
                         f"{list(sinks.shape)}")
    return sinks


def check_block_ids(block_tables, lens, block_size: int, num_blocks: int) -> None:
    """Value check: every table entry a sequence reads (its first ⌈len / block_size⌉) names a block
    of the pool. When every entry does, read or not (the engine pads its tables with live ids), one
    reduction says so."""
    if block_tables.numel():
        low, high = block_tables.aminmax()
        if bool((low >= 0) & (high < num_blocks)):
            return
    used = (torch.arange(block_tables.shape[1], device=block_tables.device)
            < (lens[:, None] + block_size - 1) // block_size)  # B, max_blocks
    if ((block_tables < 0) | (block_tables >= num_blocks))[used].any():
        raise ValueError(f"block_tables hold block ids outside 0 .. {num_blocks - 1} within "
                         "context_lens")


def pool_head_dim(k_cache, kv_cache_dtype="auto") -> int:
    """head_dim of a pool [num_blocks, block_size, Hkv, D]: its last dim, or twice it for int4 (two
    codes a byte)."""
    return k_cache.shape[-1] * (2 if kv_cache_dtype == "int4" else 1)


def check_pools(k_cache, v_cache, k_scale=None, v_scale=None, kv_cache_dtype="auto") -> int:
    """The pools [num_blocks, block_size, Hkv, D], in the model's dtype or 8-bit with their scales
    [num_blocks, block_size, Hkv] (int4: [.., Hkv, D / 2] bytes, scales [.., Hkv, 2 · D / group]);
    the kernels' KV_QUANT (kernels/kv_quant.py)."""
    from ..kv.quant import kv_quant
    from .kv_quant import kv_quant_code

    quant = kv_quant_code(kv_cache_dtype)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache, v_cache must both be [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("pools must be contiguous in head_dim (stride 1)")
    if quant == 0:
        if k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"pools must share one of {DTYPES}, got {k_cache.dtype} and "
                             f"{v_cache.dtype}")
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale, v_scale belong to a quantized pool: pass kv_cache_dtype "
                             "(int8, fp8_e4m3, fp8_e5m2)")
        return quant
    fmt = kv_quant(kv_cache_dtype)
    if k_cache.dtype != fmt.storage or v_cache.dtype != fmt.storage:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} pools hold {fmt.storage}, got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    D = pool_head_dim(k_cache, kv_cache_dtype)
    scale_shape = fmt.pool_shapes((*k_cache.shape[:3], D))[1]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if (
            s is None
            or s.shape != scale_shape
            or s.dtype != torch.float16
            or not s.is_contiguous()
        ):
            raise ValueError(f"{name} must be a contiguous float16 "
                             f"[{', '.join(map(str, scale_shape))}] (one scale per slot and "
                             f"kv head; int4: a scale and a minimum per group), got "
                             f"{None if s is None else (s.dtype, tuple(s.shape))}")
        if s.device != k_cache.device:
            raise ValueError(f"{name} is on {s.device}, the pools on {k_cache.device}")
    return quant


def check_slot_mapping(slot_mapping, n: int, num_slots: int) -> None:
    """A step's slots [n] (int32/int64), each −1 (padding: not written) or a slot of the pool's
    `num_slots` (values read where that is free)."""
    if slot_mapping.shape != (n,) or slot_mapping.dtype not in INT_DTYPES:
        raise ValueError(f"slot_mapping must be int32/int64 [{n}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if can_read_values(slot_mapping) and slot_mapping.numel() and (
            slot_mapping.min() < -1 or slot_mapping.max() >= num_slots):
        raise ValueError(f"slot_mapping holds slots outside −1 .. {num_slots - 1}")


def check_tables(block_tables, context_lens, B: int) -> None:
    """A paged read's block tables [B, max_blocks] and context lengths [B], both int32/int64."""
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] != B
        or block_tables.dtype not in INT_DTYPES
    ):
        raise ValueError(f"block_tables must be int32/int64 [{B}, max_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if context_lens.shape != (B,) or context_lens.dtype not in INT_DTYPES:
        raise ValueError(f"context_lens must be int32/int64 [{B}], got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")


def check_paged_attention(q, k_cache, v_cache, block_tables, context_lens, num_splits,
                          max_context=None,
                          k_scale=None, v_scale=None, kv_cache_dtype="auto") -> int:
    """Raise ValueError on inconsistent inputs; return the kernels' KV_QUANT."""
    quant = check_pools(k_cache, v_cache, k_scale, v_scale, kv_cache_dtype)
    nb, bs, Hkv = k_cache.shape[:3]
    D = pool_head_dim(k_cache, kv_cache_dtype)
    if q.dim() != 3 or q.shape[2] != D:
        raise ValueError(f"q must be [B, H, {D}] (head_dim of the pools), got {tuple(q.shape)}")
    B, H, _ = q.shape
    if q.dtype != k_cache.dtype and not (quant and q.dtype in DTYPES):
        raise ValueError(f"q dtype {q.dtype} differs from the pools' {k_cache.dtype}")
    if H % Hkv:
        raise ValueError(f"query heads H={H} must be a multiple of kv heads Hkv={Hkv} (GQA)")
    check_tables(block_tables, context_lens, B)
    if len({t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}) != 1:
        raise ValueError("q, pools, block_tables and context_lens must be on one device")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int ≥ 1, got {num_splits!r}")
    if max_context is not None and (not isinstance(max_context, int) or max_context < 1):
        raise ValueError(f"max_context must be an int ≥ 1 or None, got {max_context!r}")
    if B == 0 or not can_read_values(block_tables, context_lens):
        return quant
    capacity = (
        block_tables.shape[1] * bs if max_context is None
        else min(max_context, block_tables.shape[1] * bs)
    )
    if context_lens.min() < 1 or context_lens.max() > capacity:
        raise ValueError(f"context_lens must lie in 1 .. {capacity} (max_blocks · block_size, and "
                         f"max_context), got {context_lens.tolist()}")
    check_block_ids(block_tables, context_lens, bs, nb)
    return quant


def check_flash_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, block_tables, k_cache, v_cache,
                          context_lens,
                          max_seqlen_q=None, k_scale=None, v_scale=None,
                          kv_cache_dtype="auto") -> bool:
    """Raise ValueError on inconsistent inputs; return whether a paged prefix is given."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    _, H, D = q.shape
    Hkv = k.shape[1]
    if k.shape[2] != D:
        raise ValueError(f"head_dim differs: q has {D}, k/v have {k.shape[2]}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({Hkv}) for GQA")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {D}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype among {DTYPES}; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dim() != 1 or cu.numel() < 1 or cu.dtype not in INT_DTYPES or cu.device != q.device:
            raise ValueError(f"{name} must be a 1-D int32 tensor [B+1] on {q.device}; got "
                             f"{tuple(cu.shape)} {cu.dtype} on {cu.device}")
    B = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() != B + 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k give different batch sizes: {B} vs "
                         f"{cu_seqlens_k.numel() - 1}")
    if max_seqlen_q is not None and (not isinstance(max_seqlen_q, int) or max_seqlen_q < 0):
        raise ValueError(f"max_seqlen_q must be an int ≥ 0 or None, got {max_seqlen_q!r}")
    has_prefix = _check_flash_prefix(
        q, k, B, block_tables, k_cache, v_cache, context_lens, k_scale, v_scale, kv_cache_dtype
    )
    if not can_read_values(cu_seqlens_q, cu_seqlens_k,
                           *((block_tables, context_lens) if has_prefix else ())):
        return has_prefix
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]),
                            ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        if cu[0] != 0 or cu[-1] != total or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"{name} must rise from 0 to {total} (the packed length); got "
                             f"{cu.tolist()}")
    if (
        max_seqlen_q is not None
        and B
        and max_seqlen_q < int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    ):
        raise ValueError(f"max_seqlen_q={max_seqlen_q} is shorter than the longest query sequence: "
                         f"{(cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()}")
    if has_prefix:
        capacity = block_tables.shape[1] * k_cache.shape[1]
        if bool((context_lens < 0).any()) or bool((context_lens > capacity).any()):
            raise ValueError(f"context_lens must be in 0..{capacity} (max_blocks · block_size); "
                             f"got {context_lens.tolist()}")
        check_block_ids(block_tables, context_lens, k_cache.shape[1], k_cache.shape[0])
    return has_prefix


def _check_flash_prefix(q, k, B, block_tables, k_cache, v_cache, context_lens, k_scale, v_scale,
                        kv_cache_dtype) -> bool:
    """Shapes of the optional paged prefix (in q's dtype, or quantized with its scales); whether it
    is given."""
    Hkv, D = k.shape[1:]
    paged = (block_tables, k_cache, v_cache, context_lens)
    if all(t is None for t in paged):
        if kv_cache_dtype != "auto" or k_scale is not None or v_scale is not None:
            raise ValueError("kv_cache_dtype, k_scale and v_scale describe a paged prefix: pass "
                             "its pools too")
        return False
    if any(t is None for t in paged):
        raise ValueError("a paged prefix needs all of block_tables, k_cache, v_cache and "
                         "context_lens")
    stored = D // 2 if kv_cache_dtype == "int4" else D  # int4: two codes a byte
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != (Hkv, stored):
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, {Hkv}, {stored}]; "
                         "got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if not check_pools(k_cache, v_cache, k_scale, v_scale,
                       kv_cache_dtype) and k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache/v_cache dtype must be {q.dtype}; got {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    check_tables(block_tables, context_lens, B)
    if any(t.device != q.device for t in paged):
        raise ValueError(f"block_tables, k_cache, v_cache, context_lens must be on {q.device}")
    return True


def check_mma_layout(K: int, mma_layout: bool) -> None:
    """The MMA layout (int4_tiles.to_mma_layout) reorders whole tiles of 128 rows."""
    if not isinstance(mma_layout, bool):
        raise ValueError(f"mma_layout must be True or False, got {mma_layout!r}")
    if mma_layout and K % 128:
        raise ValueError(f"mma_layout=True reorders tiles of 128 rows; K={K} is not a multiple "
                         "of 128")


def check_dequant_matmul(a, qweight, qzeros, scales, g_idx, bits, split_k,
                         group_size=None, mma_layout: bool = False) -> tuple[int, int]:
    """Raise ValueError on inconsistent inputs; return (K, N)."""
    if bits != 4:
        raise ValueError(f"dequant_matmul is a 4-bit kernel (W4A16), got bits={bits!r}; "
                         "use dequant_matmul_ref for 2 and 8 bits")
    K, N, _ = check_gptq(qweight, qzeros, scales, g_idx, bits, check_values=can_read_values(g_idx))
    if a.dim() != 2 or a.shape[1] != K:
        raise ValueError(f"a must be [M, K] = [M, {K}] (K = 8 · qweight rows), got "
                         f"{tuple(a.shape)}")
    if a.dtype not in DTYPES:
        raise ValueError(f"a must be one of {DTYPES}, got {a.dtype}")
    if a.device != qweight.device:
        raise ValueError(f"a is on {a.device}, the weights on {qweight.device}")
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be an int ≥ 1 or None, got {split_k!r}")
    if group_size is not None:
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int ≥ 1 or None, got {group_size!r}")
        if can_read_values(g_idx) and not torch.equal(g_idx.long().cpu(),
                                                      torch.arange(K) // group_size):
            raise ValueError(f"group_size={group_size} says g_idx is k // {group_size}, but it is "
                             "not (act-order?): pass group_size=None")
    check_mma_layout(K, mma_layout)
    return K, N
