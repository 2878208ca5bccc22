"""Input checks of the kernels' launchers: shapes, dtypes, devices, index ranges.

A kernel reading out of bounds does not raise, it returns garbage or crashes the process, so
every launcher checks its inputs first and raises ValueError naming the argument. Checks that
read tensor values (slot and length ranges) need a host sync, and none may run while a CUDA
graph is being captured: `can_read_values` says when they can.
"""

from __future__ import annotations

import torch

from ..quant.packing import check_gptq

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)


def can_read_values() -> bool:
    """Value checks (slot and length ranges) read tensors on the host: never inside CUDA graph capture."""
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_pools(k_cache, v_cache) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache, v_cache must both be [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"pools must share one of {DTYPES}, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("pools must be contiguous in head_dim (stride 1)")


def check_paged_attention(q, k_cache, v_cache, block_tables, context_lens, num_splits) -> None:
    check_pools(k_cache, v_cache)
    nb, bs, Hkv, D = k_cache.shape
    if q.dim() != 3 or q.shape[2] != D:
        raise ValueError(f"q must be [B, H, {D}] (head_dim of the pools), got {tuple(q.shape)}")
    B, H, _ = q.shape
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the pools' {k_cache.dtype}")
    if H % Hkv:
        raise ValueError(f"query heads H={H} must be a multiple of kv heads Hkv={Hkv} (GQA)")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.dtype not in INT_DTYPES:
        raise ValueError(f"block_tables must be int32/int64 [{B}, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if context_lens.shape != (B,) or context_lens.dtype not in INT_DTYPES:
        raise ValueError(f"context_lens must be int32/int64 [{B}], got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")
    if len({t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}) != 1:
        raise ValueError("q, pools, block_tables and context_lens must be on one device")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int ≥ 1, got {num_splits!r}")
    if B == 0 or not can_read_values():
        return
    capacity = block_tables.shape[1] * bs
    if context_lens.min() < 1 or context_lens.max() > capacity:
        raise ValueError(f"context_lens must lie in 1 .. {capacity} (max_blocks · block_size), "
                         f"got {context_lens.tolist()}")
    used = torch.arange(block_tables.shape[1], device=q.device) < (context_lens[:, None] + bs - 1) // bs  # B, M
    if ((block_tables < 0) | (block_tables >= nb))[used].any():
        raise ValueError(f"block_tables hold block ids outside 0 .. {nb - 1} within context_lens")


def check_flash_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, block_tables, k_cache, v_cache, context_lens) -> bool:
    """Raise ValueError on inconsistent inputs; return whether a paged prefix is given."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    _, H, D = q.shape
    Hkv = k.shape[1]
    if k.shape[2] != D:
        raise ValueError(f"head_dim differs: q has {D}, k/v have {k.shape[2]}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({Hkv}) for GQA")
    if not 1 <= D <= 256:
        raise ValueError(f"head_dim must be in 1..256, got {D}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype among {DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        if cu.dim() != 1 or cu.numel() < 1 or cu.dtype not in INT_DTYPES or cu.device != q.device:
            raise ValueError(f"{name} must be a 1-D int32 tensor [B+1] on {q.device}; got {tuple(cu.shape)} "
                             f"{cu.dtype} on {cu.device}")
        host = cu.cpu()
        if host[0] != 0 or host[-1] != total or bool((host[1:] < host[:-1]).any()):
            raise ValueError(f"{name} must rise from 0 to {total} (the packed length); got {host.tolist()}")
    B = cu_seqlens_q.numel() - 1
    if cu_seqlens_k.numel() != B + 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k give different batch sizes: {B} vs {cu_seqlens_k.numel() - 1}")

    paged = (block_tables, k_cache, v_cache, context_lens)
    if all(t is None for t in paged):
        return False
    if any(t is None for t in paged):
        raise ValueError("a paged prefix needs all of block_tables, k_cache, v_cache and context_lens")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != (Hkv, D):
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, {Hkv}, {D}]; got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"k_cache/v_cache dtype must be {q.dtype}; got {k_cache.dtype}, {v_cache.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.dtype not in INT_DTYPES:
        raise ValueError(f"block_tables must be an int32 [B={B}, max_blocks] tensor; got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}")
    if context_lens.shape != (B,) or context_lens.dtype not in INT_DTYPES:
        raise ValueError(f"context_lens must be an int32 [B={B}] tensor; got {tuple(context_lens.shape)} "
                         f"{context_lens.dtype}")
    if any(t.device != q.device for t in paged):
        raise ValueError(f"block_tables, k_cache, v_cache, context_lens must be on {q.device}")
    capacity = block_tables.shape[1] * k_cache.shape[1]
    lens = context_lens.cpu()
    if bool((lens < 0).any()) or bool((lens > capacity).any()):
        raise ValueError(f"context_lens must be in 0..{capacity} (max_blocks · block_size); got {lens.tolist()}")
    return True


def check_dequant_matmul(a, qweight, qzeros, scales, g_idx, bits, split_k) -> tuple[int, int]:
    """Raise ValueError on inconsistent inputs; return (K, N)."""
    if bits != 4:
        raise ValueError(f"dequant_matmul is a 4-bit kernel (W4A16), got bits={bits!r}; "
                         "use dequant_matmul_ref for 2 and 8 bits")
    K, N, _ = check_gptq(qweight, qzeros, scales, g_idx, bits, check_values=can_read_values())
    if a.dim() != 2 or a.shape[1] != K:
        raise ValueError(f"a must be [M, K] = [M, {K}] (K = 8 · qweight rows), got {tuple(a.shape)}")
    if a.dtype not in DTYPES:
        raise ValueError(f"a must be one of {DTYPES}, got {a.dtype}")
    if a.device != qweight.device:
        raise ValueError(f"a is on {a.device}, the weights on {qweight.device}")
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be an int ≥ 1 or None, got {split_k!r}")
    return K, N
